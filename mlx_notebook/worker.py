"""The worker thread that owns all MLX work, and the ``Generation`` handle.

Since mlx 0.31.2 streams belong to threads, so one long-lived thread runs
every model load and generation on its own stream; jobs queue behind each
other. A :class:`Generation` is future-like: it is returned at once, follows
the job through its states, and lets any thread pause, resume or cancel it.

A generation is reported ``stopped``, ``paused``, ``failed`` or ``done`` only
after the worker's stream has been synchronized, so nothing is left in flight.

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
import itertools
import logging
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, Tuple, Union

import mlx.core as mx

from .control import Cancelled, CancelToken
from .engine import Engine, GenerationRequest, GenerationStats
from .models import ModelStore

log = logging.getLogger(__name__)

ACTIVE_STATES = ("loading", "prefilling", "decoding", "paused")
FINAL_STATES = ("stopped", "done", "failed")
STATES = ("queued",) + ACTIVE_STATES + FINAL_STATES

_ids = itertools.count(1)
# After a generation ends, the worker idles this long (or until the next job)
# before it frees the generation's memory. Freeing a long KV cache holds the
# GIL for milliseconds (mx.clear_cache returns GBs to the device; measured
# ~18 ms at 32k tokens on an H200), and a thread woken by the end, e.g. one in
# ``wait()``, needs the GIL to return: blocked on the queue, the worker lets it.
CLEANUP_DELAY_S = 0.05
# Workers whose thread started: stopped at interpreter exit, before
# finalization, because a daemon thread killed mid-MLX-work (or one that still
# holds streams) aborts the process.
_live_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_workers() -> None:
    for worker in list(_live_workers):
        worker.shutdown(cancel=True, timeout=30.0)


@dataclass
class GenerationEvent:
    """What a listener hears.

    Args:
        kind: ``"state"``, ``"progress"`` or ``"tokens"``.
        generation: The generation it is about.
        state: The state after the event.
        text: For ``"tokens"``: the new text.
        phase: For ``"progress"``: ``"load"`` or ``"prefill"``.
        done, total: For ``"progress"``: bytes (load) or tokens (prefill).
    """

    kind: str
    generation: "Generation"
    state: str
    text: str = ""
    phase: str = ""
    done: int = 0
    total: int = 0


Listener = Callable[[GenerationEvent], None]


class Generation:
    """A handle on one queued, running or finished generation.

    Attributes:
        id: A small integer, unique in the process.
        request: What was asked.
        stats: A :class:`GenerationStats`, updated as it runs.
        error: The exception that failed it, or ``None``.
    """

    def __init__(self, request: GenerationRequest, worker: "Worker") -> None:
        self.id = next(_ids)
        self.request = request
        self.stats = GenerationStats()
        self.error: Optional[BaseException] = None
        self.token = CancelToken()
        self.created_at = time.time()
        self._worker = worker
        self._state = "queued"
        self._segments: List[str] = []
        self._tokens: List[int] = []
        self._listeners: List[Listener] = []
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<Generation #{self.id} {self._state}: {self.stats.generated_tokens} tokens, "
            f"{len(self.text)} chars>"
        )

    # -- reading ------------------------------------------------------------

    @property
    def state(self) -> str:
        """One of ``queued loading prefilling decoding paused stopped done failed``."""
        return self._state

    @property
    def text(self) -> str:
        """The text generated so far (readable at any time, also after a stop)."""
        return "".join(self._segments)

    @property
    def tokens(self) -> List[int]:
        """The token ids generated so far (EOS excluded)."""
        return list(self._tokens)

    @property
    def finished(self) -> bool:
        """Whether the generation reached ``stopped``, ``done`` or ``failed``."""
        return self._done.is_set()

    # -- control --------------------------------------------------------------

    def pause(self) -> None:
        """Pause at the next checkpoint; the KV cache and sampler are kept."""
        if not self.finished:
            self.token.pause()

    def resume(self) -> None:
        """Continue a paused generation exactly where it stopped."""
        self.token.resume()

    def cancel(self) -> None:
        """Stop at the next checkpoint (or drop it from the queue)."""
        if self.finished:
            return
        self.token.cancel()
        self._worker._discard_queued(self)

    stop = cancel

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until finished; return whether it finished in time."""
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> str:
        """Wait and return the text (partial after a stop).

        Raises:
            TimeoutError: Not finished within ``timeout`` seconds.
            Exception: The error that failed the generation.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"generation #{self.id} still {self._state} after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.text

    # -- listeners --------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` on every state change, progress and token.

        Listeners run on the worker thread and must be quick; an exception in
        one is logged and does not affect the generation.
        """
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _notify(self, event: GenerationEvent) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a display bug must never stop the generation
                log.exception("mlx-notebook listener failed")

    # -- the engine's sink (worker thread) ----------------------------------------

    def set_state(self, state: str) -> None:
        if state == self._state:
            return
        self._state = state
        self._notify(GenerationEvent("state", self, state))

    def progress(self, phase: str, done: int, total: int) -> None:
        self._notify(GenerationEvent("progress", self, self._state, phase=phase, done=done, total=total))

    def emit(self, token_ids: List[int], text: str) -> None:
        self._tokens.extend(token_ids)
        if text:
            self._segments.append(text)
        self._notify(GenerationEvent("tokens", self, self._state, text=text))

    def _finish(self, state: str, error: Optional[BaseException] = None) -> None:
        self.error = error
        if state in ("stopped", "failed"):
            self.stats.finish_reason = state
        self.set_state(state)
        self._done.set()


