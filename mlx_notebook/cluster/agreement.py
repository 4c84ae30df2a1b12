"""Every rank takes the same decision at the same piece boundary, through one small collective.

A sharded model runs collectives inside its forward pass: if one rank stops
(or pauses, or picks another chunk size) at a boundary where another goes
on, the other waits forever in its next collective. So every decision a
rank would take alone is taken by all of them in one ``all_sum`` of a few
integers per checkpoint: the stop and pause flags (only rank 0 hears the
kernel; the others add zeros) and one number rank 0 proposes (the next
chunk size, how many decode steps to keep queued).

Example (every rank runs the same code)::

    pace = AgreedPace(token, budget_s, group=group, poll=inbox.poll)
    for piece in pieces:
        run(piece)
        n = pace.agree(proposal=planner_size)  # raises Cancelled on every rank, or blocks while paused

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..control import Cancelled, Pace
from .protocol import IDLE_TICK_S


def exchange(group: Any, values: list[int]) -> list[int]:
    """The element-wise sum of ``values`` over all ranks (one ``all_sum`` of int32)."""
    total = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=group)
    result: list[int] = total.tolist()  # type: ignore[assignment]  # a 1-d int array
    return result


def broadcast_bytes(group: Any, data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (the others pass ``None``): a length, then the bytes."""
    leader = group.rank() == 0
    (size,) = exchange(group, [len(data or b"") if leader else 0])
    if size == 0:
        return b""
    # One int32 per byte: int32 sums are what every backend reduces (ring, mpi, jaccl, nccl).
    local = np.frombuffer(data, dtype=np.uint8) if leader and data else np.zeros(size, dtype=np.uint8)
    total = mx.distributed.all_sum(mx.array(local.astype(np.int32)), group=group)
    return bytes(np.array(total).astype(np.uint8))


@dataclass
class AgreedPace(Pace):
    """A :class:`~mlx_notebook.control.Pace` whose checkpoint agrees across ranks.

    Args:
        group: The MLX distributed group. Default: ``None`` (the global group).
        poll: On rank 0: read the kernel's messages into the token, waiting up
          to the given seconds (called before each agreement and while
          paused). ``None`` on the other ranks. Default: ``None``.
        on_tick: Called on every rank at each agreement while paused (rank 0
          tells the kernel it is alive). Default: ``None``.
    """

    group: Any = None
    poll: Callable[[float], None] | None = None
    on_tick: Callable[[], None] | None = None
    collectives: int = 0
    collective_s: float = 0.0

    @property
    def leader(self) -> bool:
        """Whether this is rank 0 (the rank that hears the kernel)."""
        return bool(self.group is None or self.group.rank() == 0)

    def checkpoint(self) -> None:
        """Raise :class:`Cancelled` on every rank after a stop; block every rank while paused."""
        self.agree()

    def agree(self, proposal: int = 0) -> int:
        """Agree on stop / pause and on rank 0's ``proposal``; return the agreed proposal.

        Raises:
            Cancelled: A stop was requested (on rank 0, heard from the kernel).
        """
        stop, pause, agreed = self._exchange(proposal, wait_s=0.0)
        if stop:
            raise Cancelled()
        if pause:
            self._paused()
        return agreed

    def choose(self, proposal: int) -> int:
        """Rank 0's ``proposal`` on every rank (an agreement, so also a checkpoint)."""
        return self.agree(proposal)

    def _exchange(self, proposal: int, *, wait_s: float) -> tuple[int, int, int]:
        if self.poll is not None:
            self.poll(wait_s)
        local = [int(self.token.cancelled), int(self.token.pause_requested), proposal] if self.leader else [0, 0, 0]
        t0 = time.perf_counter()
        stop, pause, agreed = exchange(self.group, local)
        self.collective_s += time.perf_counter() - t0
        self.collectives += 1
        return stop, pause, agreed

    def _paused(self) -> None:
        if self.on_pause is not None:
            self.on_pause()
        while True:
            # Rank 0 waits for the kernel's next message (or a tick); the others
            # wait for rank 0 inside the collective.
            stop, pause, _ = self._exchange(0, wait_s=IDLE_TICK_S)
            if self.on_tick is not None:
                self.on_tick()
            if stop:
                raise Cancelled()
            if not pause:
                break
        if self.on_resume is not None:
            self.on_resume()
