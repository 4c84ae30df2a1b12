"""Where a generation's display messages go: the starting cell while it runs, the running cell when it ends.

A kernel cannot tell whether its frontend renders widgets: a comm open gets no
answer either way. So every view's display bundle carries ``text/plain`` too,
and when the generation ends the display is updated with the final text. Live
frontends keep showing the widget; headless clients (nbclient, papermill,
nbconvert) store the text. Those clients only read messages whose parent is
the cell they are running, so the final update goes out with the kernel's
*current* parent (the display id finds the original output), and, if no cell
was running at that moment, again at the start of the next cell
(:class:`DisplayRouter`). While it runs, a view's display messages carry the
parent of the cell that started it (:func:`thread_parent`), so a frontend
routes them to that cell.

Example::

    router = DisplayRouter()
    ip.events.register("pre_run_cell", router.pre_run_cell)
    ip.events.register("post_run_cell", router.post_run_cell)
    with thread_parent(shell, parent):
        handle.update(Bundle({"text/plain": "..."}, {}))
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

# Ended views kept for end_again: a shutdown follows its interrupt within moments.
RECENT_VIEWS = 64


class RoutedView(Protocol):
    """What the router needs of a view (one generation's, or a ``--map``'s)."""

    ended_by: str

    def end_now(self) -> None: ...

    def publish_final(self) -> None: ...


@contextmanager
def thread_parent(shell: Any, parent: dict[str, Any] | None) -> Iterator[None]:
    """Route this thread's outputs to ``parent`` (a request) for the block.

    ipykernel 7's ``set_thread_parent`` changes the calling thread's parent
    only. ``set_parent`` would also change the kernel-wide fallback that every
    other thread (and the idle kernel) uses, so it is not used here; on
    ipykernels without ``set_thread_parent`` outputs keep the default route.
    """
    setter = getattr(shell, "set_thread_parent", None)
    if parent is None or setter is None:
        yield
        return
    tokens = setter(parent)
    try:
        yield
    finally:
        shell.reset_thread_parent(tokens)


def current_parent(shell: Any) -> dict[str, Any] | None:
    """The parent request of the calling thread (the running cell on the main thread)."""
    getter = getattr(shell, "get_parent", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # not an ipykernel shell
        return None


def msg_id(parent: dict[str, Any] | None) -> str | None:
    return (parent or {}).get("header", {}).get("msg_id")


class DisplayRouter:
    """Re-sends final displays that went out while no cell was running.

    Headless clients read a message only while they run the cell it names as
    parent. A generation that ends between cells sends its final display with
    a parent nobody reads any more, so the router sends it again from the
    next cell's ``pre_run_cell`` (then the parent is that cell).
    Register :meth:`pre_run_cell` and :meth:`post_run_cell` as IPython events.

    It also knows the views still following a generation, so a kernel that
    shuts down can give each its last state (:meth:`end_all`).
    """

    def __init__(self) -> None:
        # %load_ext runs in a cell, so a cell is running when this is made.
        self.cell_running = True
        self._pending: list[RoutedView] = []
        self._live: dict[int, RoutedView] = {}
        # The views that ended last, newest last (see end_again).
        self._ended: collections.deque[RoutedView] = collections.deque(maxlen=RECENT_VIEWS)
        self._lock = threading.Lock()

    def following(self, view: RoutedView) -> None:
        """Note a view that follows a generation until it ends."""
        with self._lock:
            self._live[id(view)] = view

    def ended(self, view: RoutedView) -> None:
        """Note that ``view`` showed its generation's end."""
        with self._lock:
            self._live.pop(id(view), None)
            if view not in self._ended:
                self._ended.append(view)

    def end_all(self, reason: str, *, now: bool = False) -> list[RoutedView]:
        """Mark every live view as ended by ``reason``; return them.

        Args:
            reason: Why, e.g. ``"kernel restarted"``: shown in the status line.
            now: Also show each one's last state now, whatever its generation's
              state; else each shows it when its generation reports its end.
              Default: ``False``.
        """
        with self._lock:
            live = list(self._live.values())
        for view in live:
            view.ended_by = reason
            if now:
                view.end_now()
        return live

    def end_again(self, generations: list[Any], reason: str) -> list[RoutedView]:
        """Show ``reason`` in the last state of the ended views of ``generations``; return them.

        For generations an interrupt stopped just before a shutdown:
        jupyter_client interrupts a kernel before it asks it to shut down
        (``KernelManager.shutdown_kernel``), so "Restart Kernel" stops them
        first as an interrupt, and their views ended without saying the
        kernel went: the shutdown came after their final draw, or during it
        (after the status line was drawn), in 2 of 12 restarts with two busy
        loops beside the kernel. So each is drawn again, whatever it was told:
        the worker has been drained, so this is the last draw.
        """
        with self._lock:
            again = [v for v in self._ended if any(getattr(v, "gen", None) is g for g in generations)]
        for view in again:
            view.ended_by = reason
            view.end_now()
        return again

    def pre_run_cell(self, info: Any = None) -> None:
        """IPython ``pre_run_cell`` event: re-send pending final displays."""
        self.cell_running = True
        with self._lock:
            pending, self._pending = self._pending, []
        for view in pending:
            view.publish_final()

    def post_run_cell(self, result: Any = None) -> None:
        """IPython ``post_run_cell`` event."""
        self.cell_running = False

    def final_sent(self, view: RoutedView) -> None:
        """Called right *after* a final display was sent from the worker thread."""
        # Read after sending: True means the send came before this cell's end.
        if not self.cell_running:
            with self._lock:
                self._pending.append(view)


class Bundle:
    """A display object with a fixed MIME bundle (for ``display`` / ``update``)."""

    def __init__(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.data = data
        self.metadata = metadata

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return self.data, self.metadata


def keep_frontend_subshell(widget: Any) -> None:
    """Let clicks on ``widget`` run while a ``--wait`` cell blocks the main shell.

    JupyterLab >= 4.4 sends comm messages to a kernel subshell
    (``commsOverSubshells``, default ``perCommTarget``), but ipykernel 7.4
    re-routes each one to the subshell that last *sent* on that comm: the
    running cell's, so a Stop click queued behind the very cell it should stop.
    Keeping the frontend's choice runs the click on the subshell thread
    (measured in JupyterLab 4.6 + Chromium: the stop lands in ~0.1 s during
    the blocking cell). ``_reply_subshell_for`` is private, hence the guard:
    without it clicks simply wait for the cell, as before.
    """
    comm = getattr(widget, "comm", None)
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = lambda data, default: default
