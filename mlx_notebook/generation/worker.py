"""The worker thread that owns all MLX work, and the ``Generation`` handle.

Since mlx 0.31.2 streams belong to threads, so one long-lived thread runs
every model load and generation on its own stream; jobs queue behind each
other. A :class:`Generation` is future-like: it is returned at once, follows
the job through its states, and lets any thread pause, resume or cancel it.

A generation is reported ``stopped``, ``paused``, ``failed`` or ``done`` only
after the worker's stream has been synchronized, so nothing is left in flight.
For each job the worker makes the generation's :class:`~mlx_notebook.control.Pace`
(its token, its budget, and what a pause does: synchronize, report
``paused``) and hands it down as one argument.

:func:`default_worker` is the process-wide worker behind
:func:`mlx_notebook.generate` and the magics.

Example::

    worker = Worker()
    gen = worker.submit(GenerationRequest("Tell me a joke"))
    gen.pause(); gen.resume()
    print(gen.result(timeout=60))
    worker.shutdown()

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..control import Cancelled, Pace
from ..loading.store import ModelStore, Tokenizer
from .engine import Engine
from .handle import Generation, Reporter
from .request import GenerationRequest
from .states import State

log = logging.getLogger(__name__)
# After a generation ends, the worker idles this long (or until the next job)
# before it frees the generation's memory. Freeing a long KV cache holds the
# GIL for milliseconds (mx.clear_cache returns GBs to the device; measured
# ~18 ms at 32k tokens on an H200), and a thread woken by the end, e.g. one in
# ``wait()``, needs the GIL to return: blocked on the queue, the worker lets it.
CLEANUP_DELAY_S = 0.05
# Workers whose thread started: stopped at interpreter exit, before
# finalization, because a daemon thread killed mid-MLX-work (or one that still
# holds streams) aborts the process.
_live_workers: weakref.WeakSet[Worker] = weakref.WeakSet()


@atexit.register
def _shutdown_live_workers() -> None:
    for worker in list(_live_workers):
        worker.shutdown(cancel=True, timeout=30.0)


@dataclass
class _Call:
    """A function to run on the worker thread (model loads, unloads)."""

    fn: Callable[[ModelStore], Any]
    done: threading.Event
    result: Any = None
    error: BaseException | None = None


Job = Reporter | _Call


class _PauseHooks:
    """What a pause does on the worker: drain the stream, report ``paused``; resume restores the state."""

    def __init__(self, reporter: Reporter, stream: mx.Stream) -> None:
        self._reporter = reporter
        self._stream = stream
        self._before = State.LOADING

    def on_pause(self) -> None:
        mx.synchronize(self._stream)
        self._before = self._reporter.state
        self._reporter.set_state(State.PAUSED)

    def on_resume(self) -> None:
        self._reporter.set_state(self._before)


class Worker:
    """One thread that owns all MLX work, with a queue of jobs.

    The thread starts on the first job and runs until :meth:`shutdown`.

    Args:
        store: The models it loads into. Default: a new :class:`ModelStore`.
    """

    def __init__(self, store: ModelStore | None = None) -> None:
        self.store = store or ModelStore()
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._cleanup_due = False
        self.current: Generation | None = None
        self.history: list[Generation] = []
        self.stream: mx.Stream | None = None

    # -- submitting -------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Generation:
        """Validate ``request`` and queue it; return its handle at once.

        Raises:
            InvalidArgumentError: A bad argument.
            ModelNotFoundError, ModelFormatError: A bad model name or file.
        """
        request.validate()
        self.store.resolve(request.model)
        gen = Generation(request, on_cancel=self._discard_queued)
        with self._cond:
            self._check_open()
            self._queue.append(Reporter(gen))
            self.history.append(gen)
            self._start_thread()
            self._cond.notify_all()
        return gen

    def call(self, fn: Callable[[ModelStore], Any], timeout: float | None = None) -> Any:
        """Run ``fn(store)`` on the worker thread after the queued jobs."""
        job = _Call(fn, threading.Event())
        with self._cond:
            self._check_open()
            self._queue.append(job)
            self._start_thread()
            self._cond.notify_all()
        if not job.done.wait(timeout):
            raise TimeoutError("the mlx-notebook worker is busy; try again when generations finish")
        if job.error is not None:
            raise job.error
        return job.result

    def load_model(self, name: str | None = None) -> tuple[Any, Tokenizer]:
        """Load (or reuse) a model on the worker thread; return ``(model, tokenizer)``."""
        self.store.resolve(name)
        loaded = self.call(lambda store: store.get(name))
        return loaded.model, loaded.tokenizer

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this mlx-notebook worker was shut down; create a new one")

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlx-notebook-worker", daemon=True)
            self._thread.start()
            _live_workers.add(self)

    def _discard_queued(self, gen: Generation) -> None:
        with self._cond:
            found = next((j for j in self._queue if isinstance(j, Reporter) and j.generation is gen), None)
            if found is None:
                return  # running or finished: the checkpoint handles it
            self._queue.remove(found)
        gen.stats.stop_latency_s = gen.token.mark_stopped()
        found.finish(State.STOPPED)

    # -- inspecting ---------------------------------------------------------------

    def queued(self) -> list[Generation]:
        """Generations waiting behind the current one, in order."""
        with self._cond:
            return [job.generation for job in self._queue if isinstance(job, Reporter)]

    def active(self) -> list[Generation]:
        """The running generation (if any) followed by the queued ones."""
        current = self.current
        return ([current] if current is not None else []) + self.queued()

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called (it takes no more jobs)."""
        return self._closed

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread is not None and self._thread.is_alive()

    # -- stopping -------------------------------------------------------------------

    def cancel_all(self) -> list[Generation]:
        """Cancel the running and queued generations; return them."""
        gens = self.active()
        for gen in gens:
            gen.cancel()
        return gens

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no generation runs or waits; return whether that happened."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for gen in self.active():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not gen.wait(left):
                return False
        return True

    def shutdown(self, *, cancel: bool = True, timeout: float | None = 30.0) -> bool:
        """Stop accepting jobs, cancel (or finish) the queue, and join the thread.

        Returns:
            Whether the thread ended within ``timeout``.
        """
        if cancel:
            self.cancel_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # -- the thread -------------------------------------------------------------------

    def _next_job(self) -> Job | None:
        if self._cleanup_due:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(CLEANUP_DELAY_S)
            self._cleanup_due = False
            # Free the last generation's KV cache before the next job allocates.
            mx.clear_cache()
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._queue:
                return self._queue.popleft()
            return None

    def _loop(self) -> None:
        # The stream is made here because streams belong to the thread that made them.
        self.stream = mx.new_stream(mx.default_device())
        engine = Engine(self.store, self.stream)
        try:
            while True:
                job = self._next_job()
                if job is None:
                    return
                if isinstance(job, _Call):
                    self._run_call(job)
                else:
                    self._run_generation(engine, job)
        finally:
            # Free this thread's streams and compile cache while the GIL is
            # held: left to the thread's C++ TLS destructors, they touch Python
            # objects after the interpreter may have begun finalizing, which
            # aborts the process ("terminate called without an active
            # exception", mlx 0.32; see ml-explore/mlx#4327, #4373).
            self._synchronize_quietly()
            mx.clear_streams()

    def _run_call(self, job: _Call) -> None:
        assert self.stream is not None  # made by the thread before it takes jobs
        try:
            with mx.stream(self.stream):
                job.result = job.fn(self.store)
            mx.synchronize(self.stream)
        except BaseException as exc:  # handed to the caller's thread
            self._synchronize_quietly()
            job.error = exc
        finally:
            job.done.set()

    def _run_generation(self, engine: Engine, reporter: Reporter) -> None:
        gen = reporter.generation
        if gen.token.cancelled:
            gen.stats.stop_latency_s = gen.token.mark_stopped()
            reporter.finish(State.STOPPED)
            return
        self.current = gen
        assert self.stream is not None
        hooks = _PauseHooks(reporter, self.stream)
        pace = Pace(gen.token, gen.request.stop_budget, on_pause=hooks.on_pause, on_resume=hooks.on_resume)
        try:
            engine.run(gen.request, pace, reporter)
            mx.synchronize(self.stream)
            reporter.finish(State.DONE)
        except Cancelled:
            self._synchronize_quietly()
            gen.stats.stop_latency_s = gen.token.mark_stopped()
            reporter.finish(State.STOPPED)
        except Exception as exc:  # MLX RuntimeError, bad input: fail this one only
            self._synchronize_quietly()
            log.debug("generation #%s failed", gen.id, exc_info=True)
            _detach_traceback(exc)
            reporter.finish(State.FAILED, error=exc)
        finally:
            self.current = None
            self._cleanup_due = True  # see CLEANUP_DELAY_S

    def _synchronize_quietly(self) -> None:
        try:
            mx.synchronize(self.stream)
        except Exception:  # the device error is already being reported
            log.debug("synchronize after error failed", exc_info=True)


def _detach_traceback(error: BaseException) -> None:
    """Keep where an error happened as text, and drop its frames.

    The worker's frames reach the KV cache and the model through their
    functions' closures (``decode``'s ``step``, mlx-lm's list comprehensions),
    which ``traceback.clear_frames`` cannot clear: a failed handle kept in
    ``Worker.history`` would pin them for good.
    """
    seen = set()
    exc: BaseException | None = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None and hasattr(exc, "add_note"):  # Python >= 3.11
            where = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
            exc.add_note("mlx-notebook worker traceback:\n" + where)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


_default: Worker | None = None
_default_lock = threading.Lock()


def default_worker(*, create: bool = True) -> Worker | None:
    """The process-wide worker behind :func:`mlx_notebook.generate` and the magics.

    Args:
        create: Make one if there is none (or it was shut down). With
          ``False``, return ``None`` instead: the kernel hooks use this to
          find generations without starting a worker. Default: ``True``.
    """
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            if not create:
                return None
            _default = Worker()
        return _default
