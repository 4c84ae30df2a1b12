"""The kernel's side of a cluster: launch it, hand it generations, watch it.

A :class:`Cluster` binds a local pyzmq socket, starts the ranks with
``mlx.launch`` (:mod:`.launch`) and waits for rank 0's ``ready``. Its
:meth:`~Cluster.submit` returns the same :class:`~mlx_notebook.Generation`
handle the local worker does: one client thread reads rank 0's events and
drives the handle's :class:`~mlx_notebook.generation.handle.Reporter`, and
the handle's stop / pause / resume travel to rank 0 at once.

The client thread is also the watchdog: when the ranks end (a rank died:
``mlx.launch`` ends the rest) or rank 0 goes silent for ``watchdog_s`` (it
answers pings between any two pieces of work, idle or paused too: silence
means a rank hung inside a collective), every
unfinished generation fails with a one-line :class:`~.errors.ClusterError`
and the cluster is ended; :meth:`Cluster.restart` brings it back. The kernel
never waits on the ranks without a deadline.

Example::

    cluster = Cluster(LaunchSpec("/models/llama", ranks=2, backend="ring")).start()
    gen = cluster.submit(GenerationRequest("Hello", max_tokens=32))
    print(gen.result(timeout=60), gen.stats.ranks)
    cluster.stop()

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..control import CancelToken
from ..errors import InvalidArgumentError, MLXNotebookError
from ..generation.handle import Generation, Reporter
from ..generation.reasoning import ThinkTags
from ..generation.request import GenerationRequest
from ..generation.states import State
from ..generation.stats import FinishReason, GenerationStats, PrefillPieces
from ..loading.names import resolve
from ..text_enum import TextEnum
from .errors import ClusterError
from .launch import Launcher, LaunchSpec, check_config, command, environment, model_folder
from .protocol import (
    PING_S,
    ClusterStats,
    Control,
    FailedStart,
    Finish,
    Generate,
    Message,
    Ping,
    Progress,
    Ready,
    Reasoning,
    Seen,
    Shutdown,
    StateChanged,
    Stats,
    Tokens,
    pack,
    request_fields,
    unpack,
)

log = logging.getLogger(__name__)

# Seconds rank 0 may stay silent under a running generation before it counts as hung.
DEFAULT_WATCHDOG_S = 5.0
# Seconds a start may take (the ranks load the model first).
DEFAULT_START_TIMEOUT_S = 600.0

_live: weakref.WeakSet[Cluster] = weakref.WeakSet()


@atexit.register
def _stop_live_clusters() -> None:
    for cluster in list(_live):
        cluster.stop(timeout=5.0)


class ClusterState(TextEnum):
    """Where a cluster is in its life."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    ENDED = "ended"  # stopped, or its ranks ended (a fault): restart() starts it again


@dataclass
class ClusterStatus:
    """What :meth:`Cluster.status` reports.

    Args:
        state: A :class:`ClusterState`.
        model: The model name as given.
        folder: The folder the ranks loaded.
        ranks: Number of ranks.
        backend: MLX distributed backend.
        pipeline: Pipeline stages rather than tensor parallel.
        launcher_pid: The ``mlx.launch`` process (and group) id, or ``None``.
        load_s: Seconds the ranks took to load the model.
        running: Ids of the generations sent and not finished.
        error: Why it ended, when it did not end by :meth:`Cluster.stop`.
        log_path: The ranks' output.
    """

    state: ClusterState
    model: str
    folder: str
    ranks: int
    backend: str
    pipeline: bool
    launcher_pid: int | None = None
    load_s: float | None = None
    running: list[int] = field(default_factory=list)
    error: str | None = None
    log_path: str | None = None

    def __str__(self) -> str:
        head = f"cluster {self.state}: {self.model} on {self.ranks} ranks ({self.backend}"
        head += ", pipeline)" if self.pipeline else ", tensor parallel)"
        if self.load_s is not None:
            head += f", loaded in {self.load_s:.1f} s"
        if self.running:
            head += ", running " + ", ".join(f"#{i}" for i in self.running)
        if self.error:
            head += f"; {self.error}"
        return head


