"""A reasoning model's thinking in the cell: a live pane that folds when the answer starts.

While the model thinks, :class:`ThinkingPane` shows its reasoning streaming in
an ``ipywidgets.Accordion`` above the answer, open, titled with its token
count and seconds. When the answer starts the pane folds itself, once: a click
on its title unfolds it (the frontend sets ``selected_index``, which the
kernel never touches again). Nothing is built for a model that does not think.
The saved output keeps it folded as HTML ``<details>`` (:func:`thinking_details`),
which JupyterLab, GitHub and nbconvert all render without widget state.

Example::

    pane = ThinkingPane()
    pane.update(gen)          # on every redraw; builds the Accordion the first time there is reasoning
    box.children = (pane.box, answer)
"""

from __future__ import annotations

import html
from typing import Any

from ..generation.handle import Generation
from ..generation.states import State
from .text_form import thinking_line

PANE_CLASS = "mlxgen-thinking"
BOX_CLASS = "mlxgen-thinking-box"  # the pane's place in the view, there from the start
REASONING_KEY = "mlx_notebook_reasoning"  # marks the pane's output in widget state
_PRE_STYLE = (
    "white-space: pre-wrap; word-break: break-word; margin: 0; opacity: 0.8; "
    "font-family: var(--jp-content-font-family, sans-serif); font-size: 0.9em; line-height: 1.4"
)


def pane_title(gen: Generation) -> str:
    """The pane's title: ``Thinking… · 12 tokens · 1.3 s`` while it thinks, then ``Thought for 12 tokens, 1.3 s``."""
    s = gen.stats
    seconds = f"{s.reasoning_s:.1f} s" if s.reasoning_s is not None else ""
    if gen.thinking and not gen.finished:
        return " · ".join(p for p in ("Thinking…", f"{s.reasoning_tokens} tokens", seconds) if p)
    if gen.state is State.STOPPED and not gen.text:
        return f"Stopped while thinking · {s.reasoning_tokens} tokens"
    return "Thought for " + ", ".join(p for p in (f"{s.reasoning_tokens} tokens", seconds) if p)


def thinking_details(gen: Generation) -> str:
    """The reasoning as a folded HTML ``<details>`` block for Markdown output (``""`` without reasoning)."""
    if not thinking_line(gen):
        return ""
    body = html.escape(gen.reasoning.strip())
    return (
        f'<details class="{PANE_CLASS}"><summary>{html.escape(pane_title(gen))}</summary>\n\n'
        f'<pre style="{_PRE_STYLE}">{body}</pre>\n\n</details>\n\n'
    )


def reasoning_output(gen: Generation) -> dict[str, Any]:
    """The reasoning as one ``display_data`` output (HTML, and the plain text for readers of widget state)."""
    text = gen.reasoning.strip()
    return {
        "output_type": "display_data",
        "data": {"text/html": f'<pre style="{_PRE_STYLE}">{html.escape(text)}</pre>', "text/plain": text},
        "metadata": {REASONING_KEY: True},
    }


class ThinkingPane:
    """The live pane: an empty box until the model thinks, then an ``Accordion`` of one reasoning panel.

    The panel is an ``Output`` widget holding one output (an ``HTML`` widget
    would read as the view's stats line to clients that take the last plain
    ``HTML`` as it).
    """

    def __init__(self) -> None:
        import ipywidgets as w

        self._widgets = w
        self.box = w.VBox(layout=w.Layout(margin="0"))
        self.box.add_class(BOX_CLASS)
        self.accordion: Any = None
        self.text: Any = None
        self._folded = False

    def update(self, gen: Generation) -> None:
        """Bring the pane up to date with ``gen`` (a no-op for a generation with no reasoning)."""
        if not thinking_line(gen):
            return
        if self.accordion is None:
            self._build()
        # Contexts exit in reverse: the title goes out before the text it counts.
        with self.text.hold_sync(), self.accordion.hold_sync():
            self.text.outputs = (reasoning_output(gen),)
            self.accordion.titles = (pane_title(gen),)
            if not self._folded and (not gen.thinking or gen.finished):
                # The answer started (or it ended): fold, once; the person's clicks rule after that.
                self._folded = True
                self.accordion.selected_index = None

    def _build(self) -> None:
        w = self._widgets
        self.text = w.Output()
        self.accordion = w.Accordion(children=[self.text], selected_index=0)
        self.accordion.add_class(PANE_CLASS)
        self.box.children = (self.accordion,)
