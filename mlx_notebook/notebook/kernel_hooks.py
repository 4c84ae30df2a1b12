"""Interrupts, shutdown and exit in an IPython kernel, made safe for MLX work.

Three situations, three hooks:

* **A cell waits on a generation** (``%%mlxgen --wait``): :func:`wait_for`
  swaps in its own SIGINT handler for the wait. "Interrupt kernel" then cancels
  the generation and the cell keeps waiting until the worker has synchronized
  its stream and parked, and only then raises ``KeyboardInterrupt``. Further
  interrupts during that drain are noted, never allowed to abandon the wait,
  so no device work is left in flight and the model stays usable.
* **The kernel is idle**: ipykernel ignores SIGINT between requests
  (``SIG_IGN``) and installs ``default_int_handler`` only while a request runs.
  Its ``pre_handler_hook`` saves the idle handler in
  ``kernel.saved_sigint_handler`` and ``post_handler_hook`` puts it back, so
  replacing that one attribute makes *our* handler the idle one, with no
  method patched. It cancels the background generations: the handler only
  writes a byte to a pipe, and a helper thread does the cancelling.
* **Shutdown or restart**: ``kernel.do_shutdown`` (an instance attribute
  wrapping the kernel's own method) and an ``atexit`` handler cancel, drain
  and stop the worker before the interpreter finalizes. The views still
  following a generation are told why first, so each shows its last state
  ("stopped: kernel restarted", buttons off) and leaves the text so far as a
  real output, not a widget that says "decoding" forever. At exit after a
  shutdown request, the ``atexit`` handler also lets ipykernel's control thread
  finish its reply (see :meth:`KernelHooks._let_control_finish`).

The ``KeyboardInterrupt`` a stopped ``--wait`` cell raises renders as one
line (IPython's ``_render_traceback_``): the user asked for the stop, so the
frames (the magic's call with the whole prompt, this module) say nothing.

:meth:`KernelHooks.uninstall` restores every one of them.

Example::

    hooks = KernelHooks(get_ipython(), worker=lambda: my_worker)
    hooks.install()
    ...
    hooks.uninstall()
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol

from ..generation.handle import Generation
from ..generation.worker import Worker

log = logging.getLogger(__name__)

WorkerProvider = Callable[[], Worker | None]
SignalHandler = Any  # a callable, signal.SIG_IGN, signal.SIG_DFL or None


class LiveViews(Protocol):
    """The displays still following generations (the widget layer's ``DisplayRouter``)."""

    def end_all(self, reason: str, *, now: bool = False) -> list[Any]: ...

    def end_again(self, generations: list[Any], reason: str) -> list[Any]: ...


_STOP, _QUIT = b"s", b"q"  # bytes the SIGINT handler and uninstall send the helper thread
# Seconds a shutdown waits for the current piece of work: pieces are sized to
# the stop budget (~0.1 s), and jupyter_client sends SIGTERM after 2.5 s.
SHUTDOWN_DRAIN_S = 2.0
# Seconds the exit waits for ipykernel's control thread to end after a shutdown
# request; it normally ends within milliseconds.
CONTROL_FINISH_S = 1.0
# Seconds within which a shutdown after an idle interrupt is taken as that
# interrupt's reason: jupyter_client interrupts a kernel right before it asks
# it to shut down, and a loaded machine may take seconds between the two.
INTERRUPT_THEN_SHUTDOWN_S = 5.0


def wait_for(gen: Generation, *, poll_s: float = 0.05, interrupted: bool = False) -> None:
    """Block until ``gen`` finishes; turn an interrupt into a safe stop.

    On SIGINT the generation's token is cancelled at once (from the signal
    handler), then this keeps waiting until the worker reports it ``stopped``,
    i.e. after the stream was synchronized, and raises ``KeyboardInterrupt``.

    Args:
        gen: The generation to wait for.
        poll_s: How often the wait wakes up. Default: ``0.05``.
        interrupted: An interrupt already arrived before the wait began:
          stop ``gen`` at once, drain, and raise. Default: ``False``.

    Raises:
        KeyboardInterrupt: An interrupt arrived; the generation is stopped and
          nothing is in flight any more.
    """
    __tracebackhide__ = True  # IPython: the user's cell is the interesting frame
    if interrupted:
        gen.cancel()
    if threading.current_thread() is not threading.main_thread():
        # Signals are delivered to the main thread only: nothing to intercept.
        gen.wait()
        if interrupted:
            raise stopped_interrupt(gen)
        return
    interrupts: list[float] = [time.perf_counter()] if interrupted else []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        # Only the token here: a signal handler can run while this thread holds
        # the Event lock inside gen.wait(), and gen.cancel() may take it.
        interrupts.append(time.perf_counter())
        gen.token.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    noted = False
    try:
        while not gen.wait(poll_s):
            if interrupts:
                gen.cancel()  # also drops it from the queue if it had not started
            if len(interrupts) > 1 and not noted:
                noted = True
                print(
                    f"mlxgen #{gen.id}: stopping; waiting for the current piece of work "
                    "to finish so nothing is left running on the device",
                    file=sys.stderr,
                )
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupts:
        raise stopped_interrupt(gen)


def stopped_interrupt(gen: Generation) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` for a stop the user asked for, shown as one line.

    Still a plain ``KeyboardInterrupt`` (``ename`` and ``except`` clauses see
    that); IPython shows what ``_render_traceback_`` returns instead of frames.
    """
    return one_line_interrupt(_stopped_message(gen))


def one_line_interrupt(message: str) -> KeyboardInterrupt:
    """A ``KeyboardInterrupt`` with ``message`` that IPython shows as one line."""
    exc = KeyboardInterrupt(message)
    # An instance attribute: IPython asks hasattr(value, "_render_traceback_").
    exc._render_traceback_ = lambda: [f"{_RED}KeyboardInterrupt{_RESET}: {message}"]  # type: ignore[attr-defined]
    return exc


_RED, _RESET = "\x1b[0;31m", "\x1b[0m"  # IPython's colour for the exception name


@contextmanager
def deferred_interrupts() -> Iterator[list[float]]:
    """Note SIGINT instead of raising it for the block (main thread only).

    A ``KeyboardInterrupt`` can surface at any bytecode: inside ipywidgets'
    ``hold_sync`` it leaves a widget that never sends an update again, and
    between queueing a generation and waiting for it, it leaves the
    generation running unseen. The block sees the interrupts as a list of
    times; :func:`wait_for` inside it still catches its own.

    Yields:
        The times of the interrupts that arrived (empty if none).
    """
    noted: list[float] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(time.perf_counter()))
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def _stopped_message(gen: Generation) -> str:
    latency = gen.stats.stop_latency_s
    took = f", stop took {latency * 1000:.0f} ms" if latency is not None else ""
    return f"mlxgen #{gen.id} {gen.state} after {gen.stats.generated_tokens} tokens{took}; the model stays loaded"


def shutdown_worker(worker: Worker, *, timeout: float = SHUTDOWN_DRAIN_S) -> bool:
    """Cancel everything, wait for the drain, and end the worker thread for good.

    Ending the thread (rather than leaving it parked) matters at exit: the
    worker frees its MLX thread-local state (streams, compile cache) on its
    way out, which must happen before the interpreter finalizes.

    Args:
        worker: The worker to stop.
        timeout: Seconds to wait for the drain and the thread. Default: ``2.0``.

    Returns:
        Whether everything ended within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    worker.cancel_all()
    drained = worker.drain(timeout)
    joined = worker.shutdown(cancel=True, timeout=max(0.0, deadline - time.monotonic()))
    return drained and joined


class KernelHooks:
    """The idle-SIGINT, shutdown and exit hooks for one IPython shell.

    Args:
        shell: The running ``InteractiveShell`` (its ``kernel`` attribute is
          used when it is an ipykernel shell; elsewhere only ``atexit`` applies).
        worker: Returns the worker to act on, or ``None`` when none was used yet.
        drain_timeout: Seconds a shutdown waits for the drain. Default: ``2.0``.
        views: The live views, told why their generations end at shutdown.
          Default: ``None``.
    """

    def __init__(
        self,
        shell: Any,
        worker: WorkerProvider,
        *,
        drain_timeout: float = SHUTDOWN_DRAIN_S,
        views: LiveViews | None = None,
    ) -> None:
        self.shell = shell
        self.worker = worker
        self.drain_timeout = drain_timeout
        self.views = views
        # When an idle interrupt last stopped generations, and which (see stop_worker).
        self._interrupted: tuple[float, list[Generation]] = (0.0, [])
        self.installed = False
        self.kernel = getattr(shell, "kernel", None)
        self._previous_idle: SignalHandler = None
        self._helper: threading.Thread | None = None
        self._wakeup: tuple[int, int] = (-1, -1)
        self._idle_via: str | None = None  # "kernel" or "signal"
        self._had_own_do_shutdown = False
        self._own_do_shutdown: Any = None
        self._do_shutdown: Callable[..., Any] | None = None
        self._shutdown_requested = False

    # -- install / uninstall ------------------------------------------------

    def install(self) -> None:
        """Install every hook that applies here (idempotent)."""
        if self.installed:
            return
        self.installed = True
        self._install_idle_sigint()
        self._install_do_shutdown()
        atexit.register(self._at_exit)

    def uninstall(self) -> None:
        """Restore everything :meth:`install` changed (idempotent)."""
        if not self.installed:
            return
        self.installed = False
        atexit.unregister(self._at_exit)
        self._uninstall_do_shutdown()
        self._uninstall_idle_sigint()

    # -- SIGINT while idle ----------------------------------------------------

    def _install_idle_sigint(self) -> None:
        if self.kernel is None or threading.current_thread() is not threading.main_thread():
            return  # terminal IPython handles Ctrl-C itself; signals need the main thread
        self._start_helper()
        if hasattr(self.kernel, "saved_sigint_handler") and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            # Loaded from a cell: post_handler_hook will restore this one.
            self._previous_idle = self.kernel.saved_sigint_handler
            self.kernel.saved_sigint_handler = self._on_idle_sigint
            self._idle_via = "kernel"
        else:
            # Loaded at kernel start (c.InteractiveShellApp.extensions): we are idle.
            self._previous_idle = signal.signal(signal.SIGINT, self._on_idle_sigint)
            self._idle_via = "signal"

    def _uninstall_idle_sigint(self) -> None:
        if self._idle_via is None:
            return
        kernel = self.kernel
        if kernel is not None and getattr(kernel, "saved_sigint_handler", None) == self._on_idle_sigint:
            kernel.saved_sigint_handler = self._previous_idle
        elif signal.getsignal(signal.SIGINT) == self._on_idle_sigint:
            signal.signal(signal.SIGINT, self._previous_idle)
        # Else someone saved our handler in turn; it now only delegates (see below).
        self._idle_via = None
        self._stop_helper()

    def _on_idle_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self.installed:
            self._delegate(signum, frame)
            return
        # A handler interrupts whatever the main thread was doing (even sending
        # an IOPub message), so it only writes a byte; the cancel, its locks,
        # listeners and comm messages run on the helper thread. Not the event
        # loop: an idle ipykernel 7 main thread sits in a blocking zmq receive,
        # so a scheduled callback would wait for the next request.
        try:
            os.write(self._wakeup[1], _STOP)
        except OSError:  # pipe full (a stop is pending anyway) or closed
            pass

    def _start_helper(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._wakeup = (read_fd, write_fd)
        self._helper = threading.Thread(target=self._helper_loop, name="mlx-notebook-interrupt", daemon=True)
        self._helper.start()

    def _helper_loop(self) -> None:
        read_fd = self._wakeup[0]
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or _QUIT in data:
                return
            try:
                self.stop_background()
            except Exception:  # never let the helper die: the next interrupt needs it
                log.exception("mlx-notebook: stopping on interrupt failed")

    def _stop_helper(self) -> None:
        if self._helper is None:
            return
        try:
            os.write(self._wakeup[1], _QUIT)
        except OSError:
            pass
        self._helper.join(5)
        for fd in self._wakeup:
            os.close(fd)
        self._helper = None

    def stop_background(self) -> list[Generation]:
        """Cancel the running and queued generations; return them."""
        worker = self.worker()
        from ..cluster import routing  # generations running on a cluster's ranks too

        stopped = routing.cancel_all(worker)
        if stopped:
            log.info("interrupt while idle: stopping %s", ", ".join(f"#{g.id}" for g in stopped))
            self._interrupted = (time.monotonic(), stopped)
        return stopped

    def _delegate(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_idle
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt
        # SIG_IGN or None: ignore, as ipykernel does while idle

    # -- shutdown / restart ------------------------------------------------------

    def _install_do_shutdown(self) -> None:
        kernel = self.kernel
        if kernel is None or not hasattr(kernel, "do_shutdown"):
            return
        self._had_own_do_shutdown = "do_shutdown" in vars(kernel)
        self._own_do_shutdown = vars(kernel).get("do_shutdown")
        original = kernel.do_shutdown

        def do_shutdown(restart: bool) -> Any:
            # Runs on the control thread; the main thread may be busy in a cell.
            self._shutdown_requested = True
            self.stop_worker(reason="kernel restarted" if restart else "kernel shut down")
            return original(restart)

        self._do_shutdown = do_shutdown
        kernel.do_shutdown = do_shutdown

    def _uninstall_do_shutdown(self) -> None:
        kernel = self.kernel
        if self._do_shutdown is None or kernel is None:
            return
        if vars(kernel).get("do_shutdown") is self._do_shutdown:
            if self._had_own_do_shutdown:
                kernel.do_shutdown = self._own_do_shutdown
            else:
                del kernel.do_shutdown
        self._do_shutdown = None

    def stop_worker(self, reason: str = "kernel exited") -> bool:
        """Cancel, drain and end the worker (shutdown, restart, exit).

        Args:
            reason: Why, for the views of the generations it stops.
              Default: ``"kernel exited"``.
        """
        worker = self.worker()
        if worker is None:
            return True
        # Told first, so the views' final draws (on the worker thread, as each
        # generation stops) say why; any view still going after the drain
        # (it timed out) is ended right after it.
        self._end_views(reason, now=False)
        try:
            ok = shutdown_worker(worker, timeout=self.drain_timeout)
        except Exception:  # shutting down: report, never raise
            log.exception("mlx-notebook: stopping the worker failed")
            ok = False
        else:
            if not ok:
                log.warning("mlx-notebook: the worker did not stop within %.1f s", self.drain_timeout)
        self._end_views(reason, now=True)
        (at, interrupted), self._interrupted = self._interrupted, (0.0, [])  # told once: not again at exit
        if interrupted and time.monotonic() - at <= INTERRUPT_THEN_SHUTDOWN_S and self.views is not None:
            # Stopped by the interrupt a client sends before its shutdown request: say why.
            try:
                self.views.end_again(interrupted, reason)
            except Exception:  # shutting down: a display error must not stop the exit
                log.exception("mlx-notebook: updating the displays at shutdown failed")
        return ok

    def _end_views(self, reason: str, *, now: bool) -> None:
        if self.views is None:
            return
        try:
            self.views.end_all(reason, now=now)
        except Exception:  # shutting down: a display error must not stop the drain
            log.exception("mlx-notebook: updating the displays at shutdown failed")

    def _at_exit(self) -> None:
        self.stop_worker()
        if self._shutdown_requested:
            self._let_control_finish()

    def _let_control_finish(self, timeout: float = CONTROL_FINISH_S) -> None:
        """Wait until ipykernel's control thread has sent its last status after a shutdown request.

        A race in ipykernel 7 (``kernelapp.close`` vs ``process_control``):
        after the shutdown reply the control thread still publishes "idle"
        through the IOPub thread, while the main thread, already exiting, stops
        that thread in ``close`` (an ``atexit`` handler registered before this
        one, so it runs after it). A publish that checks the IOPub thread alive
        just before it stops sends into a pipe nobody reads and blocks for
        good; ``close`` then joins the control thread forever, and
        jupyter_client SIGTERMs the kernel 2.5 s after its request. A helper
        thread of ours still busy at exit (a stopped load's ``import``, which
        cannot be interrupted) holds the GIL half the time and widens the
        window: 1 shutdown in 22 during a cold load. The control thread ends
        once that publish is done (the shutdown request stopped its loop), so
        waiting for it here, with IOPub still running, closes the race.
        """
        control = getattr(self.kernel, "control_thread", None)
        if isinstance(control, threading.Thread) and control is not threading.current_thread():
            control.join(timeout)
            if control.is_alive():
                log.warning("mlx-notebook: the kernel's control thread did not end within %.1f s", timeout)
