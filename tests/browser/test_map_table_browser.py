"""The parsed table of ``%%mlxgen --map df --choices ...`` filling in, in JupyterLab with Chromium.

A DataFrame of six reviews, each classified as one of three choices, at most
two inputs at a time (``--max-batch 2``), so the rows finish a few at a time.
Every assertion is on what the page shows: the widget's ``mlxgen-parsed``
table (its header, then one row per input: index, value, state, error) from
the moment it appears to the end, and the DataFrame ``out.to_pandas()``
renders in the next cell. The default model (SmolLM2-135M), greedy.

A MutationObserver on the map's cell keeps every distinct table the page
shows (each comm update is one DOM change), so "some rows filled while
others still run" is read from the page itself, not from a lucky poll.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from .lab_driver import GENERATION_S, Lab

pytestmark = pytest.mark.browser

CHOICES = ("positive", "negative", "neutral")
HEADER = ["#", "value", "state", "error"]
REVIEWS = [
    "Loved it, the best pizza in town.",
    "Cold food and a rude waiter.",
    "It was fine, nothing special.",
    "Great service, will come back!",
    "Terrible, I want my money back.",
    "The soup was okay.",
]

# The map widget's parsed table: header cells, then each body row's cells (null: no table yet).
_READ_TABLE_JS = """
(root) => {
  const table = root.querySelector('table.mlxgen-parsed');
  if (!table) return null;
  return {
    head: [...table.querySelectorAll('thead th')].map((th) => th.textContent.trim()),
    rows: [...table.querySelectorAll('tbody tr')].map((tr) => [...tr.querySelectorAll('td')].map((td) => td.textContent.trim())),
  };
}
"""

# Records every distinct table the cell shows, from before it runs to the end.
_OBSERVE_JS = (
    """
(cell) => {
  const read = """
    + _READ_TABLE_JS
    + """;
  const log = [];
  let last = '';
  const note = () => {
    const table = read(cell);
    if (!table) return;
    const key = JSON.stringify(table);
    if (key !== last) { last = key; log.push(table); }
  };
  new MutationObserver(note).observe(cell, {childList: true, subtree: true, characterData: true});
  window.__mapTableLog = log;
}
"""
)

# The DataFrame's HTML rendering: each body row's index (its <th>) and cells.
_READ_FRAME_JS = """
(out) => {
  const table = out.querySelector('.jp-RenderedHTMLCommon table');
  if (!table) return null;
  return {
    head: [...table.querySelectorAll('thead th')].map((th) => th.textContent.trim()),
    rows: [...table.querySelectorAll('tbody tr')].map((tr) => [...tr.querySelectorAll('th, td')].map((c) => c.textContent.trim())),
  };
}
"""


def filled(table: dict[str, Any]) -> int:
    """How many rows of the widget's table hold a chosen value."""
    return sum(row[1] in CHOICES for row in table["rows"])


def all_done(table: dict[str, Any] | None) -> bool:
    return (
        table is not None
        and len(table["rows"]) == len(REVIEWS)
        and all(row[1] in CHOICES and row[2] == "done" for row in table["rows"])
    )


def test_choices_map_over_a_dataframe_fills_the_table_row_by_row(lab: Lab, screenshot_dir: Path) -> None:
    nb = lab.open(
        "map_table.ipynb",
        [
            "%load_ext mlx_notebook",
            f"import pandas as pd\nreviews = pd.DataFrame({{'text': {REVIEWS!r}}})",
            f"%%mlxgen --map reviews --choices {','.join(CHOICES)} --max-batch 2 -o out\n"
            "Is this review positive, negative or neutral? {item.text}",
            "out.to_pandas()",
        ],
    )
    nb.run(0)
    nb.run(1)
    nb.cell(2).evaluate(_OBSERVE_JS)  # before the run: the table's first moment is recorded too
    nb.run(2)  # a background cell: it ends at once while the inputs run
    output = nb.output(2)

    # The table appears with its header, one row per input.
    deadline = time.monotonic() + 60
    while (first := output.evaluate(_READ_TABLE_JS)) is None:
        assert time.monotonic() < deadline, f"no parsed table in the map widget after 60 s: {nb.output_text(2)!r}"
        lab.page.wait_for_timeout(50)
    assert first["head"] == HEADER, first
    assert len(first["rows"]) == len(REVIEWS), first

    # Then every row holds one of the choices and says done (polled, with a deadline).
    polled_partial = []
    deadline = time.monotonic() + GENERATION_S
    while not all_done(table := output.evaluate(_READ_TABLE_JS)):
        if table is not None and 0 < filled(table) < len(REVIEWS):
            polled_partial.append(filled(table))
        assert time.monotonic() < deadline, f"the table is not complete after {GENERATION_S} s: {table}"
        lab.page.wait_for_timeout(50)
    final = table
    assert final["head"] == HEADER, final
    assert [row[0] for row in final["rows"]] == [str(i) for i in range(len(REVIEWS))], final
    assert all(row[3] == "" for row in final["rows"]), final  # no error

    # What the page went through: no row filled at first, some but not all while the
    # map ran, then all; a filled row stays filled (the count never goes down).
    log = lab.page.evaluate("window.__mapTableLog")
    counts = [filled(t) for t in log]
    assert counts and counts[0] == 0, f"the table's first form already had values: {log[:1]}"
    partial = [t for t in log if 0 < filled(t) < len(REVIEWS)]
    assert partial, f"the table never showed some rows filled and others not: {counts} (polled {polled_partial})"
    for table in partial:
        for row in table["rows"]:
            if row[1] in CHOICES:
                assert row[2] == "done", table
            else:
                assert row[1] == "" and row[2] != "done", table  # a running row: no value yet
    assert counts == sorted(counts), f"a row's value went away: {counts}"
    assert all_done(log[-1]), json.dumps(log[-1])
    nb.screenshot_output(2, screenshot_dir / "map-parsed-table.png")

    # The next cell's DataFrame lists every row with the value the widget showed.
    nb.run(3)
    deadline = time.monotonic() + 60
    while (frame := nb.output(3).evaluate(_READ_FRAME_JS)) is None:
        assert time.monotonic() < deadline, f"no DataFrame rendered after 60 s: {nb.output_text(3)!r}"
        lab.page.wait_for_timeout(50)
    assert frame["head"][1:] == ["value", "state", "error"], frame
    assert [row[0] for row in frame["rows"]] == [str(i) for i in range(len(REVIEWS))], frame
    assert [row[1] for row in frame["rows"]] == [row[1] for row in final["rows"]], (frame, final)
    assert all(row[1] in CHOICES and row[2] == "done" for row in frame["rows"]), frame
    assert not lab.page_errors, lab.page_errors
