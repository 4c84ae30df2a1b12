"""Structured output in a real ipykernel: ``--schema``, ``--choices``, ``--map`` over a DataFrame.

The tiny random-weight model answers; the mask makes every answer valid, so
each assertion is on values that parse and on what the views show.
"""

from __future__ import annotations

import html
import re

import pytest

from testkit.kernel_helpers import KernelSession, displays, one_line_usage_error, start_kernel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SETUP = [
    "import pandas as pd\n"
    "from typing import Literal\n"
    "from pydantic import BaseModel, Field\n"
    "class Place(BaseModel):\n"
    "    city: Literal['Paris', 'Lisbon', 'Rome']\n"
    "    year: int = Field(ge=1000, le=2100)\n"
    "df = pd.DataFrame({'text': ['The fire of 1755', 'A summer in Rome', 'Paris, again'], 'n': [1, 2, 3]})\n"
    "moods = pd.DataFrame({'review': [f'review number {i}' for i in range(50)]})\n"
    "tags = {'type': 'array', 'items': {'type': 'string', 'maxLength': 8}, 'minItems': 20, 'maxItems': 20}"
]
BODY = "Where and when? {item.text} (row {item[n]})"
CHOICES = ("positive", "negative", "mixed")


@pytest.fixture(scope="module")
def kernel(tiny_model: str):
    with start_kernel(tiny_model, setup=SETUP) as session:
        yield session


def table_of(kernel: KernelSession, cell: str) -> list[list[str]]:
    """The parsed table the map widget of cell ``cell`` shows: header, then one row per input."""
    for state in kernel.widgets(cell).values():
        value = state.get("value", "")
        if state.get("_model_name") == "HTMLModel" and "mlxgen-parsed" in value:
            return [
                [html.unescape(c) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
                for row in re.findall(r"<tr>(.*?)</tr>", value)
            ]
    return []


def test_schema_map_over_a_dataframe_fills_the_table(kernel: KernelSession) -> None:
    reply = kernel.execute(f"%%mlxgen --map df --schema Place -n 80 -t 0.8 --seed 1 -o out\n{BODY}")
    assert reply.ok, reply.content
    # The DataFrame's rows are the inputs, read as {item.column} and {item[column]}.
    prompts = kernel.eval("[g.request.prompt for g in out]")
    assert prompts == [
        "Where and when? The fire of 1755 (row 1)",
        "Where and when? A summer in Rome (row 2)",
        "Where and when? Paris, again (row 3)",
    ]
    rows = kernel.wait_until(
        lambda: (lambda t: t if len(t) == 4 and all(r[3] == "done" for r in t[1:]) else None)(
            table_of(kernel, reply.msg_id)
        ),
        180,
        "the parsed table with every row done",
    )
    assert rows[0] == ["#", "city", "year", "state", "error"]
    values = kernel.eval("[(p.city, p.year) for p in out.parsed]")
    assert [(r[1], int(r[2])) for r in rows[1:]] == [tuple(v) for v in values]
    assert all(city in ("Paris", "Lisbon", "Rome") and 1000 <= year <= 2100 for city, year in values)
    frame = kernel.eval("(list(out.to_pandas().columns), out.to_pandas()['state'].tolist())")
    assert list(frame) == [["city", "year", "state", "error"], ["done"] * 3]


def test_choices_over_a_dataframe_headless_prints_the_table(kernel: KernelSession) -> None:
    """50 rows of a DataFrame in one cell: every answer one of the choices, the table printed, the frame right."""
    reply = kernel.execute(
        f"%%mlxgen --map moods --choices {','.join(CHOICES)} -n 20 -t 0.9 --seed 2 --plain --wait -o m\n"
        "Is this positive, negative or mixed? {item.review}"
    )
    assert reply.ok, reply.content
    assert kernel.eval("all(v in " + repr(CHOICES) + " for v in m.parsed)") is True
    assert kernel.eval("m.to_pandas()['value'].tolist() == m.parsed") is True
    text = displays(kernel, reply.msg_id)[-1]["data"]["text/plain"]
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["#", "value", "state", "error"])
    parsed = kernel.eval("m.parsed")
    assert len(parsed) == 50
    for i, value in enumerate(parsed):
        assert lines[header + 1 + i].split()[:2] == [str(i), value]


def test_one_generation_with_schema_and_bad_flags(kernel: KernelSession) -> None:
    reply = kernel.execute("%%mlxgen --schema Place -n 80 --wait -o g\nWhere?")
    assert reply.ok, reply.content
    assert kernel.eval("(type(g.parsed).__name__, str(g.stats.finish_reason))") == ("Place", "grammar")
    reply = kernel.execute("%%mlxgen --regex '[A-Z]{{3}}' -n 10 --wait -o r\nCode?")
    assert reply.ok, reply.content
    assert kernel.eval("r.parsed.isupper() and len(r.parsed) == 3") is True
    for line, expected in [
        ("--schema Nope", "no variable 'Nope'"),
        ("--choices ''", "choices must be non-empty strings"),
        ("--regex '(a'", "invalid regex"),
        ("--schema Place --choices a,b", "give one of schema=, choices=, regex="),
    ]:
        message = one_line_usage_error(kernel.execute(f"%%mlxgen {line}\nHi"))
        assert expected in message, (line, message)


def test_pause_mid_object_resumes_exactly_and_a_stop_keeps_the_text(kernel: KernelSession) -> None:
    """In the kernel: Pause inside a schema's value holds (another cell runs meanwhile), Resume gives the
    uninterrupted run's tokens; Stop inside the value keeps the text and names the cause on ``parsed``."""
    cell = "%%mlxgen --schema tags -n 400 {}-o {}\nList twenty words."
    reply = kernel.execute(cell.format("--wait ", "whole"))
    assert reply.ok, reply.content
    reference = kernel.eval("whole.tokens")
    assert kernel.eval("str(whole.stats.finish_reason)") == "grammar" and len(reference) > 40

    for name in ("part", "cut"):
        assert kernel.execute(cell.format("", name)).ok
        kernel.wait_until(lambda name=name: kernel.eval(f"len({name}.tokens)") >= 2, 120, "two tokens")
        assert kernel.execute(f"{name}.pause()").ok
        kernel.wait_until(lambda name=name: kernel.eval(f"{name}.state") == "paused", 60, "paused")
        held = kernel.eval(f"{name}.tokens")
        assert 0 < len(held) < len(reference), "the pause did not land inside the value"
        assert held == reference[: len(held)]
        # Another generation runs to its end on the same worker while this one is parked.
        assert kernel.execute("%%mlxgen -n 8 --wait -o other\nHello").ok
        assert kernel.eval(f"({name}.state, {name}.tokens)") == ("paused", held)

    assert kernel.execute("part.resume(); part.result(timeout=120)").ok
    assert kernel.eval("part.tokens") == reference

    assert kernel.execute("cut.stop(); cut.wait(60)").ok
    assert kernel.eval("cut.state") == "stopped"
    assert kernel.eval("cut.text") != ""
    reply = kernel.execute("cut.parsed")
    assert not reply.ok
    assert "stopped" in reply.content.get("evalue", ""), reply.content
