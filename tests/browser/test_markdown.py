"""A Markdown answer in JupyterLab + Chromium: rendered while it streams, after, and after a restart.

The default model (SmolLM2-135M, greedy) answers the prompt below with a fenced
Python code block and a sentence. Assertions are on the page: the answer's
code block is HTML rendered by JupyterLab's Markdown renderer (``pre > code``
with highlight spans) inside the widget while tokens stream, in the one
Markdown output the widget makes way for at the end, and in the saved
notebook reopened after Restart Kernel and a page reload (no widget state).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from .lab_driver import GENERATION_S, Lab

pytestmark = pytest.mark.browser

CELL = "%%mlxgen -n 60\nWrite a Python function that adds two numbers. Reply with one code block."

# What one cell's output area shows: the widget (if any), its state line, and
# the rendered Markdown: code blocks (text, highlighted?) and all text.
_OUTPUT_JS = """
(out) => {
  const md = [...out.querySelectorAll('.jp-RenderedMarkdown')];
  const codes = md.flatMap((m) => [...m.querySelectorAll('pre')]);
  const status = out.querySelector('.mlxgen-status');
  const sub = out.querySelector('.jp-RenderedMarkdown sub');
  return {
    widget: !!out.querySelector('.widget-vbox'),
    status: status ? status.textContent : (sub ? sub.textContent : ''),
    code: codes.map((c) => c.textContent).join('\\n'),
    highlighted: codes.some((c) => c.querySelector('span[class]') !== null),
    text: md.map((m) => m.textContent).join(''),
  };
}
"""


def read(lab: Lab, nb: Any, index: int) -> dict[str, Any]:
    return nb.output(index).evaluate(_OUTPUT_JS)


def wait_output(lab: Lab, nb: Any, index: int, predicate: Any, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + GENERATION_S
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = read(lab, nb, index)
        if predicate(last):
            return last
        lab.page.wait_for_timeout(50)
    raise AssertionError(f"timed out waiting for {what}; output: {last}")


def test_markdown_renders_while_streaming_after_and_after_a_restart(lab: Lab, screenshot_dir: Path) -> None:
    nb = lab.open("markdown.ipynb", ["%load_ext mlx_notebook", CELL])
    nb.run(0)
    nb.run(1)
    # While it streams: the code block is rendered HTML inside the widget.
    streaming = wait_output(
        lab,
        nb,
        1,
        lambda s: s["widget"] and "decoding" in s["status"] and "def " in s["code"] and s["highlighted"],
        "a highlighted code block while decoding",
    )
    nb.screenshot_output(1, screenshot_dir / "markdown-streaming.png")
    assert "```" not in streaming["text"]  # rendered, not shown as source
    # At the end: one Markdown output, no widget, the same code, the status line.
    done = wait_output(lab, nb, 1, lambda s: not s["widget"] and "done" in s["status"], "the final Markdown output")
    assert done["highlighted"] and streaming["code"].strip().splitlines()[0] in done["code"]
    assert done["status"].startswith("#1 done · ")
    nb.screenshot_output(1, screenshot_dir / "markdown-done.png")

    # Saved, the kernel restarted, the page reloaded: the answer is still rendered.
    nb.menu("File", "Save Notebook")
    path = lab.server.root / "markdown.ipynb"
    deadline = time.monotonic() + 30
    while not _saved_markdown(path):
        assert time.monotonic() < deadline, "the saved notebook has no Markdown output"
        time.sleep(0.2)
    nb.menu("Kernel", "Restart Kernel…")
    dialog = lab.page.locator(".jp-Dialog")
    dialog.wait_for(state="visible", timeout=10_000)
    dialog.locator("button.jp-mod-accept").click()
    nb.wait_kernel("idle")
    # The workspace reopens the notebook from the saved file, in a new kernel session.
    lab.page.reload()
    nb.cells.nth(1).wait_for(state="visible", timeout=90_000)
    again = wait_output(lab, nb, 1, lambda s: bool(s["code"]), "the rendered answer after reopening")
    assert again["highlighted"] and again["code"] == done["code"] and again["status"] == done["status"]
    assert not again["widget"]
    assert not lab.page_errors, lab.page_errors


def _saved_markdown(path: Path) -> bool:
    """Whether the saved notebook's answer cell holds Markdown output (``False`` while the server is writing it)."""
    try:
        cells = nbformat.read(path, 4).cells
    except (nbformat.reader.NotJSONError, OSError):  # Jupyter's save truncates, then writes: a read can see it empty
        return False
    return any(o.get("data", {}).get("text/markdown") for o in cells[1].get("outputs", []))
