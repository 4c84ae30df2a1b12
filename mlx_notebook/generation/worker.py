"""The worker thread that owns all MLX work, and the ``Generation`` handle.

Since mlx 0.31.2 streams belong to threads, so one long-lived thread runs
every model load and generation on its own stream. Generations of the same
model run together (a :class:`~.session.Session`: their decode steps are
batched, a new one's prefill is interleaved with the others' steps); other
jobs queue behind them. A :class:`Generation` is future-like: it is returned
at once, follows the job through its states, and lets any thread pause,
resume or cancel it.

When the last running generation is reported ``stopped``, ``paused``,
``failed`` or ``done``, the worker's stream has been synchronized, so nothing
is left in flight (one that leaves a batch while others decode leaves their
work running).

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

from ..control import CancelToken, Pace
from ..errors import InvalidArgumentError
from ..loading.store import LoadedModel, ModelStore, Tokenizer
from . import prefill_thread, warm_up
from .handle import Generation, Reporter
from .persist import read_resume
from .pieces import share_layers
from .prefix_cache import DEFAULT_PROMPT_CACHE_GB, GB
from .request import GenerationRequest
from .saving import save_generation
from .session import Session
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


# What resume_from may change of a saved request (the rest must stay as the file's KV was computed).
_RESUME_OVERRIDES = {"max_tokens", "stop_budget", "max_batch", "logprobs", "stop"}


def _between(session: Session | None) -> Callable[[], None] | None:
    """The hook that keeps a session's rows streaming between the pieces of an inline call."""
    return session.between if session is not None else None


@dataclass
class _Call:
    """A function to run on the worker thread (model loads, unloads)."""

    fn: Callable[[ModelStore], Any]
    done: threading.Event
    result: Any = None
    error: BaseException | None = None


Job = Reporter | _Call


