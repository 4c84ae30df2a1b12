"""What the kernel and rank 0 say to each other, and what rank 0 shares with the other ranks.

Kernel <-> rank 0: the typed messages below, as JSON objects over one local
pyzmq ``PAIR`` socket (the kernel binds, rank 0 connects); :func:`pack` and
:func:`unpack` are the only code that spells the wire's names. Rank 0 -> other
ranks: a :class:`Job`, broadcast through MLX collectives (:mod:`.agreement`).

Kernel to rank 0: :class:`Generate`, :class:`Control`, :class:`Seen` (rank 0
stays within :data:`MAX_AHEAD` tokens of it), :class:`Ping`, :class:`Shutdown`.
Rank 0 to kernel: :class:`Ready`, :class:`FailedStart`, :class:`Pong`,
:class:`StateChanged`, :class:`Reasoning`, :class:`Progress`,
:class:`Tokens`, :class:`Stats`, :class:`Finish`.

The request crosses the wire once, as :class:`GenerationRequest`'s own fields
(:func:`request_fields` / :func:`request_from_fields`): the kernel validated
it; rank 0 tokenizes the prompt and fixes the seed, and every rank samples
with the local engine's sampler built from it.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from ..generation.request import GenerationRequest
from ..generation.stats import GenerationStats

# Every ranks' idle loop meets in one collective this often (seconds): a
# request waits at most this long before all ranks start it.
IDLE_TICK_S = 0.05
# The kernel pings rank 0 this often; rank 0 answers at once while idle or
# paused, and every piece of work ends with a message anyway.
PING_S = 0.5
# Rank 0 runs at most this many tokens ahead of what the kernel has read (the
# kernel acknowledges each ``Tokens`` with ``Seen``). A kernel whose client
# thread lags (busy ranks and busy loops on the same cores: 0.35 s measured) would
# otherwise find a Pause asked at token 6 landing after token 120.
MAX_AHEAD = 8


class Op:
    """What the ranks' shared header collective announces."""

    NOOP = 0
    JOB = 1
    SHUTDOWN = 2


def request_fields(request: GenerationRequest) -> dict[str, Any]:
    """``request`` as JSON-ready fields (the model name stays with the kernel: the ranks have theirs)."""
    values = {f.name: getattr(request, f.name) for f in fields(GenerationRequest) if f.name != "model"}
    if values.get("logit_bias") is not None:
        values["logit_bias"] = {str(k): v for k, v in values["logit_bias"].items()}
    return values


def request_from_fields(values: dict[str, Any]) -> GenerationRequest:
    """The request :func:`request_fields` wrote (JSON object keys are strings: the logit bias's ids come back)."""
    known = {f.name for f in fields(GenerationRequest)}
    values = {k: v for k, v in values.items() if k in known}
    if values.get("logit_bias") is not None:
        values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
    return GenerationRequest(**values)


@dataclass
class Job:
    """One generation as every rank runs it.

    Args:
        id: The kernel's generation id.
        request: The request with its prompt as token ids (tokenized by rank 0)
          and its seed fixed (rank 0 picks one when the request has none:
          every rank must sample the same token).
    """

    id: int
    request: GenerationRequest

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids."""
        prompt: list[int] = self.request.prompt  # type: ignore[assignment]  # ids, by construction
        return prompt

    def encode(self) -> bytes:
        """The job as bytes (for the broadcast)."""
        return json.dumps({"id": self.id, "request": request_fields(self.request)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Job:
        """The job from :meth:`encode`'s bytes."""
        values = json.loads(data)
        return cls(int(values["id"]), request_from_fields(values["request"]))


# -- the messages ------------------------------------------------------------------------


@dataclass
class Message:
    """A message on the kernel's socket; ``TYPE`` is its name on the wire."""

    TYPE: ClassVar[str] = ""


@dataclass
class Generate(Message):
    """Kernel: run a generation (``request``: :func:`request_fields`)."""

    TYPE: ClassVar[str] = "generate"
    id: int
    request: dict[str, Any]


