"""What a generation widget shows once its kernel is gone (restart, shutdown, death).

The kernel cannot tell the page: JupyterLab's "Restart Kernel" disposes every
comm and output future *before* it asks the server to restart (see
``KernelConnection.restart`` in ``@jupyterlab/services``), so the last state
that :class:`~mlx_notebook.notebook.kernel_hooks.KernelHooks` sends while
draining never reaches the page. What the page does do is mark every widget
view whose model lost its comm with the class ``jupyter-widgets-disconnected``
(ipywidgets' ``_comm_live_update``). A style rule keyed on that class, shipped
inside the widget, hides the buttons and the progress bar (a click could only
log "Cannot send"), puts "ended: kernel gone" in the stats line where a live
state ("decoding") was, and says in words what happened. No frontend code needed.
"""

from __future__ import annotations

from typing import Any

LIVE_CLASS = "mlxgen-live"  # hidden once the kernel is gone
NOTE_CLASS = "mlxgen-disconnected"  # shown once the kernel is gone
STATE_CLASS = "mlxgen-state"  # a live state word in the stats line
LIVE_STATE_CLASS = "mlxgen-live-state"  # the word itself, hidden once the kernel is gone
GONE_STATE = "ended: kernel gone"
NOTE = "Disconnected from its kernel (restarted or shut down): this generation has ended; the text above is what it produced."

_STYLE = (
    f".{NOTE_CLASS} {{ display: none; opacity: 0.75; font-size: 0.9em; }}"
    f" .jupyter-widgets-disconnected .{NOTE_CLASS} {{ display: block; }}"
    f" .jupyter-widgets-disconnected.{LIVE_CLASS}, .jupyter-widgets-disconnected .{LIVE_CLASS}"
    " { display: none !important; }"
    # Generated content, not text: readers of the widget's value still see the state it last had.
    f" .jupyter-widgets-disconnected .{LIVE_STATE_CLASS} {{ display: none; }}"
    f' .jupyter-widgets-disconnected .{STATE_CLASS}::after {{ content: "{GONE_STATE}"; }}'
)


def live_state(state: str) -> str:
    """HTML of a live state word in the stats line: hidden, and "ended: kernel gone" shown, once the kernel is gone."""
    return f'<span class="{STATE_CLASS}"><span class="{LIVE_STATE_CLASS}">{state}</span></span>'


def disconnected_note() -> Any:
    """An ``HTML`` widget, invisible while the kernel is there, holding the style rule and the note."""
    import ipywidgets as w

    return w.HTML(value=f'<style>{_STYLE}</style><div class="{NOTE_CLASS}"><i>{NOTE}</i></div>')
