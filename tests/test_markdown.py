"""Markdown output: the block splitter, and ``--format markdown|text`` in a real kernel.

The kernel tests read what a frontend reads: the IOPub display messages (the
MIME types of the first display and of its final update) and the widget comm
messages (the ``Output`` widget of each Markdown block). The saved-notebook
test runs a notebook through nbclient, as papermill or ``nbconvert --execute``
do, and renders it with nbconvert's HTML exporter without widget state.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from conftest import has_default_model

from mlx_notebook.notebook.markdown_blocks import MarkdownBlocks, close_fence
from testkit.kernel_helpers import KernelSession, displays, one_line_usage_error, start_kernel, view

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
CODE_PROMPT = "Write a Python function that adds two numbers. Reply with one code block."

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# -- the splitter (no kernel) ------------------------------------------------------------------

ANSWER = (
    "# Adding\n\nHere is a function:\n\n```python\ndef add(a, b):\n\n    return a + b\n```\n\n"
    "1. first\n\n2. second\n\n   still the second\n\n$$\nx\n\ny\n$$\n\nThe end."
)


@pytest.mark.unit
def test_blocks_cut_at_blank_lines_outside_fences_and_lists() -> None:
    completed, open_block = MarkdownBlocks().feed(ANSWER)
    assert completed == [
        "# Adding\n\n",
        "Here is a function:\n\n",
        "```python\ndef add(a, b):\n\n    return a + b\n```\n\n",
        "1. first\n\n2. second\n\n   still the second\n\n",
        "$$\nx\n\ny\n$$\n\n",
    ]
    assert open_block == "The end."


@pytest.mark.unit
def test_streamed_blocks_are_the_same_and_each_is_sent_once() -> None:
    blocks = MarkdownBlocks()
    streamed: list[str] = []
    for end in range(len(ANSWER) + 1):  # one character per token
        completed, open_block = blocks.feed(ANSWER[:end])
        streamed += completed
        assert "".join(streamed) + open_block == ANSWER[:end]
    assert streamed == MarkdownBlocks().feed(ANSWER)[0]


@pytest.mark.unit
def test_text_that_is_not_an_extension_starts_over() -> None:
    blocks = MarkdownBlocks()
    blocks.feed("one\n\ntwo\n\n")
    assert blocks.feed("other\n\nx") == (["other\n\n"], "x")


@pytest.mark.unit
def test_an_answer_stopped_inside_a_code_block_is_closed() -> None:
    assert close_fence("Look:\n```python\nprint(1)") == "Look:\n```python\nprint(1)\n```"
    assert close_fence("~~~~\nx\n") == "~~~~\nx\n~~~~"
    assert close_fence("```\nx\n```\ndone") == "```\nx\n```\ndone"
    assert close_fence("inline ```x``` only") == "inline ```x``` only"


# -- in a kernel ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel(model_name: str):
    with start_kernel(model_name) as session:
        yield session


def test_markdown_streams_into_output_widgets_and_ends_as_one_markdown_output(kernel: KernelSession) -> None:
    reply = kernel.execute(f"%%mlxgen --wait -n 60 -o md\n{CODE_PROMPT}", timeout=300)
    assert reply.ok, reply.content
    text = kernel.eval("md.text")
    shown = displays(kernel, reply.msg_id)
    # While it runs: the widget, with a text/plain fallback.
    assert WIDGET_MIME in shown[0]["data"] and "text/plain" in shown[0]["data"]
    # At the end: one Markdown output, no widget (readable without widget state).
    final = shown[-1]["data"]
    assert set(final) == {"text/markdown", "text/plain"}, final.keys()
    assert final["text/markdown"].startswith(close_fence(text))
    assert "<sub" in final["text/markdown"] and "done" in final["text/markdown"]
    assert final["text/plain"].startswith(text) and shown[-1]["metadata"]["mlx_notebook"]["chars"] == len(text)

    # The streamed blocks are text/markdown outputs of Output widgets, and
    # together they are exactly the answer.
    widget = view(kernel, reply.msg_id)
    assert widget["text"] == text and widget["blocks"] >= 1
    outputs = [
        output
        for state in kernel.widgets(reply.msg_id).values()
        if state.get("_model_name") == "OutputModel"
        for output in state.get("outputs", ())
    ]
    assert outputs and all(set(o["data"]) == {"text/markdown", "text/plain"} for o in outputs)
    if has_default_model():  # SmolLM2 answers with a fenced code block, then a sentence
        assert "```python" in text and widget["blocks"] >= 2


def test_text_format_keeps_the_plain_widget(kernel: KernelSession) -> None:
    reply = kernel.execute("%%mlxgen --wait --format text -n 8 -o tx\nName a river.", timeout=300)
    assert reply.ok, reply.content
    final = displays(kernel, reply.msg_id)[-1]["data"]
    assert WIDGET_MIME in final and "text/plain" in final and "text/markdown" not in final
    assert view(kernel, reply.msg_id)["text"] == kernel.eval("tx.text")


def test_headless_text_display_ends_in_markdown_with_a_plain_fallback(kernel: KernelSession) -> None:
    reply = kernel.execute("%%mlxgen --wait --plain -n 8 -o pl\nName a river.", timeout=300)
    assert reply.ok, reply.content
    shown = displays(kernel, reply.msg_id)
    assert set(shown[0]["data"]) == {"text/plain"}  # while streaming: cheap plain text
    assert set(shown[-1]["data"]) == {"text/markdown", "text/plain"}
    assert shown[-1]["data"]["text/markdown"].startswith(kernel.eval("pl.text"))


def test_bad_format_is_one_line(kernel: KernelSession) -> None:
    err = one_line_usage_error(kernel.execute("%%mlxgen --format bogus\nName a river."))
    assert "--format" in err and "markdown" in err
    assert kernel.execute("print(1)").ok


@pytest.mark.kernel
def test_saved_notebook_holds_markdown_that_nbconvert_renders(model_name: str, tmp_path: Path) -> None:
    from nbconvert import HTMLExporter

    from scripts import run_quickstart

    path = tmp_path / "answer.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext mlx_notebook"),
        nbformat.v4.new_code_cell(f"%%mlxgen --wait -n 40\n{CODE_PROMPT}"),
        nbformat.v4.new_code_cell("%%mlxgen -n 8 -o bg\nName a river."),  # ends between cells
        nbformat.v4.new_code_cell("bg.wait(300)"),
    ]
    nbformat.write(nb, path)
    done = run_quickstart.run(path, model=None if model_name == "default" else model_name, timeout=300)
    for index in (1, 2):
        (output,) = [o for o in done.cells[index].outputs if o.get("output_type") == "display_data"]
        assert set(output["data"]) == {"text/markdown", "text/plain"}, (index, output["data"].keys())
        assert output["metadata"]["mlx_notebook"]["state"] == "done"
    page, _ = HTMLExporter().from_notebook_node(done)
    assert "Error displaying widget" not in page and "#2 done" in page
    if model_name == "default":
        # The code block rendered as highlighted code (nbconvert: Pygments).
        assert re.search(r'<div class="highlight[^"]*"><pre>.*<span class="k">def</span>', page, re.S)