class Worker:
    """One thread that owns all MLX work, with a queue of jobs.

    The thread starts on the first job and runs until :meth:`shutdown`.

    Args:
        store: The models it loads into. Default: a new :class:`ModelStore`.
        prompt_cache_gb: Bound of each model's prompt cache (KV caches of
          past generations, reused by prompts that share a prefix); 0 turns
          it off. Default: ``DEFAULT_PROMPT_CACHE_GB`` (2).
    """

    def __init__(self, store: ModelStore | None = None, *, prompt_cache_gb: float = DEFAULT_PROMPT_CACHE_GB) -> None:
        self.store = store or ModelStore()
        self._prompt_cache_gb = prompt_cache_gb
        self.session: Session | None = None
        self._queue: deque[Job] = deque()
        # Calls that run at the worker's next look, between two steps of a
        # running session too (saves of paused generations): never queued behind it.
        self._inline: deque[_Call] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._died: BaseException | None = None  # what ended the thread outside any job (it fails the queue)
        self._cleanup_due = False
        self.history: list[Generation] = []
        self.stream: mx.Stream | None = None
        # Made on first use where wanted (prefill_thread.wanted), ended with the worker thread.
        self._prefill: prefill_thread.PrefillThread | None = None

    # -- submitting -------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Generation:
        """Validate ``request`` and queue it; return its handle at once.

        Raises:
            InvalidArgumentError: A bad argument.
            ModelNotFoundError, ModelFormatError: A bad model name or file.
        """
        request.validate()
        return self._queue_generation(request)

    def resume(self, path: str, **overrides: Any) -> Generation:
        """Continue a generation saved with :meth:`Generation.save` (see :func:`mlx_notebook.resume_from`).

        Raises:
            InvalidArgumentError: Not a saved generation, a damaged header, a bad override.
            ModelNotFoundError: Its model cannot be found here.
        """
        request, resume = read_resume(path)
        unknown = sorted(set(overrides) - _RESUME_OVERRIDES)
        if unknown:
            raise InvalidArgumentError(
                f"resume_from cannot change {unknown[0]!r}: only {', '.join(sorted(_RESUME_OVERRIDES))}"
            )
        for name, value in overrides.items():
            if value is not None:
                setattr(request, name, value)
        request.validate()
        return self._queue_generation(request, resume=resume)

    def _queue_generation(self, request: GenerationRequest, *, resume: Any = None, seed: Any = None) -> Generation:
        source = self.store.resolve(request.model)
        gen = Generation(request, on_cancel=self._discard_queued)
        gen._saver = self.save
        gen.token.watchers.append(self._wake)
        reporter = Reporter(gen, source.key)
        reporter.resume, reporter.seed = resume, seed
        with self._cond:
            self._check_open()
            self._queue.append(reporter)
            self.history.append(gen)
            self._start_thread()
            self._cond.notify_all()
        return gen

    def submit_from(self, request: GenerationRequest, seed: Any) -> Generation:
        """:meth:`submit`, starting from the KV cache file of ``seed`` (a :class:`~.persist.KVSeed`; a loaded chat's)."""
        request.validate()
        return self._queue_generation(request, seed=seed)

    def save(self, gen: Generation, path: str, timeout: float | None = None) -> int:
        """Write ``gen`` to ``path`` on the worker thread, between two steps of whatever runs (:meth:`Generation.save`)."""
        token = CancelToken()

        def follow() -> None:  # a stop of the generation stops its save
            if gen.token.cancelled:
                token.cancel()

        gen.token.watchers.append(follow)
        try:
            return self.run_inline(
                lambda session: save_generation(
                    gen, path, self.store, session, Pace(token, gen.request.stop_budget, between=_between(session))
                ),
                token,
                timeout,
            )
        finally:
            gen.token.watchers.remove(follow)

    def run_inline(self, fn: Callable[[Session | None], Any], token: CancelToken, timeout: float | None = None) -> Any:
        """Run ``fn(session)`` on the worker thread at its next look (between two steps of a running session).

        An interrupt while waiting (``KeyboardInterrupt``) cancels ``token``,
        which ``fn``'s pace checks, waits for ``fn`` to give up, and raises.
        """
        job = _Call(lambda _store: fn(self.session), threading.Event())
        with self._cond:
            self._check_open()
            self._inline.append(job)
            self._start_thread()
            self._cond.notify_all()
        try:
            if not job.done.wait(timeout):
                token.cancel()
                job.done.wait()
                raise TimeoutError(f"not done within {timeout} s: stopped")
        except KeyboardInterrupt:
            token.cancel()
            job.done.wait()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def run_inline_calls(self) -> bool:
        """Run the inline calls waiting (on the worker thread: the session's loop asks between steps); whether any ran."""
        ran = False
        while True:
            with self._cond:
                if not self._inline:
                    return ran
                job = self._inline.popleft()
            self._run_call(job)
            ran = True

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

        def get(store: ModelStore) -> LoadedModel:
            loaded = store.get(name)
            # On the worker thread, which makes the list otherwise: the one the caller reaches is the one it reads.
            share_layers(loaded.model)
            return loaded

        loaded = self.call(get)
        return loaded.model, loaded.tokenizer

    def _check_open(self) -> None:
        if self._died is not None:
            raise RuntimeError(
                f"this mlx-notebook worker's thread failed ({type(self._died).__name__}: {self._died}); "
                "create a new one (mlx_notebook.generate makes one)"
            )
        if self._closed:
            raise RuntimeError("this mlx-notebook worker was shut down; create a new one")

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlx-notebook-worker", daemon=True)
            self._thread.start()
            _live_workers.add(self)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the session's side of the queue (worker thread) --------------------------------

    def take_joiner(self, key: str, accept: Callable[[Reporter], bool]) -> Reporter | None:
        """The queue's first job, if it is a generation of model ``key`` that ``accept`` takes.

        Only the first: a generation never overtakes an earlier job (another
        model's generation, a load or unload).
        """
        with self._cond:
            if not self._queue:
                return None
            job = self._queue[0]
            if isinstance(job, Reporter) and job.model_key == key and accept(job):
                self._queue.popleft()
                return job
            return None

    def wait_for_change(self, timeout: float) -> None:
        """Block until a job is queued or a generation gets a request, at most ``timeout`` s."""
        with self._cond:
            if not self._queue and not self._inline and not self._closed:
                self._cond.wait(timeout)

    def prefill_thread(self) -> prefill_thread.PrefillThread | None:
        """The thread that prefills prompts joining a decoding batch (see :mod:`.prefill_thread`), or ``None``."""
        if not prefill_thread.wanted():
            return None
        if self._prefill is None:
            self._prefill = prefill_thread.PrefillThread(on_done=self._wake)
        return self._prefill

    @property
    def prompt_cache_gb(self) -> float:
        """Bound of each model's prompt cache, in GB (0: off); setting it evicts at once."""
        return self._prompt_cache_gb

    @prompt_cache_gb.setter
    def prompt_cache_gb(self, gb: float) -> None:
        self._prompt_cache_gb = gb
        for loaded in self.store.loaded():
            if loaded.prompt_cache is not None:
                loaded.prompt_cache.set_limit(int(gb * GB))

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

    def running(self) -> list[Generation]:
        """The generations started and not ended (prefilling, decoding, paused)."""
        session = self.session
        return [r.generation for r in list(session.running)] if session is not None else []

    @property
    def current(self) -> Generation | None:
        """The first running generation, if any."""
        running = self.running()
        return running[0] if running else None

    def active(self) -> list[Generation]:
        """The running generations followed by the queued ones."""
        return self.running() + self.queued()

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called or the thread failed (it takes no more jobs)."""
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
                if not self._queue and not self._inline and not self._closed:
                    self._cond.wait(CLEANUP_DELAY_S)
            self._cleanup_due = False
            # Free the last generation's KV cache before the next job allocates.
            mx.clear_cache()
        with self._cond:
            while not self._queue and not self._inline and not self._closed:
                self._cond.wait()
            if self._inline:
                return self._inline.popleft()
            if self._queue:
                return self._queue.popleft()
            return None

    def _loop(self) -> None:
        # The stream is made here because streams belong to the thread that made them.
        self.stream = mx.new_stream(mx.default_device())
        try:
            while True:
                self._warm_while_idle()
                job = self._next_job()
                if job is None:
                    return
                if isinstance(job, _Call):
                    self._run_call(job)
                else:
                    self._run_session(job)
        except BaseException as exc:  # a bug outside any job: fail the queue rather than leave it waiting forever
            log.exception("mlx-notebook worker thread failed")
            self._fail_queue(exc)
        finally:
            # Free this thread's streams and compile cache while the GIL is
            # held: left to the thread's C++ TLS destructors, they touch Python
            # objects after the interpreter may have begun finalizing, which
            # aborts the process ("terminate called without an active
            # exception", mlx 0.32; see ml-explore/mlx#4327, #4373).
            if self._prefill is not None:
                self._prefill.close()
            self._synchronize_quietly()
            mx.clear_streams()

    def _warm_while_idle(self) -> None:
        """Pay each loaded model's first uses now, while nothing is queued (see :mod:`.warm_up`).

        Its first forward, its own kernels' compile, then its prefill ladder,
        which the first job queued interrupts (taken up again at the next idle
        moment).
        """
        if not warm_up.wanted():
            return
        assert self.stream is not None  # made by the thread before it takes jobs
        for loaded in self.store.loaded():
            if not self._idle():
                return
            try:
                with mx.stream(self.stream):
                    if not loaded.warmed:
                        loaded.warmed = True  # once, even if it fails: a real generation reports that
                        warm_up.warm(loaded)
                    if not loaded.kernels_installed:
                        if not self._idle():
                            return  # a job came during the first forward: it does not wait for the compile too
                        loaded.kernels_installed = True
                        warm_up.install_kernels(loaded)
                    if not loaded.ladder_warmed:
                        loaded.ladder_warmed = warm_up.warm_ladder(loaded, self._idle)
            except Exception as exc:  # optional work: escaped, it ended the thread and every later job waited forever
                loaded.warmed = loaded.kernels_installed = loaded.ladder_warmed = True
                self._synchronize_quietly()
                log.warning(
                    "mlx-notebook: the idle warm-up of %s failed (%s: %s); its prompts pay their first uses themselves",
                    loaded.source.key,
                    type(exc).__name__,
                    exc,
                )

    def _fail_queue(self, exc: BaseException) -> None:
        """The thread is ending on ``exc``: close the worker and fail every job still waiting with it."""
        with self._cond:
            self._closed = True
            self._died = exc
            jobs = [*self._inline, *self._queue]
            self._inline.clear()
            self._queue.clear()
        for job in jobs:
            if isinstance(job, _Call):
                job.error = exc
                job.done.set()
            else:
                self._generation_ended(job, State.FAILED, exc)

    def _idle(self) -> bool:
        """Nothing queued and not closing."""
        with self._cond:
            return not (self._queue or self._inline or self._closed)

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

    def _run_session(self, first: Reporter) -> None:
        assert self.stream is not None  # made by the thread before it takes jobs
        key = first.model_key or self.store.resolve(first.generation.request.model).key
        session = Session(
            self.store, self.stream, self, key, lambda: int(self._prompt_cache_gb * GB), self._generation_ended
        )
        self.session = session
        try:
            # Every step on the worker's own stream, the one synchronized before a
            # generation is reported ended. Outside this block the batch's decode steps
            # ran on the thread's default stream (a second one: streams are per thread),
            # so that synchronize missed a step still queued there, and each prefill
            # (on this stream) fed a step on the other through a cross-stream fence,
            # which MLX's CUDA backend waits for on the host.
            with mx.stream(self.stream):
                session.run(first)
        except BaseException as exc:  # a bug in the session: fail what it ran, keep the worker
            log.exception("mlx-notebook session failed")
            self._synchronize_quietly()
            for reporter in list(session.running):
                self._generation_ended(reporter, State.FAILED, exc)
            session.running.clear()
        finally:
            self.session = None
            self._cleanup_due = True  # see CLEANUP_DELAY_S

    def _generation_ended(self, reporter: Reporter, state: State, error: BaseException | None) -> None:
        if error is not None:
            _detach_traceback(error)
        reporter.finish(state, error=error)

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
