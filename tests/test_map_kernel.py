"""``%%mlxgen --map`` in a real ipykernel, driven the way a frontend drives it.

A ``python3`` kernel started by jupyter_client runs the cells on the tiny
random-weight model (greedy, deterministic on the CPU); the map widget's
buttons are clicked with the comm messages ipywidgets' frontend sends;
interrupts come from ``KernelManager.interrupt_kernel()``; the headless case
runs a notebook through nbclient.

Nothing here depends on how the worker schedules the inputs (one after
another, or decoded together): every assertion is on states and tokens.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest

from testkit.kernel_helpers import KernelSession, run_meanwhile, start_kernel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROWS = "rows = [{'name': 'Peru'}, {'name': 'Chile'}, {'name': 'Spain'}]"
BODY = "Tell me about {item[name]}."
PROMPTS = ["Tell me about Peru.", "Tell me about Chile.", "Tell me about Spain."]
SHORT = 12  # tokens of the quick runs
# Long enough that a click lands while the inputs still run (the tiny model
# makes ~400 tokens a second here), and no prompt above meets EOS before it.
LONG = 400
FINAL = ("stopped", "done", "failed")


@pytest.fixture(scope="module")
def kernel(tiny_model: str):
    with start_kernel(tiny_model, setup=[ROWS]) as session:
        yield session


@pytest.fixture(scope="module")
def solo(kernel: KernelSession, tiny_model: str) -> list[list[int]]:
    """Each prompt's greedy tokens, from a run of its own (one at a time: nothing to batch with)."""
    run_alone = (
        "import mlx_notebook\n"
        "solo = []\n"
        f"for p in {PROMPTS!r}:\n"
        f"    solo.append(mlx_notebook.generate(p, model={tiny_model!r}, max_tokens={LONG}))\n"
        "    solo[-1].result(300)"
    )
    reply = kernel.execute(run_alone, timeout=600)
    assert reply.ok, reply.content
    tokens = kernel.eval("[g.tokens for g in solo]")
    # The stop tests need inputs that run to LONG tokens when nothing stops them.
    assert [len(t) for t in tokens] == [LONG] * len(PROMPTS), "a prompt meets EOS early: pick other rows"
    return tokens


# -- the map widget as a frontend sees it -------------------------------------------------------


