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

So at most every :data:`INTERVAL_S`, between two pieces of work on the
worker thread, the CPU time the other processes used since the last look
(the busy time of every core in ``/proc/stat`` less this process's own CPU
time) decides: as many threads as cores are left, at least one. Linux with a
system OpenBLAS only (:mod:`.blas`); elsewhere nothing is done.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass

from . import blas

log = logging.getLogger(__name__)

# How often the load is looked at: long enough for /proc/stat's 10 ms ticks to
# add up, short enough to follow load that comes and goes within a prefill.
INTERVAL_S = 0.5


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

    def fit(self) -> int:
        """Look at the load if the last look is old enough; return the thread count in use."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last.wall < INTERVAL_S:
                return self.threads
            sample = self._sample()
            last, self._last = self._last, sample
            if last is None:
                return self.threads
            others = max(0.0, (sample.busy - last.busy) - (sample.own - last.own)) / (sample.wall - last.wall)
            wanted = max(1, min(self.cores, round(self.cores - others)))
            if wanted != self.threads:
                self._set(wanted)
                self.threads = wanted
            return self.threads


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


def fit_to_load() -> int | None:
    """Fit OpenBLAS's threads to the load now (rate-limited); ``None`` where there is nothing to fit."""
    global _governor
    current = governor()
    if current is None:
        return None
    try:
        return current.fit()
    except (OSError, ValueError, IndexError):  # /proc/stat unreadable or not as expected: stop looking
        log.debug("OpenBLAS threads are no longer fitted to the load", exc_info=True)
        _governor = None
        return None


__all__ = ["INTERVAL_S", "BlasThreads", "fit_to_load", "governor"]
