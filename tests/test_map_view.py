"""The ``--map`` views outside a kernel: the terminal view and the ``text/plain`` form headless clients store."""

from __future__ import annotations

from typing import Any

import mlx_notebook
from mlx_notebook.notebook.map_widget import make_map_view, map_plain_text, outcome, preview, row_line

PROMPTS = ["Tell me about Lima.", "Tell me about Oslo."]


def test_waiting_terminal_view_prints_each_result(worker, tiny_model: str, capsys: Any) -> None:
    batch = mlx_notebook.generate_many(PROMPTS, model=tiny_model, worker=worker, max_tokens=4)
    make_map_view(batch, shell=None, waiting=True).show()  # no shell: the terminal view
    assert batch.wait(timeout=60)
    out = capsys.readouterr().out
    for index, gen in enumerate(batch):
        assert f"[{index}] #{gen.id} done · 4 tokens" in out and gen.text in out
    assert out.rstrip().endswith("[mlxgen map: 2 generations: 2 done · 8 tokens]")


def test_background_terminal_view_says_where_it_runs(worker, tiny_model: str, capsys: Any) -> None:
    batch = mlx_notebook.generate_many(PROMPTS, model=tiny_model, worker=worker, max_tokens=2)
    make_map_view(batch, shell=None).show()
    assert batch.wait(timeout=60)
    assert capsys.readouterr().out.startswith("mlxgen map of 2 inputs runs in the background")


def test_plain_text_holds_every_finished_text(worker, tiny_model: str) -> None:
    # Long enough that the cancel lands before the second input could end on its own.
    batch = mlx_notebook.generate_many(PROMPTS, model=tiny_model, worker=worker, max_tokens=400)
    batch[1].cancel()
    assert batch.wait(timeout=60)
    text, entries = map_plain_text(batch)
    assert text.startswith(f"[mlxgen map: {batch.summary()}]")
    assert [text[e["start"] : e["end"]] for e in entries] == batch.texts
    assert [e["state"] for e in entries] == batch.states and [e["id"] for e in entries] == [g.id for g in batch]
    assert outcome(batch) == "stopped"
    tokens = batch[0].stats.generated_tokens
    assert row_line(0, batch[0]).startswith(f"[0] #{batch[0].id} done · {tokens} tokens · ")


def test_preview_is_one_short_line() -> None:
    assert preview("a\n b\tc") == "a b c"
    assert preview("x" * 100, 10) == "x" * 9 + "…"
