"""OpenBLAS's thread count fitted to the cores other processes leave free.

OpenBLAS splits each matmul over its threads and waits for all of them. When
other processes take cores, one of its threads is often descheduled, and
every matmul of a forward (~200 in a chunk of the default model) waits for
it a scheduler slice. Measured on 2 cores, default model (SmolLM2-135M,
fp32), prefill chunks with two busy loops beside the process: 64 tokens
1.8 s with one thread against 5.8 s with two, 128 tokens 4.0 s against
17.7 s; with the cores quiet two threads are 1.25-1.7x faster than one. A
3,000-token prefill under that load took 235 s with two threads and 144 s
with one (quiet: 68.5 s with two, 88.4 s with one); plain mlx-lm took 180 s.
With the planner's chunks of today (~140 tokens under that load, so longer
matmuls), two threads still lose: 196 s against 53.6 s with one, quiet
27-28 s (session 31, ``benchmarks/results/cpu_prefill_load_*_threads_session31.json``).

So at most every :data:`INTERVAL_S`, between two pieces of work on the
worker thread, the CPU time the other processes used since the last look
(the busy time of every core in ``/proc/stat`` less this process's own CPU
time) decides: as many threads as cores are left, at least one. Linux with a
system OpenBLAS only (:mod:`.blas`); elsewhere nothing is done.

A decode step of several rows is different work: each matmul is a few rows
against a weight read from memory, and OpenBLAS's threaded kernel for that
shape can lose to one thread. Measured on 2 cores (Zen 4, OpenBLAS 0.3.21's
Haswell kernels), default model, a step of 4 rows: 88 ms with two threads,
74 ms with one; of one row: 52 ms with two, 77 ms with one. Which count wins
depends on the machine and its BLAS, so :class:`StepTrials` times the steps
themselves: per row count (rounded down to a power of two) and free cores,
each candidate count for :data:`TRIAL_STEPS` steps, then the fastest, tried
again every :data:`RETRY_STEPS` steps.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import ctypes
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

from . import blas

log = logging.getLogger(__name__)

# How often the load is looked at: long enough for /proc/stat's 10 ms ticks to
# add up, short enough to follow load that comes and goes within a prefill.
INTERVAL_S = 0.5
# Steps timed per candidate thread count (after the one the change landed in).
TRIAL_STEPS = 3
# Steps on a chosen count before the candidates are timed again: the context
# grows (attention's share of a step with it) and the rows change.
RETRY_STEPS = 512


@dataclass
class _Trial:
    """The thread counts tried for one kind of step, and the one chosen."""

    candidates: list[int]
    samples: dict[int, list[float]] = field(default_factory=dict)
    chosen: int | None = None
    since: int = 0  # steps on the chosen count

    def current(self) -> int:
        if self.chosen is not None:
            return self.chosen
        return next(c for c in self.candidates if len(self.samples.get(c, ())) < TRIAL_STEPS)

    def record(self, threads: int, seconds: float) -> None:
        if self.chosen is not None:
            self.since += 1
            if self.since >= RETRY_STEPS:
                self.samples, self.chosen, self.since = {}, None, 0
            return
        if threads in self.candidates:
            self.samples.setdefault(threads, []).append(seconds)
        if all(len(self.samples.get(c, ())) >= TRIAL_STEPS for c in self.candidates):
            self.chosen = min(self.candidates, key=lambda c: statistics.median(self.samples[c]))


class StepTrials:
    """The thread count for decode steps of several rows, chosen by timing those steps."""

    def __init__(self) -> None:
        self._trials: dict[tuple[int, int], _Trial] = {}

    def _trial(self, rows: int, free: int) -> _Trial:
        key = (1 << (rows.bit_length() - 1), free)
        trial = self._trials.get(key)
        if trial is None:
            # The load-fitted count first (what a step used before), then halves of it down to one.
            candidates = [free]
            while candidates[-1] > 1:
                candidates.append(candidates[-1] // 2)
            trial = self._trials[key] = _Trial(candidates)
        return trial

    def threads(self, rows: int, free: int) -> int:
        """The count for a step of ``rows`` rows with ``free`` cores left by other processes."""
        return self._trial(rows, free).current() if _by_trials(rows, free) else free

    def record(self, rows: int, free: int, threads: int, seconds: float) -> None:
        """One step of ``rows`` rows took ``seconds`` on ``threads`` threads."""
        if _by_trials(rows, free):
            self._trial(rows, free).record(threads, seconds)


def _by_trials(rows: int, free: int) -> bool:
    """Whether a step's count is chosen by trials: a lone row (and one free core) keeps every free core."""
    return rows >= 2 and free >= 2


