"""The ``%%mlxgen --map`` widget in JupyterLab, driven with Chromium: one row's Stop.

Every assertion is on what the page shows: each row's line (``[2] #7
decoding · 12 tokens · ...``) and its Stop button, the Stop all / Pause all
buttons, the overall progress bar's outcome class and the summary line. The
default model (SmolLM2-135M), greedy.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .lab_driver import Lab, Notebook, Widget

pytestmark = pytest.mark.browser

FINAL = ("stopped", "done", "failed")

# One evaluate per sample: the whole map widget at one moment.
_MAP_STATE_JS = """
(out) => {
  const box = out.querySelector('.mlxgen-map');
  if (!box) return null;
  const button = (b) => b ? {label: b.textContent.trim(), disabled: b.disabled} : null;
  const header = box.querySelector(':scope > .widget-hbox:not(.mlxgen-map-row)');
  const buttons = header ? [...header.querySelectorAll('button')] : [];
  const summary = box.querySelector(':scope > .widget-html .widget-html-content');
  const bar = box.querySelector('.progress-bar');
  const label = box.querySelector('.widget-hprogress .widget-label');
  const rows = [...box.querySelectorAll(':scope > .mlxgen-map-row')].map((row) => {
    const line = row.querySelector('.widget-html-content');
    return {line: line ? line.textContent : '', stop: button(row.querySelector('button'))};
  });
  return {
    rows,
    stop_all: button(buttons[0]),
    pause_all: button(buttons[1]),
    summary: summary ? summary.textContent : '',
    bar_class: bar ? bar.className : '',
    progress: label ? label.textContent : '',
  };
}
"""


@dataclass
class Row:
    """One input's row: its line and its Stop button."""

    line: str
    stop: dict[str, Any]

    @property
    def state(self) -> str:
        m = re.match(r"\[\d+\] #\d+ (\w+)", self.line)
        return m.group(1) if m else ""

    @property
    def tokens(self) -> int:
        m = re.search(r"(\d+) tokens", self.line)
        return int(m.group(1)) if m else 0


@dataclass
class MapState:
    """What the map widget shows at one moment."""

    rows: list[Row]
    stop_all: dict[str, Any]
    pause_all: dict[str, Any]
    summary: str
    bar_class: str
    progress: str
    at: float = field(default_factory=time.monotonic, compare=False)


class MapWidget(Widget):
    """The ``--map`` widget in one cell's output area (``wait_for`` and ``settle`` as a single widget's)."""

    def __init__(self, notebook: Notebook, index: int) -> None:
        self.notebook = notebook
        self.page = notebook.page
        self.output = notebook.output(index)
        self.box = self.output.locator(".mlxgen-map").first

    def read(self) -> MapState | None:  # what wait_for and settle poll
        data = self.output.evaluate(_MAP_STATE_JS)
        if not data:
            return None
        data["rows"] = [Row(**row) for row in data["rows"]]
        return MapState(**data)

    def click_row_stop(self, row: int) -> None:
        self.box.locator(".mlxgen-map-row").nth(row).locator("button").click()


def test_stop_one_row_of_five(lab: Lab, screenshot_dir: Path) -> None:
    nb = lab.open(
        "map.ipynb",
        [
            "%load_ext mlx_notebook",
            "topics = ['a lighthouse', 'a dragon', 'the sea', 'a forest', 'a robot']",
            "%%mlxgen --map topics -n 40 -o stories\nWrite a long story about {item}.",
        ],
    )
    nb.run(0)
    nb.run(1)
    nb.run(2)  # a background cell: it ends at once while the inputs run
    widget = MapWidget(nb, 2)
    widget.box.wait_for(state="visible", timeout=60_000)
    running = widget.wait_for(
        lambda s: len(s.rows) == 5 and any(r.state == "decoding" and r.tokens >= 2 for r in s.rows),
        what="an input decoding",
    )
    assert not running.stop_all["disabled"] and not running.pause_all["disabled"], running
    assert running.pause_all["label"] == "Pause all"
    assert "progress-bar-info" in running.bar_class.split(), running
    nb.screenshot_output(2, screenshot_dir / "map-running.png")

    target = 2
    assert running.rows[target].state not in FINAL, running.rows[target]
    widget.click_row_stop(target)
    ended = widget.wait_for(
        lambda s: len(s.rows) == 5 and all(r.state in FINAL for r in s.rows), what="every input final"
    )
    ended = widget.settle()
    states = [r.state for r in ended.rows]
    assert states == ["done", "done", "stopped", "done", "done"], [r.line for r in ended.rows]
    assert ended.rows[target].tokens < 40
    assert all(0 < r.tokens <= 40 for i, r in enumerate(ended.rows) if i != target), [r.line for r in ended.rows]
    assert all(r.stop["disabled"] for r in ended.rows)
    assert ended.stop_all["disabled"] and ended.pause_all["disabled"]
    assert "progress-bar-warning" in ended.bar_class.split(), ended  # orange: one input was stopped
    assert ended.progress == "5/5 done"
    assert ended.summary.startswith("5 generations: 1 stopped, 4 done · "), ended.summary
    nb.screenshot_output(2, screenshot_dir / "map-one-stopped.png")
    assert not lab.page_errors, lab.page_errors