def _plain(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", value))


def map_view(kernel: KernelSession, cell: str) -> dict[str, Any]:
    """The map widget of cell ``cell``: its header and one entry per row, in input order."""
    found: dict[str, Any] = {"rows": {}}
    for comm_id, state in kernel.widgets(cell).items():
        model, tooltip = state.get("_model_name"), state.get("tooltip") or ""
        if model == "ButtonModel" and tooltip.startswith("Stop input "):
            found["rows"].setdefault(int(tooltip.rsplit(" ", 1)[1]), {})["stop"] = (comm_id, state)
        elif model == "ButtonModel" and tooltip.startswith("Stop every"):
            found["stop_all"] = (comm_id, state)
        elif model == "ButtonModel" and tooltip.startswith("Pause every"):
            found["pause_all"] = (comm_id, state)
        elif model == "FloatProgressModel":
            found["progress"] = state
        elif model == "HTMLModel":
            text = _plain(state.get("value", ""))
            row = re.match(r"\[(\d+)\] #(\d+) (\w+) · (\d+) tokens", text)
            if row:
                found["rows"].setdefault(int(row.group(1)), {}).update(
                    id=int(row.group(2)), state=row.group(3), tokens=int(row.group(4)), line=text
                )
            elif re.match(r"\d+ generations?: ", text):
                found["summary"] = text
    found["rows"] = [found["rows"][i] for i in sorted(found["rows"])]
    return found


def row_states(kernel: KernelSession, cell: str) -> list[str]:
    return [row.get("state", "") for row in map_view(kernel, cell)["rows"]]


def wait_rows(kernel: KernelSession, cell: str, predicate: Any, what: str, timeout: float = 120) -> list[dict]:
    """The rows once ``predicate(rows)`` holds."""

    def rows_if() -> list[dict] | None:
        rows = map_view(kernel, cell)["rows"]
        return rows if predicate(rows) else None

    return kernel.wait_until(rows_if, timeout, what)


def all_final(rows: list[dict]) -> bool:
    return bool(rows) and all(row.get("state") in FINAL for row in rows)


def first_decoding(rows: list[dict]) -> bool:
    return bool(rows) and rows[0].get("state") == "decoding" and rows[0].get("tokens", 0) >= 2


# -- the tests ----------------------------------------------------------------------------------


def test_map_over_dicts_gives_the_solo_texts(kernel: KernelSession, solo: list[list[int]]) -> None:
    reply = kernel.execute(f"%%mlxgen --map rows -n {LONG} -o b\n{BODY}")
    assert reply.ok, reply.content
    shown = [m for m in reply.outputs if m["msg_type"] == "display_data"]
    assert len(shown) == 1  # one widget for the whole map
    assert "application/vnd.jupyter.widget-view+json" in shown[0]["content"]["data"]
    rows = wait_rows(kernel, reply.msg_id, all_final, "every row final")
    assert [r["state"] for r in rows] == ["done"] * 3

    # -o binds the Batch; its members have the filled prompts and the solo runs' tokens.
    assert kernel.eval("(type(b).__name__, len(b), [g.request.prompt for g in b])") == ("Batch", 3, PROMPTS)
    assert kernel.eval("[g.tokens for g in b]") == solo
    assert kernel.eval("b.results(0) == [g.text for g in solo]") is True
    ids = kernel.eval("[g.id for g in b]")
    assert [r["id"] for r in rows] == ids and [r["tokens"] for r in rows] == [LONG] * 3

    shown = map_view(kernel, reply.msg_id)
    assert shown["summary"] == f"3 generations: 3 done · {3 * LONG} tokens"
    assert shown["progress"]["value"] == 1.0 and shown["progress"]["bar_style"] == "success"
    assert all(row["stop"][1]["disabled"] for row in shown["rows"])
    assert shown["stop_all"][1]["disabled"] and shown["pause_all"][1]["disabled"]


def test_stop_one_row_leaves_the_others_finishing(kernel: KernelSession, solo: list[list[int]]) -> None:
    reply = kernel.execute(f"%%mlxgen --map rows -n {LONG} -o one\n{BODY}")
    assert reply.ok, reply.content
    wait_rows(kernel, reply.msg_id, first_decoding, "row 0 decoding")
    kernel.click(map_view(kernel, reply.msg_id)["rows"][1]["stop"][0])
    rows = wait_rows(kernel, reply.msg_id, all_final, "every row final")
    assert [r["state"] for r in rows] == ["done", "stopped", "done"], rows
    assert kernel.eval(f"one[1].state, len(one[1].tokens) < {LONG}") == ("stopped", True)
    # The others ran to the end with exactly their solo tokens.
    assert kernel.eval("[one[0].tokens, one[2].tokens]") == [solo[0], solo[2]]
    shown = map_view(kernel, reply.msg_id)
    assert shown["progress"]["bar_style"] == "warning"
    assert shown["summary"].startswith("3 generations: 1 stopped, 2 done · ")


def test_stop_all(kernel: KernelSession) -> None:
    reply = kernel.execute(f"%%mlxgen --map rows -n {LONG} -o every\n{BODY}")
    wait_rows(kernel, reply.msg_id, first_decoding, "row 0 decoding")
    kernel.click(map_view(kernel, reply.msg_id)["stop_all"][0])
    rows = wait_rows(kernel, reply.msg_id, all_final, "every row final", timeout=30)
    assert [r["state"] for r in rows] == ["stopped"] * 3, rows
    assert all(r["tokens"] < LONG for r in rows)
    assert kernel.eval("every.states") == ["stopped"] * 3


def test_pause_all_then_resume_all_gives_the_solo_tokens(
    kernel: KernelSession, solo: list[list[int]], tiny_model: str
) -> None:
    reply = kernel.execute(f"%%mlxgen --map rows -n {LONG} -o pz\n{BODY}")
    wait_rows(kernel, reply.msg_id, first_decoding, "row 0 decoding")
    pause_id = map_view(kernel, reply.msg_id)["pause_all"][0]
    kernel.click(pause_id)
    # Each input pauses at its own next checkpoint; a queued one stays queued, paused in advance.
    kernel.wait_until(
        lambda: (
            map_view(kernel, reply.msg_id)["pause_all"][1]["description"] == "Resume all"
            and "paused" in row_states(kernel, reply.msg_id)
            and set(row_states(kernel, reply.msg_id)) <= {"paused", "queued", *FINAL}
        ),
        30,
        "Resume all and no input running",
    )
    paused = kernel.eval("([len(g.tokens) for g in pz], pz.states)")
    assert all(n < LONG for n in paused[0]), paused
    # Nothing moves while another generation runs to its end on the same worker.
    run_meanwhile(kernel, tiny_model)
    assert kernel.eval("([len(g.tokens) for g in pz], pz.states)") == paused
    kernel.click(pause_id)  # now labelled Resume all
    rows = wait_rows(kernel, reply.msg_id, all_final, "every row final")
    assert [r["state"] for r in rows] == ["done"] * 3, rows
    assert kernel.eval("[g.tokens for g in pz]") == solo  # exact resume, for every input


def test_interrupt_during_wait_stops_every_input(kernel: KernelSession) -> None:
    cell = kernel.start(f"%%mlxgen --map rows -n {LONG} --wait -o cut\n{BODY}")
    wait_rows(kernel, cell, first_decoding, "row 0 decoding")
    kernel.km.interrupt_kernel()
    reply = kernel.reply_to(cell)
    assert reply.content["status"] == "error" and reply.content["ename"] == "KeyboardInterrupt", reply.content
    assert "mlxgen map stopped: 3 generations: 3 stopped" in reply.content["evalue"]
    # Drained before the interrupt was raised: every input already final.
    assert kernel.eval("cut.states") == ["stopped"] * 3
    assert kernel.execute("assert 1 + 1 == 2").ok


def test_interrupt_while_idle_stops_a_background_map(kernel: KernelSession) -> None:
    reply = kernel.execute(f"%%mlxgen --map rows -n {LONG} -o bg\n{BODY}")
    wait_rows(kernel, reply.msg_id, first_decoding, "row 0 decoding")
    kernel.km.interrupt_kernel()
    rows = wait_rows(kernel, reply.msg_id, all_final, "every row final", timeout=30)
    assert [r["state"] for r in rows] == ["stopped"] * 3, rows


def test_map_with_wait_plain_and_no_widget(kernel: KernelSession, solo: list[list[int]]) -> None:
    reply = kernel.execute(f"%%mlxgen --map rows -n {SHORT} --wait --plain -o pl\n{BODY}", timeout=300)
    assert reply.ok, reply.content
    assert not kernel.widgets(reply.msg_id)
    plain = [m["content"] for m in reply.outputs if m["msg_type"] in ("display_data", "update_display_data")][-1]
    text = plain["data"]["text/plain"]
    assert text.startswith(f"[mlxgen map: 3 generations: 3 done · {3 * SHORT} tokens]")
    texts = kernel.eval("pl.texts")
    entries = plain["metadata"]["mlx_notebook_map"]
    assert [text[e["start"] : e["end"]] for e in entries] == texts
    assert kernel.eval("[g.tokens for g in pl]") == [t[:SHORT] for t in solo]


@pytest.mark.kernel
def test_headless_notebook_stores_every_result(tiny_model: str, tmp_path: Path) -> None:
    """nbclient renders no widgets: the map's output holds each input's text and state."""
    import nbformat

    from scripts import run_quickstart

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(code)
        for code in (
            "%load_ext mlx_notebook",
            ROWS,
            f"%%mlxgen --map rows -n {SHORT} -o b\n{BODY}",
            "b.wait(120); print(repr(b.texts))",
        )
    ]
    path = tmp_path / "map.ipynb"
    nbformat.write(nb, str(path))
    ran = run_quickstart.run(path, model=tiny_model, timeout=300)
    outputs = [o for o in ran.cells[2].outputs if o.get("metadata", {}).get("mlx_notebook_map")]
    assert outputs, ran.cells[2].outputs
    final = outputs[-1]
    text, entries = final["data"]["text/plain"], final["metadata"]["mlx_notebook_map"]
    assert [e["state"] for e in entries] == ["done"] * 3, text
    printed = "".join(o.get("text", "") for o in ran.cells[3].outputs)
    assert repr([text[e["start"] : e["end"]] for e in entries]) == printed.strip()
