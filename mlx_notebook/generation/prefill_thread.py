"""A second MLX thread that prefills prompts joining a decoding batch, while the worker thread keeps stepping it.

On devices that build attention kernels per shape (the CUDA backend builds a
cuDNN graph for every new pair of chunk length and context length, 50-100 ms
of host time each at 8k), a joining prompt fed between the others' steps on
the one worker thread puts every such build inside one of their gaps. Measured
on an H200 (Qwen3-8B shape, bf16, 7 rows of 512 tokens decoding, an 8k prompt
joining in chunks of up to 512, every shape new; ``benchmarks/results/
h200_two_thread_join_qwen3-8b_session24.log``): the others' longest gap was
127-129 ms fed in turn on one thread, 28-33 ms with the prompt on a second
thread with its own stream (their steps 11-16 ms), and the prompt itself
was read sooner (1.5-1.7 s against 2.0-2.1 s). The builds run inside
``mx.eval``, which releases the GIL, and the device interleaves the streams.

MLX keeps cuDNN graphs per thread, so this thread lives as long as its
worker: a second prompt of a shape it built reuses it. Prefills that start
while nothing decodes stay on the worker thread (no one waits for them, and
the idle ladder of :mod:`.warm_up` built their shapes there).

``MLX_NOTEBOOK_PREFILL_THREAD`` is ``auto`` (default: where kernels are built
per shape), ``1`` (always, e.g. for tests on the CPU) or ``0`` (never).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..loading.policy import env_switch
from .chunks import builds_kernels_per_shape

log = logging.getLogger(__name__)


def wanted() -> bool:
    """Whether prompts that join a decoding batch are prefilled on a thread of their own."""
    choice = env_switch("MLX_NOTEBOOK_PREFILL_THREAD")
    if choice != "auto":
        return choice == "on"
    return builds_kernels_per_shape()


@dataclass
class SideJob:
    """A function run on the prefill thread; ``done`` is set when it returned or raised."""

    fn: Callable[[mx.Stream], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class PrefillThread:
    """A thread with its own stream that runs submitted jobs one at a time.

    Args:
        on_done: Called (on this thread) after each job, e.g. to wake the
          worker waiting for it.
    """

    def __init__(self, on_done: Callable[[], None]) -> None:
        self._on_done = on_done
        self._jobs: deque[SideJob] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="mlx-notebook-prefill", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[mx.Stream], Any]) -> SideJob:
        """Run ``fn(stream)`` on the thread, inside ``mx.stream(stream)``; return its job at once."""
        job = SideJob(fn)
        with self._cond:
            if self._closed:
                raise RuntimeError("the prefill thread was closed")
            self._jobs.append(job)
            self._cond.notify_all()
        return job

    def close(self, timeout: float | None = 30.0) -> bool:
        """Let the queued jobs finish, end the thread; return whether it ended within ``timeout``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is threading.current_thread():
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> SideJob | None:
        with self._cond:
            while not self._jobs and not self._closed:
                self._cond.wait()
            return self._jobs.popleft() if self._jobs else None

    def _loop(self) -> None:
        # Streams belong to the thread that made them (mlx >= 0.31.2).
        stream = mx.new_stream(mx.default_device())
        try:
            while True:
                job = self._next()
                if job is None:
                    return
                try:
                    with mx.stream(stream):
                        job.result = job.fn(stream)
                except BaseException as exc:  # handed to the worker, which fails what the job ran
                    job.error = exc
                finally:
                    job.done.set()
                    self._on_done()
        finally:
            # As the worker thread does: free this thread's streams while the GIL is held (mlx 0.32 aborts at
            # exit when a thread's C++ TLS destructors do it).
            try:
                mx.synchronize(stream)
            except Exception:
                log.debug("synchronize at the prefill thread's end failed", exc_info=True)
            mx.clear_streams()


__all__ = ["PrefillThread", "SideJob", "wanted"]