@dataclass
class Control(Message):
    """Kernel: ``action`` (``stop``, ``pause``, ``resume``) for generation ``id``, running or queued."""

    TYPE: ClassVar[str] = "control"
    id: int
    action: str


@dataclass
class Seen(Message):
    """Kernel: it has read ``n`` tokens of generation ``id``."""

    TYPE: ClassVar[str] = "seen"
    id: int
    n: int


@dataclass
class Ping(Message):
    """Kernel: are you there (rank 0 answers :class:`Pong` between any two pieces of work)."""

    TYPE: ClassVar[str] = "ping"


@dataclass
class Shutdown(Message):
    """Kernel: stop what runs and end the ranks."""

    TYPE: ClassVar[str] = "shutdown"


@dataclass
class Ready(Message):
    """Rank 0: every rank loaded its shard."""

    TYPE: ClassVar[str] = "ready"
    ranks: int
    backend: str
    model: str
    load_s: float
    nbytes: int


@dataclass
class FailedStart(Message):
    """Rank 0: the ranks could not load the model (``error``: one line)."""

    TYPE: ClassVar[str] = "failed_start"
    error: str


@dataclass
class Pong(Message):
    """Rank 0: alive."""

    TYPE: ClassVar[str] = "pong"


@dataclass
class StateChanged(Message):
    """Rank 0: generation ``id`` is now in ``state`` (a :class:`~mlx_notebook.State` value)."""

    TYPE: ClassVar[str] = "state"
    id: int
    state: str


@dataclass
class Reasoning(Message):
    """Rank 0: the model's reasoning tags (text and token ids), and whether the prompt left the block open.

    Sent once when a generation of a model with thinking tags starts: the
    kernel has no tokenizer, and splits reasoning from answer with these.
    """

    TYPE: ClassVar[str] = "reasoning"
    id: int
    start: str
    end: str
    start_ids: list[int]
    end_ids: list[int]
    open: bool


@dataclass
class Progress(Message):
    """Rank 0: ``done`` of ``total`` in ``phase``."""

    TYPE: ClassVar[str] = "progress"
    id: int
    phase: str
    done: int
    total: int


@dataclass
class Tokens(Message):
    """Rank 0: new tokens of generation ``id`` and the text they completed."""

    TYPE: ClassVar[str] = "tokens"
    id: int
    ids: list[int]
    text: str


@dataclass
class Stats(Message):
    """Rank 0: the generation's stats so far (:class:`ClusterStats` fields)."""

    TYPE: ClassVar[str] = "stats"
    id: int
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Finish(Message):
    """Rank 0: generation ``id`` ended in ``state``; ``lost``: a rank is gone and the cluster can run nothing more."""

    TYPE: ClassVar[str] = "finish"
    id: int
    state: str
    error: str | None = None
    lost: bool = False


_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Generate,
        Control,
        Seen,
        Ping,
        Shutdown,
        Ready,
        FailedStart,
        Pong,
        StateChanged,
        Reasoning,
        Progress,
        Tokens,
        Stats,
        Finish,
    )
}


def pack(message: Message) -> bytes:
    """A message as bytes for the socket."""
    return json.dumps({"type": message.TYPE, **asdict(message)}).encode()


def unpack(data: bytes) -> Message:
    """A message from the socket.

    Raises:
        ValueError: Not a message of this protocol (another version of mlx-notebook on the other end).
    """
    values = json.loads(data)
    cls = _TYPES.get(values.pop("type", None)) if isinstance(values, dict) else None
    if cls is None:
        raise ValueError(f"not an mlx-notebook cluster message: {data[:80]!r}")
    return cls(**values)


@dataclass
class ClusterStats(GenerationStats):
    """A cluster generation's stats: the local ones (with ``ranks`` and ``backend``), plus what agreeing cost.

    Args:
        agreements: Checkpoints agreed by all ranks (one small ``all_sum`` each). Default: ``0``.
        agreement_s: Seconds rank 0 spent in those collectives. Default: ``0.0``.
    """

    agreements: int = 0
    agreement_s: float = 0.0
