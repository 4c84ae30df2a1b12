"""Markdown for a generation: streamed into Output widgets, then one Markdown output.

While tokens stream, :class:`MarkdownArea` shows the answer as a column of
``ipywidgets.Output`` widgets, one per Markdown block (:mod:`.markdown_blocks`).
Each holds one real ``text/markdown`` output, so the frontend renders it with
its own Markdown renderer (JupyterLab: code blocks highlighted, math typeset).
A completed block's widget is set once and never touched again; only the open
last block is re-sent and re-rendered on each update, so the cost of an update
does not grow with the answer. (One ``Output`` for the whole answer would
re-render every block each time: its frontend rebuilds all outputs on change.)

When the generation ends, the display becomes :func:`final_bundle`: the whole
answer as one ``text/markdown`` output with a ``text/plain`` fallback and no
widget, so the saved notebook reads the same on GitHub, in nbconvert's HTML and
in JupyterLab after a restart, with no widget state.
"""

from __future__ import annotations

import html
from typing import Any

from ..generation.handle import Generation
from ..generation.states import State
from .markdown_blocks import MarkdownBlocks, close_fence

# What an answer that ended empty shows instead, by how it ended.
_EMPTY = {
    State.STOPPED: "(stopped before the first token)",
    State.FAILED: "(failed before the first token)",
}
_EMPTY_AFTER_THINKING = {State.STOPPED: "(stopped while thinking)", State.FAILED: "(failed while thinking)"}
# tqdm.notebook's convention: green done, orange stopped, red failed.
OUTCOME_COLOR = {State.DONE: "#2e7d32", State.STOPPED: "#e65100", State.FAILED: "#c62828"}
# Marks a placeholder output, so readers of the widget state can tell it from text.
PLACEHOLDER_KEY = "mlx_notebook_placeholder"


def markdown_output(text: str, *, placeholder: bool = False) -> dict[str, Any]:
    """One ``display_data`` output (nbformat) with ``text/markdown`` and ``text/plain``.

    Args:
        text: The Markdown (and the plain text).
        placeholder: ``text`` says that there is no text yet: shown in italics,
          and marked in the output's metadata. Default: ``False``.
    """
    markdown = f"*{text}*" if placeholder else text
    return {
        "output_type": "display_data",
        "data": {"text/markdown": markdown, "text/plain": text},
        "metadata": {PLACEHOLDER_KEY: True} if placeholder else {},
    }


def empty_note(gen: Generation) -> str:
    """What to show for an answer that ended empty: how it ended, and before what."""
    if gen.reasoning.strip():
        return _EMPTY_AFTER_THINKING.get(gen.state, "(no answer after the reasoning)")
    return _EMPTY.get(gen.state, "(no text)")


def final_markdown(gen: Generation, status: str) -> str:
    """The answer as one Markdown document, the status line under it.

    Args:
        gen: The generation.
        status: Its status line (plain text, escaped here).
    """
    # An answer stopped inside a code block is closed, or the status would be code.
    text = close_fence(gen.text) if gen.text.strip() else f"*{empty_note(gen)}*"
    color = OUTCOME_COLOR.get(gen.state, "inherit")
    return f'{text}\n\n<sub style="color: {color}">{html.escape(status)}</sub>\n'


class MarkdownArea:
    """A column of ``Output`` widgets showing Markdown text as it grows.

    Call :meth:`update` with the whole text so far; it sends only what changed:
    a new widget per newly completed block, and the open block's new text.
    """

    def __init__(self) -> None:
        import ipywidgets as w

        self._widgets = w
        self.blocks = MarkdownBlocks()
        self.box = w.VBox(layout=w.Layout(margin="0.25em 0"))
        self.box.add_class("mlxgen-markdown")
        self._outputs: list[Any] = []
        self._open: Any = None  # the Output of the open block, None before it exists
        self._open_shown: tuple[str, bool] = ("", False)

    def update(self, text: str, *, placeholder: str = "") -> None:
        """Show ``text``; with no text, the ``placeholder`` note (if any) instead."""
        completed, open_block = self.blocks.feed(text)
        count = len(self._outputs)
        for block in completed:
            # The open block's widget gets its last, complete, content.
            self._show(self._open_output(), block, False)
            self._open = None
        empty = not text.strip()
        if open_block or (placeholder and empty):
            shown = (placeholder, True) if placeholder and empty else (open_block, False)
            if shown != self._open_shown or self._open is None:
                self._show(self._open_output(), *shown)
        if len(self._outputs) != count:
            self.box.children = tuple(self._outputs)

    def _open_output(self) -> Any:
        if self._open is None:
            self._open = self._widgets.Output()
            self._outputs.append(self._open)
            self._open_shown = ("", False)
        return self._open

    def _show(self, output: Any, text: str, placeholder: bool) -> None:
        output.outputs = (markdown_output(text, placeholder=placeholder),)
        if output is self._open:
            self._open_shown = (text, placeholder)
