"""What the kernel and rank 0 say to each other, and what rank 0 shares with the other ranks.

Kernel <-> rank 0: JSON objects over one local pyzmq ``PAIR`` socket (the
kernel binds, rank 0 connects). Rank 0 -> other ranks: a :class:`Job`,
broadcast through MLX collectives (:mod:`.agreement`).

Kernel to rank 0 (``op``): ``generate`` (``id``, ``request``: the
:class:`~mlx_notebook.generation.request.GenerationRequest` fields),
``control`` (``id``, ``action``: ``stop`` / ``pause`` / ``resume``),
``seen`` (``id``, ``n``: tokens the kernel has read; rank 0 stays within
:data:`MAX_AHEAD` of it), ``ping``, ``shutdown``.

Rank 0 to kernel (``ev``): ``ready`` (``ranks``, ``backend``, ``model``,
``load_s``), ``failed_start`` (``error``), ``pong``, ``state`` (``id``,
``state``), ``progress`` (``id``, ``phase``, ``done``, ``total``),
``tokens`` (``id``, ``ids``, ``text``), ``stats`` (``id``, ``stats``),
``finish`` (``id``, ``state``, ``error``, ``lost``: a rank is gone and the
cluster can run nothing more).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..generation.stats import GenerationStats

# Every ranks' idle loop meets in one collective this often (seconds): a
# request waits at most this long before all ranks start it.
IDLE_TICK_S = 0.05
# The kernel pings rank 0 this often; rank 0 answers at once while idle or
# paused, and every piece of work ends with a message anyway.
PING_S = 0.5
# Rank 0 runs at most this many tokens ahead of what the kernel has read (the
# kernel acknowledges each ``tokens`` event with ``seen``). A kernel whose client
# thread lags (busy ranks and busy loops on the same cores: 0.35 s measured) would
# otherwise find a Pause asked at token 6 landing after token 120.
MAX_AHEAD = 8


class Op:
    """What the ranks' shared header collective announces."""

    NOOP = 0
    JOB = 1
    SHUTDOWN = 2


@dataclass
class Job:
    """One generation as every rank runs it (the prompt already tokenized by rank 0).

    Args:
        id: The kernel's generation id.
        prompt: Token ids.
        max_tokens: Most tokens to generate.
        temperature: 0 for greedy.
        top_p: Nucleus sampling mass.
        seed: The sampling seed (rank 0 picks one when the request has none:
          every rank must sample the same token).
        budget_s: Seconds one piece of work may take.
    """

    id: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    budget_s: float

    def encode(self) -> bytes:
        """The job as bytes (for the broadcast)."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Job:
        """The job from :meth:`encode`'s bytes."""
        return cls(**json.loads(data))


@dataclass
class ClusterStats(GenerationStats):
    """A cluster generation's stats: the local ones (with ``ranks`` and ``backend``), plus what agreeing cost.

    Args:
        agreements: Checkpoints agreed by all ranks (one small ``all_sum`` each). Default: ``0``.
        agreement_s: Seconds rank 0 spent in those collectives. Default: ``0.0``.
    """

    agreements: int = 0
    agreement_s: float = 0.0


def pack(message: dict[str, Any]) -> bytes:
    """A message as bytes for the socket."""
    return json.dumps(message).encode()


def unpack(data: bytes) -> dict[str, Any]:
    """A message from the socket."""
    message: dict[str, Any] = json.loads(data)
    return message
