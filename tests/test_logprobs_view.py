"""The log-prob table and hover titles (``--logprobs K``), on a tiny random-weight model.

The rendering functions get real :class:`TokenLogprobs` from a real generation
and the model's real tokenizer; the kernel tests run ``%%mlxgen --logprobs 3``
in a real ipykernel and read what a frontend and a saved notebook read: the
widget's comm state, the final display bundle (``text/markdown`` and
``text/plain``) and the ``--plain`` headless display.
"""

from __future__ import annotations

import html
import math
import re
import time
from typing import Any

import pytest

import mlx_notebook
from mlx_notebook.generation.handle import TokenLogprobs
from mlx_notebook.notebook.logprobs_view import (
    TAIL_ROWS,
    LogprobsTable,
    TokenNames,
    find_tokenizer,
    hover_html,
    percent,
    tail_html,
    token_label,
    tokenizer_decode,
)
from testkit.kernel_helpers import KernelSession, displays, one_line_usage_error, start_kernel, view

PROMPT = "Once upon a time the quick brown fox"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# One rendered <tr>: number, token id and label, log-prob, p, the alternatives cell.
_ROW = re.compile(
    r"<tr><td[^>]*>(\d+)</td><td[^>]*><code title=\"id (\d+)\">(.*?)</code></td>"
    r"<td[^>]*>(.*?)</td><td[^>]*>(.*?)</td><td[^>]*>(.*?)</td></tr>"
)
_ALT = re.compile(r"<code>(.*?)</code>&nbsp;([^,<]+)")


def html_rows(page: str) -> list[dict[str, Any]]:
    """The rows of every log-prob table in ``page``, as a reader sees them."""
    return [
        {
            "n": int(n),
            "id": int(tid),
            "label": html.unescape(label),
            "logprob": float(lp),
            "p": p,
            "top": [(html.unescape(a), ap) for a, ap in _ALT.findall(alts)],
        }
        for n, tid, label, lp, p, alts in _ROW.findall(page)
    ]


def expected_rows(entries: list[TokenLogprobs], decode) -> list[dict[str, Any]]:
    """What the table must show for ``entries``, computed here from the tokenizer."""
    return [
        {
            "n": i,
            "id": e.token,
            "label": token_label(decode(e.token)),
            "logprob": round(e.logprob, 3),
            "p": percent(e.logprob),
            "top": [(token_label(decode(t)), percent(lp)) for t, lp in e.top],
        }
        for i, e in enumerate(entries, 1)
    ]