@dataclass
class _Call:
    """A function to run on the worker thread (model loads, unloads)."""

    fn: Callable[[ModelStore], Any]
    done: threading.Event
    result: Any = None
    error: Optional[BaseException] = None


Job = Union[Generation, _Call]


class Worker:
    """One thread that owns all MLX work, with a queue of jobs.

    The thread starts on the first job and runs until :meth:`shutdown`.

    Args:
        store: The models it loads into. Default: a new :class:`ModelStore`.
    """

    def __init__(self, store: Optional[ModelStore] = None) -> None:
        self.store = store or ModelStore()
        self._queue: Deque[Job] = deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._cleanup_due = False
        self.current: Optional[Generation] = None
        self.history: List[Generation] = []
        self.stream: Optional[mx.Stream] = None

    # -- submitting -------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Generation:
        """Validate ``request`` and queue it; return its handle at once.

        Raises:
            InvalidArgumentError: A bad argument.
            ModelNotFoundError, ModelFormatError: A bad model name or file.
        """
        request.validate()
        self.store.resolve(request.model)
        gen = Generation(request, self)
        with self._cond:
            self._check_open()
            self._queue.append(gen)
            self.history.append(gen)
            self._start_thread()
            self._cond.notify_all()
        return gen

    def call(self, fn: Callable[[ModelStore], Any], timeout: Optional[float] = None) -> Any:
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

    def load_model(self, name: Optional[str] = None) -> Tuple[Any, Any]:
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
            try:
                self._queue.remove(gen)
            except ValueError:
                return  # running or finished: the checkpoint handles it
        gen.stats.stop_latency_s = gen.token.mark_stopped()
        gen._finish("stopped")

    # -- inspecting ---------------------------------------------------------------

    def queued(self) -> List[Generation]:
        """Generations waiting behind the current one, in order."""
        with self._cond:
            return [job for job in self._queue if isinstance(job, Generation)]

    def active(self) -> List[Generation]:
        """The running generation (if any) followed by the queued ones."""
        current = self.current
        return ([current] if current is not None else []) + self.queued()

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread is not None and self._thread.is_alive()

    # -- stopping -------------------------------------------------------------------

    def cancel_all(self) -> List[Generation]:
        """Cancel the running and queued generations; return them."""
        gens = self.active()
        for gen in gens:
            gen.cancel()
        return gens

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until no generation runs or waits; return whether that happened."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for gen in self.active():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not gen.wait(left):
                return False
        return True

    def shutdown(self, *, cancel: bool = True, timeout: Optional[float] = 30.0) -> bool:
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

    def _next_job(self) -> Optional[Job]:
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
        try:
            with mx.stream(self.stream):
                job.result = job.fn(self.store)
            mx.synchronize(self.stream)
        except BaseException as exc:  # handed to the caller's thread
            self._synchronize_quietly()
            job.error = exc
        finally:
            job.done.set()

    def _run_generation(self, engine: Engine, gen: Generation) -> None:
        if gen.token.cancelled:
            gen.stats.stop_latency_s = gen.token.mark_stopped()
            gen._finish("stopped")
            return
        self.current = gen
        try:
            engine.run(gen.request, gen.token, gen)
            mx.synchronize(self.stream)
            gen._finish("done")
        except Cancelled:
            self._synchronize_quietly()
            gen.stats.stop_latency_s = gen.token.mark_stopped()
            gen._finish("stopped")
        except Exception as exc:  # MLX RuntimeError, bad input: fail this one only
            self._synchronize_quietly()
            log.debug("generation #%s failed", gen.id, exc_info=True)
            _detach_traceback(exc)
            gen._finish("failed", error=exc)
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
    exc: Optional[BaseException] = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None and hasattr(exc, "add_note"):  # Python >= 3.11
            where = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
            exc.add_note("mlx-notebook worker traceback:\n" + where)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