@dataclass
class _Sample:
    wall: float
    busy: float  # seconds of CPU time every core spent busy
    own: float  # seconds of CPU time this process spent


class BlasThreads:
    """Sets OpenBLAS's threads from the other processes' recent CPU use (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL, stat_path: str = "/proc/stat") -> None:
        self._set = library.openblas_set_num_threads
        self.cores = max(1, int(library.openblas_get_num_threads()))
        self.threads = self.cores
        self.free = self.cores  # cores the other processes left, at the last look
        self.steps = StepTrials()
        self._switched = False  # the count changed when the step being timed began
        self._stat_path = stat_path
        self._tick = float(os.sysconf("SC_CLK_TCK"))
        self._last: _Sample | None = None
        self._lock = threading.Lock()

    def _sample(self) -> _Sample:
        with open(self._stat_path, encoding="ascii") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / self._tick
        t = os.times()
        return _Sample(time.monotonic(), busy, t.user + t.system)

    def fit(self, rows: int = 1) -> int:
        """Set the thread count for the next piece of work; return it.

        ``rows``: the rows of a decode step, 1 for a prefill piece or a lone
        row. The load is looked at if the last look is old enough.
        """
        with self._lock:
            self._look()
            wanted = self.steps.threads(rows, self.free)
            self._switched = wanted != self.threads
            if self._switched:
                self._set(wanted)
                self.threads = wanted
            return self.threads

    def step_took(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows, begun by :meth:`fit`, took ``seconds`` (read to read)."""
        with self._lock:
            # The step in flight when the count changed ran partly on the old count.
            if not self._switched:
                self.steps.record(rows, self.free, self.threads, seconds)

    def _look(self) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last.wall < INTERVAL_S:
            return
        sample = self._sample()
        last, self._last = self._last, sample
        if last is None:
            return
        others = max(0.0, (sample.busy - last.busy) - (sample.own - last.own)) / (sample.wall - last.wall)
        self.free = max(1, min(self.cores, round(self.cores - others)))


_governor: BlasThreads | None = None
_tried = False


def governor() -> BlasThreads | None:
    """The process's governor; ``None`` off Linux or without a system OpenBLAS."""
    global _governor, _tried
    if not _tried:
        _tried = True
        path = blas.openblas_path()
        if path is not None and os.path.exists("/proc/stat"):
            try:
                library = ctypes.CDLL(path)
                if hasattr(library, "openblas_set_num_threads"):
                    _governor = BlasThreads(library)
            except OSError:
                _governor = None
    return _governor


def fit_to_load(rows: int = 1) -> int | None:
    """Fit OpenBLAS's threads to the load (rate-limited) and the work; ``None`` where there is nothing to fit.

    ``rows``: the rows of the decode step about to run (1: a prefill piece).
    """
    global _governor
    current = governor()
    if current is None:
        return None
    try:
        return current.fit(rows)
    except (OSError, ValueError, IndexError):  # /proc/stat unreadable or not as expected: stop looking
        log.debug("OpenBLAS threads are no longer fitted to the load", exc_info=True)
        _governor = None
        return None


def step_took(rows: int, seconds: float) -> None:
    """Time of a decode step of ``rows`` rows begun after :func:`fit_to_load` (``rows``)."""
    current = _governor
    if current is not None:
        current.step_took(rows, seconds)


__all__ = [
    "INTERVAL_S",
    "RETRY_STEPS",
    "TRIAL_STEPS",
    "BlasThreads",
    "StepTrials",
    "fit_to_load",
    "governor",
    "step_took",
]