def plain_rows(text: str) -> list[list[str]]:
    """The rows of a plain-text table: number, token, log-prob, p, alternatives."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[log-probs:"))
    return [re.split(r"\s{2,}", line.strip(), maxsplit=4) for line in lines[start + 2 :] if line.strip()]


# -- the rendering functions, on a real generation ---------------------------------------------


@pytest.mark.unit
def test_labels_and_percentages() -> None:
    assert token_label(" the\n") == "␣the↵"
    assert token_label("\t\x07") == "⇥\\x07"
    assert token_label("") == "∅"
    assert percent(math.log(0.884)) == "88.4%"
    assert percent(math.log(0.00012)) == "0.012%"
    assert percent(-math.inf) == "0%"


@pytest.fixture(scope="module")
def generated(worker, tiny_model):
    gen = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=24, logprobs=3)
    gen.result(timeout=120)
    _, tokenizer = mlx_notebook.load_model(tiny_model, worker=worker)
    return gen, tokenizer


def test_the_table_shows_each_token_its_logprob_and_the_alternatives(generated) -> None:
    gen, tokenizer = generated
    assert find_tokenizer(gen) is gen.tokenizer is tokenizer  # the model it ran on
    table = LogprobsTable(gen)
    assert table.update() == len(gen.tokens) == 24

    def decode(i: int) -> str:
        return tokenizer.decode([i])

    want = expected_rows(gen.logprobs, decode)
    final = table.html(final=True)
    assert final.startswith("<details") and "log-probs: 24 tokens, top 3" in final
    assert html_rows(final) == want
    assert "\n\n" not in final  # one raw HTML block in Markdown

    rows = plain_rows(table.text())
    assert [r[0] for r in rows] == [str(i) for i in range(1, 25)]
    for row, entry, w in zip(rows, gen.logprobs, want):
        assert row[1] == w["label"][:16] or row[1].endswith("…")
        assert float(row[2]) == round(entry.logprob, 3) and row[3] == w["p"]
        assert row[4] == " · ".join(f"{label} {p}" for label, p in w["top"])

    tail = html_rows(table.html(final=False))
    assert [r["n"] for r in tail] == list(range(24 - TAIL_ROWS + 1, 25))
    assert tail == want[-TAIL_ROWS:]
    last = table.text(last=5)
    assert "(last 5)" in last and [r[0] for r in plain_rows(last)] == ["20", "21", "22", "23", "24"]


def test_hover_titles_keep_the_text_and_name_the_alternatives(generated) -> None:
    gen, tokenizer = generated
    names = TokenNames(tokenizer_decode(tokenizer), tokenizer.decode)
    shown = hover_html(gen.text, gen.logprobs, names, names.joined)
    assert html.unescape(re.sub(r"<[^>]+>", "", shown)) == gen.text  # the text, exactly
    spans = re.findall(r'<span class="mlxgen-token" title="([^"]*)">(.*?)</span>', shown, re.S)
    assert spans
    for (title, piece), entry in zip(spans, gen.logprobs):
        title = html.unescape(title)
        assert html.unescape(piece) == tokenizer.decode([entry.token])
        assert title.splitlines()[0].startswith(token_label(tokenizer.decode([entry.token])))
        for tid, lp in entry.top:
            assert f"{token_label(tokenizer.decode([tid]))}  {percent(lp)}" in title


def test_a_character_split_over_tokens_gets_one_span(tiny_model, worker) -> None:
    _, tokenizer = mlx_notebook.load_model(tiny_model, worker=worker)
    text = "fox é!"
    ids = tokenizer.encode(text)
    assert "\ufffd" in "".join(tokenizer.decode([i]) for i in ids)  # é is two byte tokens
    entries = [TokenLogprobs(i, -0.5, [(i, -0.5), (7, -2.0)]) for i in ids]
    names = TokenNames(tokenizer_decode(tokenizer), tokenizer.decode)
    shown = hover_html(text, entries, names, names.joined)
    pieces = [html.unescape(p) for p in re.findall(r"<span[^>]*>(.*?)</span>", shown)]
    assert "".join(pieces) == text and "é" in pieces
    # Without a way to decode them together the spans end there; the text stays whole.
    plain = hover_html(text, entries, TokenNames(tokenizer_decode(tokenizer)))
    assert html.unescape(re.sub(r"<[^>]+>", "", plain)) == text


def test_rows_are_rendered_once_and_names_decoded_in_batches(worker, tiny_model) -> None:
    _, tokenizer = mlx_notebook.load_model(tiny_model, worker=worker)
    calls: list[list[int]] = []

    def decode(ids: list[int]) -> list[str]:
        calls.append(list(ids))
        return tokenizer_decode(tokenizer)(ids)

    gen = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=40, logprobs=2)
    table = LogprobsTable(gen, names=TokenNames(decode))
    seen: list[str] = []
    ticks = 0
    deadline = time.monotonic() + 120
    while not gen.finished:
        assert time.monotonic() < deadline, f"generation #{gen.id} still {gen.state} after 120 s"
        table.update()
        ticks += 1
        assert table.rows[: len(seen)] == seen  # earlier rows are never redrawn
        seen = list(table.rows)
        assert len(html_rows(tail_html(table.rows, k=2))) <= TAIL_ROWS
    table.update()
    fresh = LogprobsTable(gen, names=TokenNames(tokenizer_decode(tokenizer)))
    fresh.update()
    assert table.rows == fresh.rows and len(table.rows) == len(gen.tokens)  # streamed = rendered at once
    decoded = [i for call in calls for i in call]
    assert len(decoded) == len(set(decoded))  # each id decoded once
    assert len(calls) <= ticks + 1  # at most one tokenizer call per update


def test_without_a_tokenizer_ids_are_shown(generated) -> None:
    gen, _ = generated
    table = LogprobsTable(gen, names=TokenNames(None))
    assert [r["label"] for r in html_rows(table.html(final=True))] == [f"#{e.token}" for e in gen.logprobs]


# -- in a kernel -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel(tiny_model: str):
    with start_kernel(tiny_model) as session:
        yield session


def kernel_expected(kernel: KernelSession, name: str) -> list[dict[str, Any]]:
    """The rows the table of handle ``name`` must show, from its ``logprobs`` and tokenizer in the kernel."""
    entries = kernel.eval(f"[(e.token, e.logprob, e.top) for e in {name}.logprobs]")
    assert entries and len(entries) == len(kernel.eval(f"{name}.tokens"))
    ids = sorted({i for tok, _, top in entries for i in (tok, *(t for t, _ in top))})
    texts = kernel.eval(
        f"dict(zip({ids}, (lambda tok: [tok.decode([i]) for i in {ids}])(mlx_notebook.load_model({name}.request.model)[1])))"
    )
    return expected_rows([TokenLogprobs(tok, lp, [tuple(t) for t in top]) for tok, lp, top in entries], texts.get)


def logprob_widgets(kernel: KernelSession, cell: str) -> list[str]:
    return [
        s["value"]
        for s in kernel.widgets(cell).values()
        if s.get("_model_name") == "HTMLModel" and "log-probs" in str(s.get("value", ""))
    ]


def test_kernel_widget_shows_the_table_and_saves_it_as_markdown(kernel: KernelSession, tiny_model: str) -> None:
    assert kernel.execute("import mlx_notebook").ok
    reply = kernel.execute(f"%%mlxgen -m {tiny_model} -n 5 --logprobs 3 --wait -o lp\n{PROMPT}", timeout=300)
    assert reply.ok, reply.content
    want = kernel_expected(kernel, "lp")
    assert len(want) == 5
    shown = displays(kernel, reply.msg_id)
    assert WIDGET_MIME in shown[0]["data"]
    # The live widget: an HTML widget holding the whole table once it ended.
    (live,) = logprob_widgets(kernel, reply.msg_id)
    assert html_rows(live) == want and live.startswith("<details")
    (status,) = [
        html.unescape(re.sub(r"<[^>]+>", "", s["value"]))
        for s in kernel.widgets(reply.msg_id).values()
        if "mlxgen-status" in str(s.get("value", ""))
    ]
    assert status.startswith(f"#{kernel.eval('lp.id')} done · 5 tokens")
    # The saved output: Markdown (the answer, the status, the table) and text/plain.
    final = shown[-1]["data"]
    assert set(final) == {"text/markdown", "text/plain"}
    markdown = final["text/markdown"]
    assert markdown.index("<sub") < markdown.index("<details") and html_rows(markdown) == want
    assert "\n\n" not in markdown[markdown.index("<details") :].strip()  # one raw HTML block
    rows = plain_rows(final["text/plain"])
    assert [(r[0], r[3], r[4]) for r in rows] == [
        (str(w["n"]), w["p"], " · ".join(f"{label} {p}" for label, p in w["top"])) for w in want
    ]
    assert [float(r[2]) for r in rows] == [w["logprob"] for w in want]


def test_kernel_text_format_has_hover_titles_on_the_tokens(kernel: KernelSession) -> None:
    reply = kernel.execute(f"%%mlxgen -n 5 --logprobs 2 --wait --format text -o lt\n{PROMPT}", timeout=300)
    assert reply.ok, reply.content
    want = kernel_expected(kernel, "lt")
    text = kernel.eval("lt.text")
    (_, pre_state) = next(
        (cid, s)
        for cid, s in kernel.widgets(reply.msg_id).items()
        if s.get("_model_name") == "HTMLModel" and str(s.get("value", "")).startswith("<pre")
    )
    pre = re.match(r"<pre[^>]*>(.*?)</pre>", pre_state["value"], re.S)
    assert pre is not None
    assert html.unescape(re.sub(r"<[^>]+>", "", pre.group(1))) == text
    titles = [html.unescape(t) for t in re.findall(r'title="([^"]*)"', pre.group(1))]
    # One block per token (a character split over tokens: one span, their blocks together).
    blocks = [block for t in titles for block in t.split("\n\n")]
    assert blocks and all(b.startswith(f"{w['label']}  log-prob {w['logprob']:.3f}") for b, w in zip(blocks, want))
    (live,) = logprob_widgets(kernel, reply.msg_id)
    assert html_rows(live) == want
    # The widget stays (text format); its text/plain fallback carries the table.
    final = displays(kernel, reply.msg_id)[-1]["data"]
    assert WIDGET_MIME in final and len(plain_rows(final["text/plain"])) == 5


def test_kernel_headless_plain_gets_a_text_table_at_the_end(kernel: KernelSession) -> None:
    reply = kernel.execute(f"%%mlxgen -n 5 --logprobs 3 --wait --plain -o lh\n{PROMPT}", timeout=300)
    assert reply.ok, reply.content
    want = kernel_expected(kernel, "lh")
    shown = displays(kernel, reply.msg_id)
    assert set(shown[0]["data"]) == {"text/plain"}
    final = shown[-1]["data"]
    assert final["text/plain"].startswith(kernel.eval("lh.text"))
    assert [r[0] for r in plain_rows(final["text/plain"])] == [str(w["n"]) for w in want]
    assert html_rows(final["text/markdown"]) == want


def test_kernel_without_logprobs_shows_nothing_more(kernel: KernelSession) -> None:
    for flags in ("", "--format text", "--plain"):
        reply = kernel.execute(f"%%mlxgen -n 5 --wait {flags} -o nl\n{PROMPT}", timeout=300)
        assert reply.ok, reply.content
        assert kernel.eval("nl.logprobs") == []
        for bundle in displays(kernel, reply.msg_id):
            for value in bundle["data"].values():
                assert "log-probs" not in str(value) and "mlxgen-logprobs" not in str(value)
        assert not logprob_widgets(kernel, reply.msg_id)
        if flags != "--plain":
            assert "mlxgen-token" not in str(view(kernel, reply.msg_id))


def test_kernel_negative_logprobs_is_one_line(kernel: KernelSession) -> None:
    err = one_line_usage_error(kernel.execute(f"%%mlxgen --logprobs -1\n{PROMPT}"))
    assert "logprobs must be >= 0" in err
    assert kernel.execute("print(1)").ok
