"""``%%mlxgen`` with JupyterLab's Kernel menu, and the Stop button during a ``--wait`` cell.

* Kernel > Interrupt Kernel during a ``--wait`` cell stops the generation
  safely: the cell shows ``KeyboardInterrupt``, the kernel stays alive and the
  next cell generates.
* Kernel > Restart Kernel... mid-generation: only the usual confirmation, the
  kernel comes back idle and a new cell runs.
* The Stop button during a ``--wait`` cell. JupyterLab (>= 4.4, setting
  ``commsOverSubshells``, default ``perCommTarget``) sends widget messages to a
  kernel subshell, which ipykernel 7 runs on its own thread even while the
  main thread is busy in a cell. But ipykernel 7.4 re-routes a comm message to
  the subshell that last *sent* on that comm (``BaseComm._reply_subshell_for``,
  meant for request/reply widgets): the widget's updates carry the running
  cell's parent, so the click goes to the main shell and waits for the cell
  to end. mlx-notebook's buttons keep the frontend's subshell
  (``widget._keep_frontend_subshell``), so
  :func:`test_stop_click_during_wait_cell` sees the Stop land during the
  blocking cell.
"""

from __future__ import annotations

import re
import time

import pytest

from .lab_driver import Lab, Notebook

pytestmark = pytest.mark.browser

LONG = "%%mlxgen --wait -n 40\nWrite a long story about a dragon who learns to sing."
SHORT = "%%mlxgen -n 12\nName three rivers in one sentence."
STOP_MS_LIMIT = 2000


def stderr_text(nb: Notebook, index: int) -> str:
    outputs = nb.output(index).locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return "\n".join(outputs.all_inner_texts())


def test_interrupt_kernel_menu_during_wait_cell(lab: Lab) -> None:
    nb = lab.open("interrupt.ipynb", ["%load_ext mlx_notebook\n%config MLXGen.format = 'text'", LONG, SHORT])
    nb.run(0)
    assert nb.run(1, wait=False) == "[*]:"
    widget = nb.widget(1)
    # The cell blocks, and the text still streams into its widget.
    streaming = widget.wait_for(lambda s: s.state == "decoding" and s.tokens >= 3, what="3 tokens")
    # The cell still runs. (JupyterLab's kernel indicator is not checked here: the
    # widget's comm messages run on a subshell, and the indicator follows any
    # status message, so it can read "idle" while the cell runs — seen once in CI.)
    assert nb.prompt(1) == "[*]:"
    assert not streaming.stop["disabled"]

    nb.menu("Kernel", "Interrupt Kernel")
    nb.wait_done(1, timeout=30)
    stopped = widget.wait_state("stopped", timeout=10)
    assert 3 <= stopped.tokens < 40 and stopped.text.strip()
    assert stopped.stop_ms is not None and stopped.stop_ms < STOP_MS_LIMIT, stopped.status
    assert "progress-bar-warning" in stopped.bar_class.split()
    error = stderr_text(nb, 1)
    assert "KeyboardInterrupt" in error, error
    assert re.search(r"mlxgen #1 stopped after \d+ tokens, stop took \d+ ms; the model stays loaded", error), error
    assert nb.wait_kernel("idle", timeout=10) == "idle"
    assert nb.dialogs() == []

    nb.run(2)
    done = nb.widget(2).wait_state("done")
    assert done.tokens == 12 and done.text.strip()
    assert stderr_text(nb, 2) == ""
    assert nb.kernel_status() == "idle"


