"""The cancel token: stop, pause and resume requests between pieces of work.

The engine never interrupts a piece of device work; it calls
:meth:`CancelToken.checkpoint` between two pieces instead. A stop request makes
the next checkpoint raise :class:`Cancelled`; a pause request makes it block
until resumed or stopped. Every request and the moment it took effect are
recorded, so stop latency is measured rather than guessed.

Example::

    token = CancelToken()
    pace = Pace(token, budget_s=0.05, on_pause=synchronize)
    threading.Timer(1.0, token.cancel).start()
    try:
        for piece in work:
            run(piece)          # sized so that one piece takes about pace.budget_s
            pace.checkpoint()
    except Cancelled:
        synchronize()
        token.mark_stopped()

A :class:`Pace` is what travels down the library: one per generation, the
token plus the budget pieces are sized to plus what a pause must do.

This module knows about threading only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Hook = Callable[[], None]


# Seconds one piece of work may take, i.e. the longest a stop or pause waits.
# 0.1 s: on a 2-core CPU it keeps every phase's p99 stop under 0.15 s (or two
# decode steps) at no measured throughput cost (docs/benchmarks.md).
DEFAULT_STOP_BUDGET_S = 0.1


class Cancelled(Exception):
    """Raised by :meth:`CancelToken.checkpoint` once a stop was requested."""


@dataclass
class ControlEvent:
    """One request and when it took effect (``time.perf_counter()`` seconds).

    Args:
        kind: ``"cancel"``, ``"pause"`` or ``"resume"``.
        requested_at: When the request was made.
        effective_at: When the worker acted on it (``None`` until then).
    """

    kind: str
    requested_at: float
    effective_at: float | None = None

    @property
    def latency_s(self) -> float | None:
        """Seconds from the request to its effect, or ``None`` if pending."""
        if self.effective_at is None:
            return None
        return self.effective_at - self.requested_at


class CancelToken:
    """Thread-safe stop / pause / resume requests checked at checkpoints."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._cancelled = False
        self._paused = False
        self.events: list[ControlEvent] = []
        # Called (outside the lock) after every request: a worker that runs
        # several generations waits on its own condition, not on each token's.
        self.watchers: list[Hook] = []

    # -- requests (any thread) ---------------------------------------------

    def cancel(self) -> None:
        """Ask the work to stop at its next checkpoint (also ends a pause)."""
        with self._cond:
            if self._cancelled:
                return
            self._cancelled = True
            self._paused = False  # a stop ends a pause: a later resume() has nothing to undo
            self.events.append(ControlEvent("cancel", time.perf_counter()))
            self._cond.notify_all()
        self._tell_watchers()

    def pause(self) -> None:
        """Ask the work to block at its next checkpoint until resumed."""
        with self._cond:
            if self._cancelled or self._paused:
                return
            self._paused = True
            self.events.append(ControlEvent("pause", time.perf_counter()))
            self._cond.notify_all()
        self._tell_watchers()

    def resume(self) -> None:
        """Undo a pause; the work continues from where it blocked."""
        with self._cond:
            if not self._paused:
                return
            self._paused = False
            self.events.append(ControlEvent("resume", time.perf_counter()))
            self._cond.notify_all()
        self._tell_watchers()

    def _tell_watchers(self) -> None:
        for watcher in list(self.watchers):
            watcher()

    @property
    def cancelled(self) -> bool:
        """Whether a stop was requested."""
        return self._cancelled

    @property
    def pause_requested(self) -> bool:
        """Whether a pause is requested and not yet undone."""
        return self._paused

    # -- the worker's side ---------------------------------------------------

    def checkpoint(
        self,
        *,
        on_pause: Callable[[], None] | None = None,
        on_resume: Callable[[], None] | None = None,
        while_paused: Callable[[], None] | None = None,
    ) -> None:
        """Raise if a stop was requested; block while a pause is requested.

        Args:
            on_pause: Called once before blocking, outside the lock, so the
              caller can drain its device work (a pause takes effect only
              after it returns). Default: ``None``.
            on_resume: Called once after a pause ends by resumption.
              Default: ``None``.
            while_paused: Called again and again, outside the lock, while the
              pause lasts, instead of blocking on this token: a worker runs
              other generations' steps there (it must block briefly itself
              when it has nothing to do). Default: ``None``.

        Raises:
            Cancelled: A stop was requested, before or during a pause.
        """
        # Fast path without the lock: a checkpoint runs once per token.
        if not self._cancelled and not self._paused:
            return
        if self._cancelled:
            raise Cancelled()
        if on_pause is not None:
            on_pause()
        self.mark("pause")
        while True:
            with self._cond:
                if self._cancelled:
                    raise Cancelled()
                if not self._paused:
                    break
                if while_paused is None:
                    self._cond.wait()
                    continue
            while_paused()
        self.mark("resume")
        if on_resume is not None:
            on_resume()

    def mark_stopped(self) -> float | None:
        """Record that a stop took effect; return its latency in seconds."""
        event = self.mark("cancel")
        return event.latency_s if event is not None else None

    def mark(self, kind: str) -> ControlEvent | None:
        """Record that the last request of ``kind`` ("cancel", "pause", "resume") took effect now.

        For workers that act on requests without :meth:`checkpoint` (a
        generation parked outside a batch).
        """
        with self._cond:
            return self._mark(kind)

    def _mark(self, kind: str) -> ControlEvent | None:
        now = time.perf_counter()
        for event in reversed(self.events):
            if event.kind == kind:
                if event.effective_at is None:
                    event.effective_at = now
                return event
        return None

    def latencies(self, kind: str) -> list[float]:
        """Latencies (seconds) of the requests of one kind that took effect."""
        return [e.latency_s for e in self.events if e.kind == kind and e.latency_s is not None]


