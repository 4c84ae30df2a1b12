"""The device in turns: a prompt prefilled on the prefill thread and the others' decode steps queue their work one at a time.

Where a joining prompt is prefilled on a thread of its own (:mod:`.prefill_thread`),
its pieces and the worker's steps go to two streams, and CUDA interleaves two
streams' kernels one by one: with both queued, every kernel of the others' step
waits behind one of the prompt's. Measured on an H200 (Qwen3-8B shape, 7 rows
decoding while an 8k prompt joins, budget 0.01): one of their steps stretched to
45 ms while a chunk ran, and their longest gap between two tokens was 35-54 ms
against budget + 2 steps of 34-41 ms (sessions 25-31, docs/benchmarks.md). The
prompt's thread waiting for one of their steps before each piece (session 31's
"turn") did not help: the worker had queued its next step before reading the
last, so the two overlapped again.

Here each side waits for the other, so the device runs one step, then one piece:
- the worker queues a step only once the piece before it is done, and builds
  the step meanwhile (:meth:`.DecodeBatch.step`'s ``hold``): the others' gap is
  about one step plus one piece, and a piece is sized to the budget;
- the prefill thread hands the device over at its first checkpoint after
  ``slice_s`` of holding it (with ``ahead``: at the one before its hold would
  pass it, its pieces' pace read between its asks), and takes it again once
  one of the others' steps ended. Its last layer groups stay queued
  (:meth:`DeviceTurns.gate`): the worker's stream waits on the device for a
  mark computed after them, so the worker queues its step while they run
  and the device runs one, then the other. Drained on the host first, the
  step was queued only after they ended, and the device waited for its
  queueing: on an H100 (session 53, 18 joins a side) the joining prompt's
  first token came 0.91x as late gated (median of pairs), its prefill's
  median gap 0.9 ms shorter, the others' longest gap alike.

Neither waits forever: the worker waits at most ``worker_wait_s`` (a piece that
runs long, e.g. while a graph for a new shape is built on the host, costs the
others that wait, not a step's worth more), and the prefill thread goes on when
the worker has no step to run (``pass_turn``), after ``side_wait_s``, or at a
stop or pause of its prompt (``wake``, one of its token's watchers).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

_SIDE = "side"
_WORKER = "worker"


@dataclass
class TurnCounts:
    """How the turns went: how many each side took, how long they waited and held the device, how many waits ran out.

    The times are the host's clock around the waits, so they cost nothing to
    keep and read the same untraced: the others' gap while a prompt joins is
    about the worker's wait plus its step (``benchmarks/batching.py`` reports them).
    """

    side_turns: int = 0
    worker_turns: int = 0
    side_timeouts: int = 0
    worker_timeouts: int = 0
    worker_wait_s: float = 0.0
    worker_wait_max_s: float = 0.0
    side_wait_s: float = 0.0
    side_wait_max_s: float = 0.0
    # From the prefill thread's take of the device to its hand-over (its pieces queued and drained, or gated).
    side_hold_max_s: float = 0.0
    # Hand-overs with the prompt's last groups left queued, the others' step queued behind them (gate()).
    side_gates: int = 0

    def worker_waited(self, seconds: float) -> None:
        self.worker_wait_s += seconds
        self.worker_wait_max_s = max(self.worker_wait_max_s, seconds)

    def side_waited(self, seconds: float) -> None:
        self.side_wait_s += seconds
        self.side_wait_max_s = max(self.side_wait_max_s, seconds)


class DeviceTurns:
    """The device shared in turns between the worker's decode steps and one prompt's prefill pieces.

    Args:
        slice_s: How long the prefill thread holds the device before it hands it
          over at a checkpoint.
        worker_wait_s: The longest the worker waits for a piece before it steps anyway.
        side_wait_s: The longest the prefill thread waits for one of the others' steps.
        ahead: Hand over before the hold would pass ``slice_s``, not at the
          first checkpoint past it. Default: ``False`` (off until measured on a
          device, where the prefill thread runs: pieces are sized near the
          slice, so a hold ran to two of them, and the turns shrink the
          prompt's share of the device, which slows its prefill; on the CPU
          with the thread forced, 1.3-2x longer to its first token).
    """

    def __init__(self, slice_s: float, worker_wait_s: float, side_wait_s: float, *, ahead: bool = False) -> None:
        self.slice_s = slice_s
        self.ahead = ahead
        self.worker_wait_s = worker_wait_s
        self.side_wait_s = side_wait_s
        self.counts = TurnCounts()
        self._cond = threading.Condition()
        self._owner: str | None = None
        self._taken_at = 0.0
        # Steps the worker ran since the start, and whether it has none to run now.
        self._steps = 0
        self._idle = False
        # While the prefill thread waits for the device: the worker's step count when it let go.
        self._wanted_after: int | None = None
        # What due() last told the prefill thread since its last checkpoint (None: not asked; the clock decides).
        self._told: bool | None = None
        # Seconds between two of the prefill thread's asks in one hold (about a piece), and its last ask.
        self.piece_s = 0.0
        self._asked_at: float | None = None
        self._closed = False
        # The prefill thread's hand-over mark: an array its stream computes after the work it left queued (gate()).
        self._gate: mx.array | None = None

    # -- the worker thread ---------------------------------------------------------

    @contextlib.contextmanager
    def worker_turn(self) -> Iterator[None]:
        """Hold the device for one step of the others (their work queued and read inside)."""
        with self._cond:
            asked = time.perf_counter()
            deadline = asked + self.worker_wait_s
            while not self._closed and (self._owner == _SIDE or self._side_is_due()):
                left = deadline - time.perf_counter()
                if left <= 0:
                    self.counts.worker_timeouts += 1
                    break
                self._cond.wait(left)
            self.counts.worker_waited(time.perf_counter() - asked)
            if self._owner == _SIDE:
                self._hand_over()  # the wait ran out: the side's hold ends here
            # Also after a wait that ran out: the prefill thread's next take waits for this step.
            self._owner = _WORKER
            self._idle = False
            self.counts.worker_turns += 1
            gate, self._gate = self._gate, None
        if gate is not None:
            # The step queued next waits on the device for the prompt's work left queued (a stream wait, not the host).
            mx.async_eval(_after(gate))
        try:
            yield
        finally:
            with self._cond:
                if self._owner == _WORKER:
                    self._owner = None
                self._steps += 1
                self._cond.notify_all()

    def pass_turn(self) -> None:
        """The worker has no step to run now (every other row paused): the prefill thread need not wait for one."""
        with self._cond:
            self._idle = True
            self._cond.notify_all()

    def _side_is_due(self) -> bool:
        """Whether the prefill thread waits for the device and one of the others' steps ran since it let go."""
        return self._wanted_after is not None and (self._steps > self._wanted_after or self._idle)

    # -- the prefill thread --------------------------------------------------------

    def due(self) -> bool:
        """Whether the prefill thread hands the device over at its next checkpoint (drain its work first).

        The answer is kept for that checkpoint, which hands over exactly when
        the work was drained for it: read twice, a slice that ran out between
        the reads (while the drain waited for a piece) handed the device over
        with the next piece still queued, and the others' step ran beside it.
        """
        now = time.perf_counter()
        if self._owner != _SIDE:
            due = True
        else:
            if self._asked_at is not None:
                # The pieces' pace: one is queued behind the one waited for between two asks.
                seen = now - self._asked_at
                self.piece_s = seen if not self.piece_s else (self.piece_s + seen) / 2
            self._asked_at = now
            # Ahead: the piece just queued ends about a piece from now, the next one a piece later.
            due = self._hold_passes_slice(now, pieces_ahead=2)
        self._told = due
        return due

    def gate(self, last: mx.array) -> None:
        """At a hand-over, the prefill thread leaves ``last`` (its newest queued work) on the device, undrained.

        The worker's next step is queued behind it on the device: its stream
        waits for a mark this thread's stream computes after ``last``, so the
        host builds and queues the step while the prompt's groups finish, and
        the device runs them one after the other, not interleaved. A mark of
        its own, not ``last``: only the worker touches it from here on.
        """
        mark = _after(last)
        mx.async_eval(mark)
        with self._cond:
            self._gate = mark
            self.counts.side_gates += 1

    def side_checkpoint(self, requested: Callable[[], bool]) -> None:
        """At a checkpoint of the prompt: hand the device over when due, and take it back after one of the others' steps.

        ``requested``: whether a stop or pause of the prompt waits (the wait
        ends at once then, and the checkpoint after this call acts on it).
        """
        with self._cond:
            if self._closed:
                return
            told, self._told = self._told, None
            if self._owner == _SIDE:
                # Not asked since the last checkpoint (nothing queued): the clock decides (ahead: with the next piece).
                if told is None:
                    told = self._hold_passes_slice(time.perf_counter(), pieces_ahead=1)
                if not told:
                    return
                self._hand_over()
                self._wanted_after = self._steps  # one step of the others, then the device again
            else:
                self._wanted_after = self._steps - 1  # not held before (or let go at a pause): as soon as it is free
            self._cond.notify_all()
            asked = time.perf_counter()
            deadline = asked + self.side_wait_s
            try:
                while not (self._owner is None and self._side_is_due()):
                    if self._closed or requested():
                        return  # the checkpoint after this call acts on the request
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        self.counts.side_timeouts += 1
                        break
                    self._cond.wait(left)
                self._owner = _SIDE
                self._taken_at = time.perf_counter()
                self._asked_at = None
                self.counts.side_turns += 1
            finally:
                self.counts.side_waited(time.perf_counter() - asked)
                self._wanted_after = None
                self._cond.notify_all()

    def _hold_passes_slice(self, now: float, pieces_ahead: int) -> bool:
        """Whether the prefill thread's hold has passed its slice (with ``ahead``: would, ``pieces_ahead`` pieces on)."""
        ahead_s = pieces_ahead * self.piece_s if self.ahead else 0.0
        return now - self._taken_at + ahead_s >= self.slice_s

    def _hand_over(self) -> None:
        """The prefill thread's hold ends (the condition's lock held): no owner, its length counted."""
        self._owner = None
        self.counts.side_hold_max_s = max(self.counts.side_hold_max_s, time.perf_counter() - self._taken_at)

    def release(self) -> None:
        """The prompt lets go of the device (a pause blocks it); it takes it again at a later checkpoint."""
        with self._cond:
            if self._owner == _SIDE:
                self._hand_over()
                self._cond.notify_all()

    def wake(self) -> None:
        """A request reached the prompt's token: a wait of the prefill thread looks at it now."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """The prompt's prefill ended: nobody waits for it again."""
        with self._cond:
            self._closed = True
            if self._owner == _SIDE:
                self._hand_over()
            self._owner = None
            self._cond.notify_all()


def _after(work: mx.array) -> mx.array:
    """A one-byte array computed after ``work`` on the stream it is evaluated on (a wait, not a copy)."""
    return mx.depends([mx.zeros((1,), dtype=mx.uint8)], [work])[0]
