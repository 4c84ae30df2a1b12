"""Per-token log-probabilities of a generation (``--logprobs K``): a table and hover titles.

A generation asked for ``logprobs=K`` keeps, per generated token, its
log-probability and the K most likely tokens at that step
(:class:`~mlx_notebook.generation.handle.TokenLogprobs`). This module turns
them into what a person studying a model reads:

* a table (token, log-prob, probability, the top K with their probabilities),
  as HTML for the widget and the final Markdown output, and as plain text for
  headless runs and the ``text/plain`` fallback;
* hover titles on the tokens of the plain-text answer (``--format text``):
  each token of the answer is a ``<span title=...>`` naming its alternatives.

The cost stays linear in the answer. Each row is rendered once, when its token
first shows up, and kept; while tokens stream the widget shows only the last
:data:`TAIL_ROWS` rows (at the view's throttle ticks), and the whole table
once, at the end, folded in a ``<details>`` when it is long. Token texts are
decoded in one tokenizer call per tick for the ids not seen before (a real-size
tokenizer runs in a child process, one pipe round trip per call).

Example::

    table = LogprobsTable(gen)
    table.update()
    print(table.text())
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from typing import Any

from ..generation.handle import Generation, TokenLogprobs

# Rows the widget shows while tokens stream (the full table comes at the end).
TAIL_ROWS = 16
# A final table with up to this many rows starts unfolded.
OPEN_ROWS = 32
# Widest token label in the plain-text table (longer ones end with "…").
TEXT_LABEL_WIDTH = 16

_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
_TABLE_STYLE = "border-collapse: collapse; font-size: 0.85em; margin: 0.25em 0"
_CELL_STYLE = "padding: 0 0.6em; text-align: left; vertical-align: top"
_NUM_STYLE = "padding: 0 0.6em; text-align: right; vertical-align: top; font-variant-numeric: tabular-nums"

Decode = Callable[[list[int]], list[str]]


# -- formatting (pure) --------------------------------------------------------------------------


def token_label(text: str) -> str:
    """A token's text with its whitespace made visible (``" the\\n"`` -> ``"␣the↵"``).

    Other control characters become ``\\xNN`` escapes; the empty text is ``"∅"``.
    """
    if not text:
        return "∅"
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def percent(logprob: float) -> str:
    """The probability of ``logprob`` in percent: ``"88.4%"``, ``"0.012%"``, ``"0%"``."""
    p = 100.0 * math.exp(logprob) if logprob == logprob else math.nan  # NaN stays NaN
    if p >= 0.1 or p != p:
        return f"{p:.1f}%"
    return f"{p:.2g}%" if p > 0 else "0%"


def alternatives_line(entry: TokenLogprobs, names: Callable[[int], str], *, sep: str = " · ") -> str:
    """The top K of one step as plain text: ``"␣the 88.4% · ␣a 5.1%"``."""
    return sep.join(f"{token_label(names(tid))} {percent(lp)}" for tid, lp in entry.top)


def hover_title(entry: TokenLogprobs, names: Callable[[int], str]) -> str:
    """A token's tooltip: itself with its log-prob, then one line per alternative."""
    head = f"{token_label(names(entry.token))}  log-prob {entry.logprob:.3f} ({percent(entry.logprob)})"
    lines = [f"{'▸' if tid == entry.token else ' '} {token_label(names(tid))}  {percent(lp)}" for tid, lp in entry.top]
    return "\n".join([head, *lines])


def row_html(index: int, entry: TokenLogprobs, names: Callable[[int], str]) -> str:
    """One ``<tr>``: number, token, log-prob, probability, the alternatives (the chosen one bold)."""
    alts = ", ".join(
        ("<b>{}</b>" if tid == entry.token else "{}").format(
            f"<code>{html.escape(token_label(names(tid)))}</code>&nbsp;{percent(lp)}"
        )
        for tid, lp in entry.top
    )
    # A reasoning model's thinking tokens are dimmed: the answer's stand out.
    opening = '<tr class="mlxgen-reasoning-row" style="opacity: 0.6">' if entry.reasoning else "<tr>"
    return (
        f'{opening}<td style="{_NUM_STYLE}">{index}</td>'
        f'<td style="{_CELL_STYLE}"><code title="id {entry.token}">{html.escape(token_label(names(entry.token)))}</code></td>'
        f'<td style="{_NUM_STYLE}">{entry.logprob:.3f}</td>'
        f'<td style="{_NUM_STYLE}">{percent(entry.logprob)}</td>'
        f'<td style="{_CELL_STYLE}">{alts}</td></tr>'
    )


def table_html(rows: Sequence[str], *, k: int) -> str:
    """A ``<table>`` of rendered rows (:func:`row_html`), on one line per row, no blank line.

    No blank line inside: in Markdown the whole table stays one raw HTML block.
    """
    head = "".join(
        f'<th style="{_NUM_STYLE if num else _CELL_STYLE}">{name}</th>'
        for name, num in (("#", True), ("token", False), ("log-prob", True), ("p", True), (f"top {k}", False))
    )
    body = "\n".join(rows)
    return f'<table class="mlxgen-logprobs" style="{_TABLE_STYLE}">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody></table>'


def summary_line(count: int, k: int) -> str:
    """``"log-probs: 5 tokens, top 3"``."""
    return f"log-probs: {count} token{'' if count == 1 else 's'}, top {k}"


def details_html(rows: Sequence[str], *, k: int, open_rows: int = OPEN_ROWS) -> str:
    """The whole table in a ``<details>``: unfolded up to ``open_rows`` rows, folded beyond.

    Args:
        rows: Every row (:func:`row_html`).
        k: The K of ``--logprobs K``.
        open_rows: Most rows of a table that starts unfolded. Default: :data:`OPEN_ROWS`.
    """
    opened = " open" if len(rows) <= open_rows else ""
    return (
        f'<details class="mlxgen-logprobs-details"{opened}><summary style="font-size: 0.85em; cursor: pointer">'
        f"{summary_line(len(rows), k)}</summary>\n{table_html(rows, k=k)}\n</details>"
    )


def tail_html(rows: Sequence[str], *, k: int, last: int = TAIL_ROWS) -> str:
    """While streaming: the last ``last`` rows under a one-line heading."""
    shown = rows[-last:] if last > 0 else []
    where = f" (last {len(shown)})" if len(shown) < len(rows) else ""
    heading = f'<div style="font-size: 0.85em; opacity: 0.8">{summary_line(len(rows), k)}{where}</div>'
    return f"{heading}\n{table_html(shown, k=k)}" if shown else heading


def table_text(
    entries: Sequence[TokenLogprobs], names: Callable[[int], str], *, k: int, last: int | None = None
) -> str:
    """The table as plain text, columns aligned.

    Args:
        entries: Every token's log-probs, in order.
        names: Token id -> its text.
        k: The K of ``--logprobs K``.
        last: Only the last ``last`` rows (numbered as in the whole table).
          Default: ``None`` (all).
    """
    start = max(0, len(entries) - last) if last is not None else 0
    where = f" (last {len(entries) - start})" if start else ""
    lines = [f"[{summary_line(len(entries), k)}{where}]"]
    if len(entries) == start:
        return lines[0]
    labels = [_clip(token_label(names(e.token))) for e in entries[start:]]
    width = max(5, *(len(label) for label in labels))
    number = max(1, len(str(len(entries))))
    lines.append(f"{'#':>{number}}  {'token':<{width}}  {'log-prob':>8}  {'p':>6}  top {k}")
    for i, (entry, label) in enumerate(zip(entries[start:], labels), start + 1):
        lines.append(
            f"{i:>{number}}  {label:<{width}}  {entry.logprob:>8.3f}  {percent(entry.logprob):>6}  "
            f"{alternatives_line(entry, names)}"
        )
    return "\n".join(lines)


def hover_html(
    text: str,
    entries: Sequence[TokenLogprobs],
    names: Callable[[int], str],
    joined: Callable[[list[int]], str] | None = None,
) -> str:
    """The answer, HTML-escaped, each token a ``<span title=...>`` with its alternatives.

    Tokens are matched to the text from its start by their decoded text. A
    character whose UTF-8 bytes are split over up to four tokens (each alone
    decodes to "\ufffd") is matched by decoding them together (``joined``)
    and gets one span whose title lists them all. Where a token does not match
    (text cut at a stop string, a tokenizer whose single-token decode drops a
    leading space) the rest stays plain. The visible text is always exactly ``text``.

    Args:
        text: The answer.
        entries: Its tokens' log-probs, in order.
        names: Token id -> its text.
        joined: The text of several ids decoded together. Default: ``None``
          (split characters end the spans).
    """
    pieces = []
    pos = i = 0
    while i < len(entries):
        run = 1
        piece = names(entries[i].token)
        if "\ufffd" in piece and joined is not None and not text.startswith(piece, pos):
            for run in range(2, min(4, len(entries) - i) + 1):
                piece = joined([e.token for e in entries[i : i + run]])
                if "\ufffd" not in piece:
                    break
        if piece and not text.startswith(piece, pos):
            break
        if piece:
            title = "\n\n".join(hover_title(e, names) for e in entries[i : i + run])
            pieces.append(f'<span class="mlxgen-token" title="{html.escape(title)}">{html.escape(piece)}</span>')
            pos += len(piece)
        i += run
    pieces.append(html.escape(text[pos:]))
    return "".join(pieces)


def _clip(label: str) -> str:
    return label if len(label) <= TEXT_LABEL_WIDTH else label[: TEXT_LABEL_WIDTH - 1] + "…"


# -- token texts ------------------------------------------------------------------------------


