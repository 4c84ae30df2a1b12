"""The notebook's side of structured output: ``--schema NAME``, DataFrame inputs, the parsed table.

* :func:`schema_from`: ``%%mlxgen --schema NAME`` names a Pydantic class or a
  dict in the namespace (or is a JSON Schema written inline).
* :func:`choices_from`: ``--choices a,b,c`` (a list variable's name also works).
* :func:`dataframe_rows`: ``--map df`` over a pandas DataFrame gives one input
  per row, a ``Series`` each, so the body reads ``{item.column}`` or ``{item[column]}``.
* :func:`parsed_table_html` / :func:`parsed_table_text`: a constrained map's
  parsed values, one row per input (filled in as inputs finish), for the
  ``--map`` widget and for headless output.

Example::

    %%mlxgen --map reviews --schema Review -o out
    Classify this review: {item.text}
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ..many import Batch

# Characters of one cell of the text table (longer values end in "…").
CELL_CHARS = 40


def schema_from(text: str, namespace: Mapping[str, Any]) -> Any:
    """``--schema``: a variable's value (Pydantic class or dict) by name, or a JSON Schema written inline."""
    if text.isidentifier():
        if text not in namespace:
            raise InvalidArgumentError(
                f"--schema {text}: no variable {text!r}; define the Pydantic class or dict first"
            )
        return namespace[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(
            f"--schema needs a Pydantic class's or a dict's name, or a JSON Schema: {exc.msg}"
        ) from None


def choices_from(text: str, namespace: Mapping[str, Any]) -> list[str]:
    """``--choices``: ``a,b,c`` (each stripped), or a list variable's name."""
    if text.isidentifier() and text in namespace and isinstance(namespace[text], (list, tuple)):
        return list(namespace[text])
    return [choice.strip() for choice in text.split(",")]


def is_dataframe(value: Any) -> bool:
    """Whether ``value`` looks like a pandas DataFrame (without importing pandas)."""
    return hasattr(value, "iterrows") and hasattr(value, "columns")


def dataframe_rows(frame: Any) -> list[Any]:
    """A DataFrame's rows, each a ``Series`` (``{item.column}``, ``{item[column]}``), in order."""
    return [row for _, row in frame.iterrows()]


def _table(batch: Batch) -> tuple[list[str], list[list[str]]] | None:
    """The columns and, per input, its cells; ``None`` for a map without a constraint."""
    if not len(batch) or batch[0].request.constraint is None:
        return None
    records = batch.records()
    columns = batch.columns(records)
    rows = []
    for gen, record in zip(batch, records):
        if not gen.state.final:
            record = {"state": str(gen.state)}  # its error would say "not finished": nothing to say yet
        rows.append(["" if record.get(c) is None else str(record[c]) for c in columns])
    return columns, rows


def parsed_table_html(batch: Batch) -> str:
    """The parsed values as an HTML table, one row per input (``""`` without a constraint)."""
    table = _table(batch)
    if table is None:
        return ""
    columns, rows = table
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["#", *columns])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in [str(i), *row]) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f'<table class="mlxgen-parsed"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def parsed_table_text(batch: Batch) -> str:
    """The parsed values as a plain-text table (``""`` without a constraint)."""
    table = _table(batch)
    if table is None:
        return ""
    columns, rows = table
    lines = [["#", *columns]] + [[str(i), *(_cut(cell) for cell in row)] for i, row in enumerate(rows)]
    widths = [max(len(line[j]) for line in lines) for j in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _cut(cell: str) -> str:
    flat = " ".join(cell.split())
    return flat if len(flat) <= CELL_CHARS else flat[: CELL_CHARS - 1] + "…"


__all__ = [
    "choices_from",
    "dataframe_rows",
    "is_dataframe",
    "parsed_table_html",
    "parsed_table_text",
    "schema_from",
]
