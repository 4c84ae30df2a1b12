"""Driving JupyterLab in Chromium: notebooks, cells, menus and the ``%%mlxgen`` widget.

:class:`Lab` is one test's page, :class:`Notebook` an open notebook (run a
cell with the toolbar's Run button, read its prompt and output, click a
menu), :class:`Widget` the ``%%mlxgen`` widget in a cell's output and
:class:`WidgetState` what it shows at one moment (read with one
``evaluate``, so one sample is one moment of the page; see
:meth:`Widget.wait_state` for why a moment can still mix two updates).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KERNEL_READY_S = 90.0  # kernel start plus the default model's load on a busy 2-core CPU
GENERATION_S = 180.0


# -- driving JupyterLab -------------------------------------------------------------------------

# One evaluate per sample: the widget's whole visible state.
# A --format markdown generation that has ended is one Markdown output (no
# widget): its status line is the <sub> under the answer, its buttons are gone.
_WIDGET_STATE_JS = """
(out) => {
  const box = out.querySelector('.widget-vbox');
  if (!box) {
    const md = out.querySelector('.jp-RenderedMarkdown');
    const sub = md ? md.querySelector('sub') : null;
    if (!sub) return null;
    const copy = md.cloneNode(true);
    copy.querySelectorAll('sub').forEach((s) => s.closest('p') ? s.closest('p').remove() : s.remove());
    const gone = {label: '', disabled: true};
    return {text: copy.textContent.trim(), status: sub.textContent, color: sub.style.color,
            stop: gone, pause: gone, bar_class: '', bar_width: '', phase: ''};
  }
  const buttons = [...box.querySelectorAll('.widget-hbox button')];
  const pre = box.querySelector(':scope > .widget-html pre');
  const markdown = box.querySelector(':scope > .mlxgen-markdown');
  const span = box.querySelector('.mlxgen-status');
  const bar = box.querySelector('.progress-bar');
  const label = box.querySelector('.widget-hprogress .widget-label');
  const button = (b) => b ? {label: b.textContent.trim(), disabled: b.disabled} : null;
  return {
    text: pre ? pre.textContent : (markdown ? markdown.textContent : ''),
    status: span ? span.textContent : '',
    color: span ? span.style.color : '',
    stop: button(buttons[0]),
    pause: button(buttons[1]),
    bar_class: bar ? bar.className : '',
    bar_width: bar ? bar.style.width : '',
    phase: label ? label.textContent : '',
  };
}
"""


@dataclass
class WidgetState:
    """What one ``%%mlxgen`` widget shows at one moment."""

    text: str
    status: str
    color: str
    stop: dict[str, Any]
    pause: dict[str, Any]
    bar_class: str
    bar_width: str
    phase: str
    at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def state(self) -> str:
        """The generation state the stats line shows (``#3 decoding · ...`` -> ``decoding``)."""
        m = re.match(r"#\d+ (\w+)", self.status)
        return m.group(1) if m else ""

    @property
    def tokens(self) -> int:
        m = re.search(r"(\d+) tokens", self.status)
        return int(m.group(1)) if m else 0

    @property
    def stop_ms(self) -> int | None:
        """The stop latency the stats line shows (``stopped in N ms``)."""
        m = re.search(r"stopped in (\d+) ms", self.status)
        return int(m.group(1)) if m else None


class Widget:
    """The ``%%mlxgen`` widget in one cell's output area."""

    def __init__(self, notebook: Notebook, index: int) -> None:
        self.notebook = notebook
        self.page = notebook.page
        self.output = notebook.output(index)
        self.box = self.output.locator(".widget-vbox").first
        self.stop_button = self.box.locator(".widget-hbox button").nth(0)
        self.pause_button = self.box.locator(".widget-hbox button").nth(1)

    def read(self) -> WidgetState | None:
        data = self.output.evaluate(_WIDGET_STATE_JS)
        return WidgetState(**data) if data else None

    def wait_for(self, predicate: Any, timeout: float = GENERATION_S, what: str = "") -> WidgetState:
        """Poll the page every 50 ms until ``predicate(state)`` holds; return that state."""
        deadline = time.monotonic() + timeout
        last: WidgetState | None = None
        while True:
            last = self.read()
            if last is not None and predicate(last):
                return last
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}; widget: {last}")
            self.page.wait_for_timeout(50)

    def wait_state(self, *states: str, timeout: float = GENERATION_S, settle: bool = True) -> WidgetState:
        """Wait until the stats line shows one of ``states``; then, with ``settle``, until the page is still.

        The widget is five widget models, each updated by its own comm message
        (buttons, progress, stats line, then text), so for a moment the stats
        line can say ``paused`` or ``done`` while the text lacks its last
        tokens. A settled state is the whole widget after that moment.
        """
        state = self.wait_for(lambda s: s.state in states, timeout, f"state in {states}")
        if not settle:
            return state
        state = self.settle()
        assert state.state in states, f"the widget left {states} while settling: {state}"
        return state

    def settle(self, quiet: float = 0.3, timeout: float = 10.0) -> WidgetState:
        """The widget's state once it has not changed for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last = self.read()
        while True:
            self.page.wait_for_timeout(quiet * 1000)
            now = self.read()
            if now == last:
                return now
            if time.monotonic() > deadline:
                raise AssertionError(f"the widget keeps changing after {timeout} s: {last} -> {now}")
            last = now

    def click_stop(self) -> None:
        self.stop_button.click()

    def click_pause(self) -> None:
        self.pause_button.click()


class Notebook:
    """One open notebook in the page."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab = lab
        self.page = lab.page
        self.name = name
        self.panel = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first
        self.cells = self.panel.locator(".jp-Notebook .jp-Cell")
        self._started = False  # whether a cell of this notebook has started running

    def cell(self, index: int) -> Any:
        return self.cells.nth(index)

    def output(self, index: int) -> Any:
        return self.cell(index).locator(".jp-OutputArea").first

    def output_text(self, index: int) -> str:
        return self.output(index).inner_text()

    def screenshot_output(self, index: int, path: Path) -> Path:
        """A PNG of one cell's output area (the mouse moved away first: no hover styles)."""
        self.page.mouse.move(0, 0)
        self.output(index).screenshot(path=str(path), animations="disabled")
        return path

    def prompt(self, index: int) -> str:
        return self.cell(index).locator(".jp-InputArea-prompt").inner_text().strip()

    def widget(self, index: int, timeout: float = 60.0) -> Widget:
        """The generation's widget, or the Markdown output it became when it ended."""
        widget = Widget(self, index)
        self.output(index).locator(".widget-vbox, .jp-RenderedMarkdown").first.wait_for(
            state="visible", timeout=timeout * 1000
        )
        return widget

    def kernel_status(self) -> str:
        """The notebook toolbar's kernel status (``idle``, ``busy``, ``restarting``...)."""
        return self.panel.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status") or ""

    def wait_kernel(self, *statuses: str, timeout: float = KERNEL_READY_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            status = self.kernel_status()
            if status in statuses:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"kernel status {status!r}, expected one of {statuses} within {timeout} s")
            self.page.wait_for_timeout(100)

    def fresh_kernel(self) -> None:
        """Note a kernel (re)start: the next Run may be dropped again (see :meth:`run`)."""
        self._started = False

    def select(self, index: int) -> None:
        """Make a cell the active one (a click on its prompt, as a person does)."""
        cell = self.cell(index)
        for _ in range(50):
            cell.locator(".jp-InputArea-prompt").click()
            if "jp-mod-active" in (cell.get_attribute("class") or ""):
                return
            self.page.wait_for_timeout(100)
        raise AssertionError(f"cell {index} does not become active; dialogs: {self.dialogs()}")

    def run(self, index: int, *, wait: bool = True, timeout: float = GENERATION_S) -> str:
        """Run one cell with the toolbar's Run button; with ``wait``, until it has finished.

        Returns the prompt after the run (``[3]:``), or the prompt once it
        started (``[*]:``, or already ``[N]:`` for a quick cell) when not waiting.

        The kernel indicator says "idle" a moment before JupyterLab has the
        kernel's info; a Run in that moment is dropped (no request is sent).
        So until the first cell of the notebook has started, a Run that has
        not started after a few seconds is clicked again.
        """
        before = _prompt_number(self.prompt(index))
        deadline = time.monotonic() + 30
        while True:
            self.select(index)
            self.panel.locator("jp-button[data-command='notebook:run-cell-and-select-next']").click()
            # [*] when the request is sent; a quick cell may go straight to its number.
            retry_at = time.monotonic() + (3 if not self._started else float("inf"))
            while True:
                prompt = self.prompt(index)
                if prompt == "[*]:" or _prompt_number(prompt) not in (None, before):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"cell {index} did not start: prompt {prompt!r}; dialogs: {self.dialogs()}")
                if time.monotonic() > retry_at:
                    break
                self.page.wait_for_timeout(50)
            if prompt == "[*]:" or _prompt_number(prompt) not in (None, before):
                break
        self._started = True
        if not wait:
            return prompt
        return self.wait_done(index, timeout)

    def wait_done(self, index: int, timeout: float = GENERATION_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            prompt = self.prompt(index)
            if re.fullmatch(r"\[\d+\]:", prompt):
                return prompt
            if time.monotonic() > deadline:
                raise AssertionError(f"cell {index} still running after {timeout} s (prompt {prompt!r})")
            self.page.wait_for_timeout(100)

    def menu(self, menu: str, item: str) -> None:
        """Click a main-menu entry, e.g. ``menu("Kernel", "Interrupt Kernel")``."""
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{re.escape(menu)}$")).click()
        entry = self.page.locator(
            ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}$")
        )
        entry.first.click()

    def dialogs(self) -> list[str]:
        """The text of every open JupyterLab dialog."""
        return [d.inner_text() for d in self.page.locator(".jp-Dialog").all()]


def _prompt_number(prompt: str) -> int | None:
    m = re.fullmatch(r"\[(\d+)\]:", prompt)
    return int(m.group(1)) if m else None


class Lab:
    """A JupyterLab page for one test.

    Args:
        server: The :class:`conftest.LabServer` (``url``, ``token``, ``root``,
          ``kernel_name``, ``kernel_display_name``, ``api``).
        page: The Playwright page.
        workspace: A JupyterLab workspace name of this test's own.
    """

    def __init__(self, server: Any, page: Any, workspace: str) -> None:
        self.server = server
        self.page = page
        self.workspace = workspace
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.opened: list[str] = []

    def _on_console(self, message: Any) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    def write_notebook(self, name: str, cells: Sequence[str]) -> Path:
        """Write a notebook of code cells into the server's root folder."""
        import nbformat

        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": self.server.kernel_name,
            "display_name": self.server.kernel_display_name,
            "language": "python",
        }
        nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
        path = self.server.root / name
        nbformat.write(nb, str(path))
        return path

    def copy_notebook(self, source: Path, name: str | None = None) -> Path:
        target = self.server.root / (name or source.name)
        shutil.copyfile(source, target)
        return target

    def open(self, name: str, cells: Sequence[str] | None = None) -> Notebook:
        """Open a notebook from the file browser (written first when ``cells`` is given).

        As a person does: JupyterLab starts in this test's own workspace, the
        launcher shows the Python kernel (the kernel specs have loaded), then a
        double click in the file browser opens the notebook and starts its
        kernel. (Opening ``/lab/tree/NAME`` directly races the kernel specs:
        under load JupyterLab then asks "Select Kernel" or starts two kernels.)
        Returns once the notebook shows all its cells and the Python kernel, idle.
        """
        import nbformat

        if cells is not None:
            self.write_notebook(name, cells)
        expected_cells = len(nbformat.read(str(self.server.root / name), as_version=4).cells)
        self.opened.append(name)
        page = self.page
        kernel_display_name = self.server.kernel_display_name
        page.goto(f"{self.server.url}/lab/workspaces/{self.workspace}?token={self.server.token}")
        page.locator(".jp-LauncherCard", has_text=kernel_display_name).first.wait_for(timeout=KERNEL_READY_S * 1000)
        item_name = page.locator(".jp-DirListing-itemText", has_text=re.compile(rf"^{re.escape(name)}$"))
        page.locator(".jp-DirListing-item").filter(has=item_name).dblclick()
        notebook = Notebook(self, name)
        deadline = time.monotonic() + KERNEL_READY_S
        while True:
            dialogs = notebook.dialogs()
            assert not dialogs, f"JupyterLab asks something while opening {name}: {dialogs}"
            kernel = notebook.panel.locator(".jp-Toolbar-kernelName")
            if (
                notebook.panel.is_visible()
                and kernel.count()
                and kernel.first.inner_text().strip() == kernel_display_name
                and notebook.kernel_status() == "idle"
                and notebook.cells.count() == expected_cells
            ):
                return notebook
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not open with an idle {kernel_display_name} within {KERNEL_READY_S} s")
            page.wait_for_timeout(100)

    def shutdown_kernels(self) -> None:
        """Shut down the kernels of the notebooks this test opened (teardown)."""
        try:
            sessions = self.server.api("GET", "/api/sessions")
        except Exception:
            return
        for session in sessions or []:
            if session.get("path") in self.opened:
                try:
                    self.server.api("DELETE", f"/api/sessions/{session['id']}")
                except Exception:
                    pass