class TokenNames:
    """Token id -> its text, decoded in batches and remembered.

    Args:
        decode: Texts of a list of ids (one each), or ``None``: then ids show
          as ``"#123"``.
    """

    def __init__(self, decode: Decode | None, joined: Callable[[list[int]], str] | None = None) -> None:
        self._decode = decode
        self._joined = joined
        self._known: dict[int, str] = {}

    def joined(self, ids: list[int]) -> str:
        """The text of ``ids`` decoded together ("\ufffd" when that cannot be done)."""
        if self._joined is None:
            return "\ufffd"
        try:
            return str(self._joined(ids))
        except Exception:  # a display must never fail the cell
            return "\ufffd"

    def learn(self, ids: Sequence[int]) -> None:
        """Decode the ids not known yet, in one call."""
        new = list(dict.fromkeys(i for i in ids if i not in self._known))
        if not new:
            return
        texts: list[str] | None = None
        if self._decode is not None:
            try:
                texts = list(self._decode(new))
            except Exception:  # a display must never fail the cell: ids are shown instead
                texts = None
        if texts is None or len(texts) != len(new):
            texts = [f"#{i}" for i in new]
        self._known.update(zip(new, texts))

    def __call__(self, token: int) -> str:
        """The text of ``token`` (decoded on the spot when not learned yet)."""
        if token not in self._known:
            self.learn([token])
        return self._known[token]


def tokenizer_decode(tokenizer: Any) -> Decode:
    """Decode each id on its own with ``tokenizer`` (mlx-lm's wrapper or a Hugging Face one).

    Uses ``batch_decode`` where the tokenizer has it (one call, or one pipe
    round trip for a tokenizer in a child process), else ``decode`` per id.
    """

    def decode(ids: list[int]) -> list[str]:
        batch = getattr(tokenizer, "batch_decode", None)
        if batch is not None:
            return [str(t) for t in batch([[i] for i in ids])]
        return [str(tokenizer.decode([i])) for i in ids]

    return decode


def find_tokenizer(gen: Generation) -> Any | None:
    """The tokenizer of the model ``gen`` runs on; ``None`` before that model is loaded."""
    return gen.tokenizer


# -- one generation's table ----------------------------------------------------------------------


class LogprobsTable:
    """The log-prob rows of one generation, each rendered once, for the views of :mod:`.widget`.

    Not thread-safe: the view calls it under its own lock.

    Args:
        gen: A generation with ``request.logprobs`` > 0.
        names: Token texts. Default: from the tokenizer of the model the
          generation runs on (:func:`find_tokenizer`), found on first use.
    """

    def __init__(self, gen: Generation, *, names: TokenNames | None = None) -> None:
        self.gen = gen
        self.k = gen.request.logprobs
        self._names = names
        self.entries: list[TokenLogprobs] = []
        self.rows: list[str] = []

    @property
    def names(self) -> TokenNames:
        """Token id -> text (the tokenizer is looked up the first time rows exist)."""
        if self._names is None:
            tokenizer = find_tokenizer(self.gen)
            if tokenizer is None:
                self._names = TokenNames(None)
            else:
                self._names = TokenNames(tokenizer_decode(tokenizer), lambda ids: tokenizer.decode(ids))
        return self._names

    def update(self) -> int:
        """Render the rows of the tokens that came since the last call; return how many rows there are."""
        new = self.gen.logprobs[len(self.entries) :]
        if new:
            names = self.names
            names.learn([tid for e in new for tid in (e.token, *(t for t, _ in e.top))])
            start = len(self.entries)
            self.entries.extend(new)
            self.rows.extend(row_html(start + i + 1, e, names) for i, e in enumerate(new))
        return len(self.rows)

    def html(self, *, final: bool) -> str:
        """For the widget: the last rows while streaming, the whole table (foldable) at the end."""
        self.update()
        if final:
            return details_html(self.rows, k=self.k) if self.rows else ""
        return tail_html(self.rows, k=self.k)

    def markdown(self) -> str:
        """For the final Markdown output: the whole table as one raw HTML block (empty without rows)."""
        self.update()
        return details_html(self.rows, k=self.k) if self.rows else ""

    def text(self, *, last: int | None = None) -> str:
        """The plain-text table (see :func:`table_text`)."""
        self.update()
        names = self.names if self.entries else TokenNames(None)
        return table_text(self.entries, names, k=self.k, last=last)

    def hover(self, text: str) -> str:
        """The answer with a tooltip on each token (see :func:`hover_html`)."""
        self.update()
        names = self.names if self.entries else TokenNames(None)
        return hover_html(text, self.answer_entries(), names, names.joined)

    def answer_entries(self) -> list[TokenLogprobs]:
        """The entries of the answer's tokens: after a reasoning model's reasoning, its end tag and the
        whitespace the answer text leaves out."""
        entries = self.entries
        last = max((i for i, e in enumerate(entries) if e.reasoning), default=-1)
        if last < 0:
            return entries
        start = last + 1
        while start < len(entries) and not self.names(entries[start].token).strip("\n\t ").replace(
            getattr(find_tokenizer(self.gen), "think_end", None) or "\0", ""
        ):
            start += 1  # the end tag, and what the template put after it
        return entries[start:]