class _ForwardingToken(CancelToken):
    """The handle's token: requests are recorded here and sent to rank 0 at once."""

    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    def cancel(self) -> None:
        was = self.cancelled
        super().cancel()
        if not was:
            self._send("stop")

    def pause(self) -> None:
        was = self.pause_requested or self.cancelled
        super().pause()
        if not was and self.pause_requested:
            self._send("pause")

    def resume(self) -> None:
        was = self.pause_requested
        super().resume()
        if was:
            self._send("resume")

    def took_effect(self, kind: str) -> None:
        """Record when rank 0 reported that a pause or resume took effect."""
        self._mark(kind)


class Cluster:
    """Rank servers started by ``mlx.launch``, and the kernel's line to rank 0.

    Args:
        spec: What to launch.
        name: The model name generations ask for to run here. Default: ``spec.model``.
        watchdog_s: Seconds rank 0 may be silent (it answers pings between
          any two pieces of work) before the running generations fail and the
          cluster ends. Default: ``5.0``.
        start_timeout_s: Seconds :meth:`start` waits for the ranks to load.
          Default: ``600``.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        name: str | None = None,
        watchdog_s: float = DEFAULT_WATCHDOG_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        spec.check()
        self.spec = spec
        self.name = name or spec.model
        self.folder = model_folder(spec.model)
        check_config(self.folder, spec)
        self.watchdog_s = watchdog_s
        self.start_timeout_s = start_timeout_s
        self.state = ClusterState.NEW
        self.error: str | None = None
        self.load_s: float | None = None
        self.launcher: Launcher | None = None
        self.history: list[Generation] = []
        self._reporters: dict[int, Reporter] = {}
        self._outbox: deque[Message] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._last_heard = 0.0
        self._stopping = False

    # -- life ---------------------------------------------------------------------

    def start(self) -> Cluster:
        """Launch the ranks and wait until they have loaded the model.

        Raises:
            ClusterError: The ranks could not start or load the model (one line, from rank 0 or mlx.launch).
        """
        import zmq

        if self.state in (ClusterState.STARTING, ClusterState.READY):
            return self
        self.state = ClusterState.STARTING
        self.error = None
        self._ready.clear()
        self._closing.clear()
        self._stopping = False
        context: Any = zmq.Context.instance()
        sock = context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.launcher = Launcher(
            command(self.spec, self.folder, connect=f"tcp://127.0.0.1:{port}"), environment(self.spec)
        )
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._loop, args=(sock,), name="mlx-notebook-cluster", daemon=True)
        self._thread.start()
        _live.add(self)
        try:
            if not self._ready.wait(self.start_timeout_s):
                self._end(f"the ranks did not load the model within {self.start_timeout_s:.0f} s")
        except KeyboardInterrupt:  # "Interrupt kernel" while the ranks load: leave nothing running
            self._end("start interrupted")
            self._join()
            raise
        if self.state is not ClusterState.READY:
            self._join()
            raise ClusterError(f"cluster did not start: {self.error}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the running generations, end the ranks and wait for them (all of them, or the group is killed)."""
        if self.launcher is None or self._thread is None:
            self.state = ClusterState.ENDED
            return
        self._stopping = True
        deadline = time.monotonic() + timeout / 2
        # Stopped generations end as "stopped" (rank 0 says so after every rank synchronized).
        for gen in self.cancel_all():
            gen.wait(max(0.0, deadline - time.monotonic()))
        self._send(Shutdown())
        self._closing.set()
        self._wake()
        self._join(timeout)
        self.state = ClusterState.ENDED

    def restart(self) -> Cluster:
        """Stop (if running) and start again with the same spec."""
        self.stop()
        return self.start()

    def _join(self, timeout: float = 10.0) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout + 5.0)

    @property
    def ready(self) -> bool:
        """Whether generations can run here now."""
        return self.state is ClusterState.READY

    def status(self) -> ClusterStatus:
        """Where the cluster stands (see :class:`ClusterStatus`)."""
        launcher = self.launcher
        return ClusterStatus(
            state=self.state,
            model=self.name,
            folder=str(self.folder),
            ranks=self.spec.ranks,
            backend=self.spec.backend,
            pipeline=self.spec.pipeline,
            launcher_pid=launcher.pid if launcher is not None and launcher.exit_code is None else None,
            load_s=self.load_s,
            running=sorted(self._reporters),
            error=self.error,
            log_path=str(launcher.log_path) if launcher is not None else None,
        )

    def serves(self, model: str | None) -> bool:
        """Whether a request for ``model`` runs here (its name, or the same folder)."""
        if model is None:
            return False
        if not self.ready:
            # A name only the cluster gives: say it ended rather than "model not found".
            return model == self.name and self.name != self.spec.model
        if model == self.name or model == self.spec.model:
            return True
        try:
            return Path(resolve(model).path).resolve() == self.folder
        except MLXNotebookError:
            return False

    # -- generations ----------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Generation:
        """Validate ``request`` and send it to rank 0; return its handle at once.

        Raises:
            InvalidArgumentError: A bad argument.
            ClusterError: The cluster is not running.
        """
        request.validate()
        unsupported = [name for name in _LOCAL_ONLY if getattr(request, name)]  # None, 0, [] and {} are off
        if unsupported:
            raise InvalidArgumentError(
                f"{', '.join(unsupported)}: not available on a cluster yet (stop strings and log-probs "
                "run on the local worker only); leave them out"
            )
        if not self.ready:
            raise ClusterError(f"the cluster is {self.state}{': ' + self.error if self.error else ''}; restart it")
        gen = Generation(request, on_cancel=lambda _gen: None)
        gen.token = _ForwardingToken(lambda action, gid=gen.id: self._send(Control(gid, action)))
        gen.stats = ClusterStats(ranks=self.spec.ranks, backend=self.spec.backend)
        reporter = Reporter(gen)
        with self._lock:
            self._reporters[gen.id] = reporter
            self.history.append(gen)
        self._send(Generate(gen.id, request_fields(request)))
        return gen

    def active(self) -> list[Generation]:
        """The generations sent and not finished."""
        with self._lock:
            return [r.generation for r in self._reporters.values()]

    def cancel_all(self) -> list[Generation]:
        """Stop every unfinished generation; return them."""
        gens = self.active()
        for gen in gens:
            gen.cancel()
        return gens

    # -- the client thread -------------------------------------------------------------

    def _send(self, message: Message) -> None:
        self._outbox.append(message)
        self._wake()

    def _wake(self) -> None:
        with self._lock:  # never a write to a closed (and perhaps reused) descriptor
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # the pipe is full: the thread is awake anyway
                    pass

    def _loop(self, sock: Any) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        # Rank 0 runs on this host: its connection closes the moment its process ends
        # (SIGKILL included; ~20 ms measured), long before mlx.launch ends the group (0.3-2.3 s).
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(monitor, zmq.POLLIN)
        last_ping = 0.0

        def flush() -> None:
            while self._outbox:
                _send_now(sock, self._outbox.popleft())

        try:
            while True:
                poller.poll(100)
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                flush()
                while sock.poll(0, zmq.POLLIN):
                    self._last_heard = time.monotonic()
                    self._dispatch(unpack(sock.recv()))
                    # A stop or pause (asked by a listener, or any thread) leaves at once,
                    # not after a backlog of tokens has been read.
                    flush()
                while monitor.poll(0, zmq.POLLIN):
                    monitor.recv_multipart()  # the only event asked for: a disconnect
                    if self.state is ClusterState.READY and not self._stopping:
                        self._fault("rank 0 is gone (its connection to the kernel closed)")
                now = time.monotonic()
                if now - last_ping >= PING_S and self.state is ClusterState.READY:
                    _send_now(sock, Ping())
                    last_ping = now
                if self._closing.is_set():
                    flush()  # a stop() between the drain above and here: its shutdown goes too
                    break
                if self._watch(now):
                    break
        finally:
            # A moment for the last messages (shutdown, stops) to leave; then whatever is still
            # unfinished ends here: stopped if a stop was asked, failed otherwise.
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=500 if self._stopping else 0)
            launcher = self.launcher
            if launcher is not None:
                # A fault: the group can run nothing more, and a rank stuck in a collective would
                # sit out a SIGTERM grace; end it at once (the generations fail after it is gone).
                launcher.stop(timeout=5.0) if self._stopping else launcher.kill()
            # After the ranks are gone: nothing is in flight when a generation is reported ended.
            self._end(self.error or "the cluster was stopped")
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
            _live.discard(self)

    def _watch(self, now: float) -> bool:
        """The watchdog: end the cluster when the ranks ended or rank 0 went silent."""
        launcher = self.launcher
        assert launcher is not None
        if launcher.exit_code is not None:
            self._fault(f"the ranks ended ({launcher.why_ended()})")
            return True
        # Rank 0 answers every ping within a piece of work, also while idle or paused
        # (it agrees with the others every tick): silence means a rank hangs in a collective.
        if self.state is ClusterState.READY and now - self._last_heard > self.watchdog_s:
            self._fault(f"rank 0 silent for {self.watchdog_s:.0f} s (a rank hung or died)")
            return True
        return False

    def _fault(self, why: str) -> None:
        """The cluster can run nothing more: say why now; its generations end once its processes are gone."""
        if self.state is not ClusterState.ENDED and not self._stopping:
            self.error = why
        self.state = ClusterState.ENDED
        self._closing.set()

    def _end(self, why: str) -> None:
        if self.state is not ClusterState.ENDED and not self._stopping:
            self.error = why
        self.state = ClusterState.ENDED
        self._ready.set()
        self._closing.set()
        with self._lock:
            reporters = list(self._reporters.values())
            self._reporters.clear()
        for reporter in reporters:
            gen = reporter.generation
            if gen.token.cancelled:
                gen.stats.stop_latency_s = gen.token.mark_stopped()
                reporter.finish(State.STOPPED)
            else:
                reporter.finish(
                    State.FAILED, ClusterError(f"cluster generation #{gen.id} failed: {why}; restart the cluster")
                )

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Ready):
            self.load_s = msg.load_s
            self.state = ClusterState.READY
            self._ready.set()
            return
        if isinstance(msg, FailedStart):
            self.error = msg.error
            self._closing.set()
            self.state = ClusterState.ENDED
            self._ready.set()
            return
        if not isinstance(msg, (Tokens, Progress, Stats, StateChanged, Reasoning, Finish)):
            return  # a Pong: hearing it is all it is for
        with self._lock:
            reporter = self._reporters.get(msg.id)
        if reporter is None:
            return
        gen = reporter.generation
        token = gen.token
        if isinstance(msg, Tokens):
            gen.stats.generated_tokens += len(msg.ids)  # as the local engine does, before listeners hear of them
            reporter.emit(list(msg.ids), msg.text)
            if msg.ids:
                # After the listeners: a Pause one of them asked leaves first (the loop flushes in order).
                self._outbox.append(Seen(gen.id, len(gen.tokens)))
        elif isinstance(msg, Progress):
            reporter.progress(msg.phase, msg.done, msg.total)
        elif isinstance(msg, Reasoning):
            tags = ThinkTags(msg.start, msg.end, tuple(msg.start_ids), tuple(msg.end_ids))
            reporter.set_reasoning(tags, msg.open)
        elif isinstance(msg, Stats):
            _update_stats(gen.stats, msg.stats)
        elif isinstance(msg, StateChanged):
            state = State(msg.state)
            if isinstance(token, _ForwardingToken):
                if state is State.PAUSED:
                    token.took_effect("pause")
                elif reporter.state is State.PAUSED:
                    token.took_effect("resume")
            reporter.set_state(state)
        else:
            with self._lock:
                self._reporters.pop(gen.id, None)
            state = State(msg.state)
            if state is State.STOPPED:
                gen.stats.stop_latency_s = token.mark_stopped()
            error = ClusterError(str(msg.error)) if state is State.FAILED else None
            reporter.finish(state, error)
            if msg.lost:
                # A rank is gone: the group can run nothing more (mlx.launch is ending the rest).
                self._fault(str(msg.error))


# Request options the ranks' decode loop does not have (see steps.decode).
_LOCAL_ONLY = ("stop", "logprobs")


def _send_now(sock: Any, message: Message) -> None:
    """Send without blocking: a ``PAIR`` socket blocks while its peer is gone (rank 0 died), and the watchdog must not."""
    import zmq

    try:
        sock.send(pack(message), zmq.NOBLOCK)
    except zmq.Again:
        log.debug("rank 0 is not connected; dropped %s", message.TYPE)


# Stats the kernel keeps itself: the stop's latency (from its own clock) and the
# reasoning split (the kernel's reporter splits; rank 0's sink does not).
_COUNTED_HERE = ("stop_latency_s", "reasoning_tokens", "reasoning_s")


def _update_stats(stats: GenerationStats, values: dict[str, Any]) -> None:
    known = {f.name for f in fields(stats)}
    for key, value in values.items():
        if key not in known or key in _COUNTED_HERE:
            continue
        if key == "finish_reason":
            value = FinishReason(value) if value is not None else None
        elif key == "prefill_pieces":
            value = PrefillPieces(value)
        setattr(stats, key, value)
