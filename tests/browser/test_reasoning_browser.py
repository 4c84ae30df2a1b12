"""The Thinking pane in JupyterLab, driven with Chromium: it streams, folds when the answer starts, unfolds on click.

The model is a random-weight reasoning model (testkit.thinking_model, large
enough that its thinking lasts seconds on a CPU); a logit bias keeps it from
closing the block itself and ``--thinking-budget`` closes it. Every assertion
is on what the page shows: the pane's header and whether its contents are
visible, the reasoning text, the answer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from testkit.thinking_model import make_thinking_model, think_ids

from .lab_driver import GENERATION_S, Lab

pytestmark = pytest.mark.browser

# One evaluate per sample: the pane (an ipywidgets Accordion, a lumino Collapse) and the answer's <pre>.
_PANE_JS = """
(out) => {
  const box = out.querySelector('.widget-vbox');
  if (!box) return null;
  const pane = box.querySelector('.mlxgen-thinking');
  const pre = box.querySelector(':scope > .widget-html pre');
  const status = box.querySelector('.mlxgen-status');
  if (!pane) return {pane: false, answer: pre ? pre.textContent : '', status: status ? status.textContent : ''};
  const collapse = pane.querySelector('.jupyter-widget-Collapse');
  const contents = pane.querySelector('.jupyter-widget-Collapse-contents');
  return {
    pane: true,
    title: pane.querySelector('.jupyter-widget-Collapse-header').textContent.trim(),
    open: collapse.classList.contains('jupyter-widget-Collapse-open'),
    shown: contents.offsetParent !== null && contents.getBoundingClientRect().height > 0,
    reasoning: contents.textContent.trim(),
    answer: pre ? pre.textContent : '',
    status: status ? status.textContent : '',
  };
}
"""


def test_the_pane_streams_folds_and_unfolds(lab: Lab, tmp_path: Path) -> None:
    # ~25-50 ms a token on a shared 2-core CPU: 80 reasoning tokens stream for seconds.
    model = make_thinking_model(tmp_path / "r1", template="r1", layers=6, hidden=768, intermediate=3072, heads=12)
    _, end = think_ids(model)
    nb = lab.open(
        "thinking.ipynb",
        [
            f"%load_ext mlx_notebook\n%config MLXGen.format = 'text'\nbias = {{{end}: -100.0, 2: -100.0}}",
            f"%%mlxgen -m {model} --logit-bias bias --thinking-budget 80 -n 160\nOnce upon a time",
        ],
    )
    nb.run(0)
    nb.run(1)
    nb.widget(1)
    output = nb.output(1)

    samples = []
    deadline = time.monotonic() + GENERATION_S
    while True:
        state = output.evaluate(_PANE_JS)
        if state is not None:
            samples.append(state)
            if "done" in state["status"]:
                break
        assert time.monotonic() < deadline, f"not done within {GENERATION_S} s: {samples[-1:]}"
        lab.page.wait_for_timeout(50)

    thinking = [s for s in samples if s["pane"] and s["title"].startswith("Thinking")]
    # Streams: open, shown, its text growing over several samples, no answer yet.
    assert len({s["reasoning"] for s in thinking}) >= 3, [s.get("title") for s in samples]
    assert all(s["open"] and s["shown"] and not s["answer"] for s in thinking)
    lengths = [len(s["reasoning"]) for s in thinking]
    assert lengths == sorted(lengths)
    # Folds when the answer starts; the title says how long it thought.
    answering = [s for s in samples if s["pane"] and s["answer"]]
    assert answering and all(not s["open"] and not s["shown"] for s in answering)
    final = samples[-1]
    assert final["title"].startswith("Thought for 80 tokens, "), final

    # A click on the header unfolds it: the whole reasoning is there.
    output.locator(".mlxgen-thinking .jupyter-widget-Collapse-header").click()
    lab.page.wait_for_function(
        "(out) => out.querySelector('.mlxgen-thinking .jupyter-widget-Collapse-open') !== null",
        arg=output.element_handle(),
        timeout=10_000,
    )
    unfolded = output.evaluate(_PANE_JS)
    assert unfolded["open"] and unfolded["shown"] and len(unfolded["reasoning"]) >= lengths[-1], unfolded