@dataclass
class Pace:
    """How one generation's work is paced: its token, its budget, its pause hooks.

    Made by the worker for each job and passed down as one argument; every
    piece boundary in the library is one :meth:`checkpoint` call on it.

    Args:
        token: The generation's stop / pause requests.
        budget_s: Seconds one piece of work may take, i.e. the longest a stop
          or pause waits. Default: ``DEFAULT_STOP_BUDGET_S`` (0.1).
        on_pause: Called once before a pause blocks (drain the device, report
          ``paused``). Default: ``None``.
        on_resume: Called once when a pause ends by resumption. Default: ``None``.
        between: Called at every checkpoint before the token is checked: the
          worker runs other generations' decode steps there, between this
          one's pieces. Default: ``None``.
        while_paused: See :meth:`CancelToken.checkpoint`. Default: ``None``.
        shared: Whether other generations stream between this one's pieces
          now: a piece then finishes its device work before the checkpoint,
          so that their step does not also wait for work queued behind it.
          Default: ``None`` (never).
        gate: Where given, a piece that finishes its device work for
          ``shared`` passes its last queued work here instead of waiting for
          it: the others' step is queued behind that work on the device, and
          the host builds and queues it meanwhile. Default: ``None`` (wait).
    """

    token: CancelToken
    budget_s: float = DEFAULT_STOP_BUDGET_S
    on_pause: Hook | None = None
    on_resume: Hook | None = None
    between: Hook | None = None
    while_paused: Hook | None = None
    shared: Callable[[], bool] | None = None
    gate: Callable[[Any], None] | None = None

    @property
    def requested(self) -> bool:
        """Whether a stop or pause waits for the next checkpoint (lock-free, for hot loops)."""
        return self.token.cancelled or self.token.pause_requested

    def checkpoint(self) -> None:
        """Raise :class:`Cancelled` after a stop request; block while paused."""
        if self.between is not None:
            self.between()
        self.token.checkpoint(on_pause=self.on_pause, on_resume=self.on_resume, while_paused=self.while_paused)

    def agree(self, proposal: int = 0) -> int:
        """A checkpoint that also settles a number every party will use (the next chunk size); return it.

        One process: :meth:`checkpoint`, then ``proposal`` itself. The ranks of a
        cluster (``AgreedPace``) take rank 0's proposal in the same collective
        that agrees on stop and pause.

        Raises:
            Cancelled: A stop was requested.
        """
        self.checkpoint()
        return proposal

    def choose(self, proposal: int) -> int:
        """The value every party uses for a choice inside a piece of work (the layer-group size).

        One process: ``proposal``, with no checkpoint. The ranks of a cluster
        agree on rank 0's (which is a checkpoint there).
        """
        return proposal


def unpaced(budget_s: float = DEFAULT_STOP_BUDGET_S) -> Pace:
    """A pace nobody stops or pauses (scripts, a plain ``load_model``)."""
    return Pace(CancelToken(), budget_s)