def test_restart_kernel_menu_mid_generation(lab: Lab) -> None:
    nb = lab.open(
        "restart.ipynb",
        [
            "%load_ext mlx_notebook\n%config MLXGen.format = 'text'",
            "%%mlxgen -n 200\nWrite a long story about a dragon who learns to sing.",
            "%load_ext mlx_notebook\n%config MLXGen.format = 'text'",
            SHORT,
        ],
    )
    nb.run(0)
    nb.run(1)
    nb.widget(1).wait_for(lambda s: s.state == "decoding" and s.tokens >= 3, what="3 tokens")
    assert not nb.output(1).locator(".mlxgen-disconnected").is_visible()  # only once the kernel is gone

    nb.menu("Kernel", "Restart Kernel…")
    dialog = lab.page.locator(".jp-Dialog")
    dialog.wait_for(state="visible", timeout=10_000)
    assert nb.dialogs() == [dialog.inner_text()] and "Restart Kernel?" in dialog.inner_text()
    dialog.locator("button.jp-mod-accept").click()

    # Watch the page through the restart: the kernel leaves idle and comes back,
    # and no other dialog (an error, "kernel died", "restart failed") shows up.
    statuses: list[str] = []
    extra_dialogs: list[str] = []
    deadline = time.monotonic() + 90
    while True:
        status = nb.kernel_status()
        if not statuses or statuses[-1] != status:
            statuses.append(status)
        extra_dialogs += [d for d in nb.dialogs() if d not in extra_dialogs]
        if status == "idle" and len(statuses) > 1:
            break
        assert time.monotonic() < deadline, f"kernel statuses: {statuses}"
        lab.page.wait_for_timeout(50)
    assert any(s in ("restarting", "starting", "unknown", "busy") for s in statuses), statuses
    lab.page.wait_for_timeout(1000)  # a late error dialog would show up now
    extra_dialogs += nb.dialogs()
    assert extra_dialogs == [], extra_dialogs
    assert nb.kernel_status() == "idle"
    # The old widget cannot hear from its kernel any more (JupyterLab disposes the
    # comms before the restart): it says so, and its buttons and bar are gone.
    old = nb.output(1)
    note = old.locator(".mlxgen-disconnected")
    note.wait_for(state="visible", timeout=10_000)
    assert "this generation has ended" in note.inner_text()
    assert not old.locator(".mlxgen-live").is_visible()
    assert old.locator(".widget-vbox button:visible").count() == 0
    # Nor does its stats line still read "decoding": the live state word gives way to what happened.
    status = old.locator(".mlxgen-status")
    assert "decoding" not in status.inner_text(), status.inner_text()
    after = status.locator(".mlxgen-state").evaluate("(e) => getComputedStyle(e, '::after').content")
    assert after == '"ended: kernel gone"', after

    nb.fresh_kernel()
    nb.run(2)
    assert stderr_text(nb, 2) == ""
    nb.run(3)
    done = nb.widget(3).wait_state("done")
    assert done.status.startswith("#1 done") and done.tokens == 12  # a new kernel: ids start again
    assert nb.dialogs() == []


def _stop_during_wait(lab: Lab, name: str, setup: str) -> tuple:
    nb = lab.open(
        name, ["%load_ext mlx_notebook\n%config MLXGen.format = 'text'", setup, LONG, "print('next cell ran')"]
    )
    nb.run(0)
    nb.run(1)
    nb.run(2, wait=False)
    widget = nb.widget(2)
    before = widget.wait_for(lambda s: s.state == "decoding" and s.tokens >= 3, what="3 tokens")
    assert nb.prompt(2) == "[*]:" and not before.stop["disabled"]
    widget.click_stop()
    clicked = time.monotonic()
    return nb, widget, before, clicked


def test_stop_click_during_wait_cell(lab: Lab) -> None:
    """Stop works during a blocking ``--wait`` cell (widget.py keeps the frontend's subshell).

    Needs JupyterLab >= 4.4 with ``commsOverSubshells`` ``perCommTarget`` (the
    default) or ``perComm`` (with ``disabled`` the click waits for the cell,
    measured) and a kernel with subshells (ipykernel >= 7). The click handler
    then runs on the subshell's thread while the main thread waits in the cell.
    """
    nb, widget, before, clicked = _stop_during_wait(lab, "wait-stop.ipynb", "pass")
    stopped = widget.wait_state("stopped", timeout=30)
    latency = time.monotonic() - clicked
    assert latency < 5, f"the page showed the stop {latency:.1f} s after the click"
    assert before.tokens <= stopped.tokens < 40
    assert stopped.stop_ms is not None and stopped.stop_ms < STOP_MS_LIMIT, stopped.status
    assert "progress-bar-warning" in stopped.bar_class.split()
    # The cell ends by itself, without an error: the generation was stopped, not interrupted.
    nb.wait_done(2, timeout=30)
    assert stderr_text(nb, 2) == ""
    assert nb.wait_kernel("idle", timeout=10) == "idle"
    nb.run(3)
    assert "next cell ran" in nb.output_text(3)
