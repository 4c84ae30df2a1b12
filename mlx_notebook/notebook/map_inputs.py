"""The prompts of ``%%mlxgen --map NAME``: the cell body filled once per item of ``NAME``.

Each item is bound to ``{item}`` on top of the user namespace, so the body
reads ``{item}``, ``{item.field}``, ``{item[key]}`` and any other variable
exactly as a plain ``%%mlxgen`` body does (:mod:`.interpolate`). Every item is
formatted before anything is queued: a missing key in the last item is an
error, not a map that stops half-way.

Example::

    >>> map_prompts("Capital of {item[country]}?", "rows", {"rows": [{"country": "Peru"}]})
    ['Capital of Peru?']
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import InvalidArgumentError
from .interpolate import interpolate
from .structured import dataframe_rows, is_dataframe

ITEM = "item"  # the placeholder name of the current item


def map_prompts(template: str, name: str, namespace: Mapping[str, Any]) -> list[str]:
    """Fill ``template`` once per item of the iterable ``namespace[name]``.

    Args:
        template: The cell body.
        name: The variable that holds the inputs (a list, tuple, generator...).
        namespace: The user namespace.

    Returns:
        One prompt per item, in order.

    Raises:
        InvalidArgumentError: ``name`` is not a variable name, is undefined,
          is not iterable (or is a single string), is empty, or an item lacks
          what a placeholder asks for (the message names the item's index).
    """
    if not name.isidentifier():
        raise InvalidArgumentError(f"--map needs the name of a variable that holds the inputs, got {name!r}")
    if name not in namespace:
        raise InvalidArgumentError(f"--map {name}: no variable {name!r}; define the list of inputs first")
    items = _items(name, namespace[name])
    prompts = []
    variables = dict(namespace)  # ChainMap wants a mutable mapping; nothing writes to it
    for index, item in enumerate(items):
        try:
            prompts.append(interpolate(template, ChainMap({ITEM: item}, variables)))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--map {name}[{index}]: {exc}") from None
    return prompts


def _items(name: str, value: Any) -> list[Any]:
    if isinstance(value, (str, bytes)):
        # Iterable, but one prompt per character is never what was meant.
        raise InvalidArgumentError(
            f"--map {name} is a single {type(value).__name__}; give a list of inputs, e.g. {name} = [{name}]"
        )
    if is_dataframe(value):
        items = dataframe_rows(value)  # rows, not the column names a DataFrame iterates over
        if not items:
            raise InvalidArgumentError(f"--map {name} is an empty DataFrame: nothing to generate")
        return items
    if not isinstance(value, Iterable):
        raise InvalidArgumentError(
            f"--map {name} is {_a(type(value).__name__)}, not iterable; give a list (or any iterable) of inputs"
        )
    try:
        items = list(value)
    except Exception as exc:  # a generator or __iter__ may raise anything
        raise InvalidArgumentError(f"--map {name}: iterating it failed with {type(exc).__name__}: {exc}") from None
    if not items:
        raise InvalidArgumentError(f"--map {name} is empty: nothing to generate")
    return items


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun
