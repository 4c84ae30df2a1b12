"""Put the values of notebook variables into a ``%%mlxgen`` prompt.

A placeholder is exactly ``{name}``, ``{name.attr}``, ``{name[key]}`` or a
chain of those (``{row[author].name}``): braces around an identifier path and
nothing else. A key is an identifier, an integer (an index, as in
``str.format``) or a quoted string (``{row['first name']}``). Everything else
with braces in it (a dict literal, a comprehension, JSON, ``{}``, ``{ x }``)
is left exactly as written, so code pasted into a prompt passes through
untouched. ``{{name}}`` is the
escape and gives a literal ``{name}``.

An identifier-shaped placeholder that does not resolve is an error before
anything runs, because it is far more often a typo than literal text, and a
silent ``{nme}`` in a prompt wastes a whole generation.

Example::

    >>> interpolate("Summarize {doc.title} in {n} words.", {"doc": doc, "n": 20})
    'Summarize Rivers in 20 words.'
    >>> interpolate('Return {"a": 1} and {{n}}', {})
    'Return {"a": 1} and {n}'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_KEY = r"-?[0-9]+|" + _NAME + r"|'[^'\]\n]*'|\"[^\"\]\n]*\""
_STEP = re.compile(r"\.(?P<attr>" + _NAME + r")|\[(?P<key>" + _KEY + r")\]")
_PATH = _NAME + r"(?:\." + _NAME + r"|\[(?:" + _KEY + r")\])*"
_QUOTES = "'\""
# The escape is tried first, so "{{x}}" never reads as "{" + placeholder + "}".
_TOKEN = re.compile(r"\{\{(?P<escaped>" + _PATH + r")\}\}|\{(?P<path>" + _PATH + r")\}")


class UnknownVariableError(InvalidArgumentError, NameError):
    """A placeholder names a variable that is not defined."""


def placeholders(template: str) -> list[str]:
    """The placeholder paths in ``template``, in order (escapes excluded)."""
    return [m.group("path") for m in _TOKEN.finditer(template) if m.group("path")]


def interpolate(template: str, namespace: Mapping[str, Any]) -> str:
    """Replace each ``{name}`` / ``{name.attr}`` / ``{name[key]}`` with ``str()`` of its value.

    Args:
        template: The prompt as typed.
        namespace: Where names are looked up (the user namespace).

    Returns:
        The prompt with placeholders filled and ``{{name}}`` turned into ``{name}``.

    Raises:
        UnknownVariableError: A placeholder's first name is not in ``namespace``.
        InvalidArgumentError: An attribute or item lookup, or ``str()`` of a value, failed.
    """

    def fill(match: re.Match) -> str:
        escaped = match.group("escaped")
        if escaped is not None:
            return "{" + escaped + "}"
        return _resolve(match.group("path"), namespace)

    return _TOKEN.sub(fill, template)


def _resolve(path: str, namespace: Mapping[str, Any]) -> str:
    root = re.match(_NAME, path)
    assert root is not None  # _TOKEN only matches paths that start with a name
    name = root.group()
    if name not in namespace:
        raise UnknownVariableError(
            f"unknown variable {{{name}}} in the prompt; define it or write {{{{{path}}}}} for literal braces"
        )
    value = namespace[name]
    walked = name
    for step in _STEP.finditer(path, root.end()):
        attr, key = step.group("attr"), step.group("key")
        try:
            value = getattr(value, attr) if attr is not None else _item(value, key)
        except Exception as exc:  # a property or __getitem__ may raise anything
            missing = f"no attribute {attr!r}" if attr is not None else _missing_item(value, key)
            hint = f"; for a dict write {{{walked}[{attr}]}}" if attr is not None and isinstance(value, Mapping) else ""
            raise InvalidArgumentError(
                f"{{{path}}} in the prompt: {walked} has {missing} ({type(exc).__name__}){hint}; "
                f"write {{{{{path}}}}} for literal braces"
            ) from None
        walked += step.group()
    try:
        return str(value)
    except Exception as exc:  # a broken __str__ must not take down the magic
        raise InvalidArgumentError(f"{{{path}}} in the prompt: str() failed with {type(exc).__name__}: {exc}") from None


def _item(value: Any, key: str) -> Any:
    """``value[key]``: a quoted key is a string, digits an integer (as ``str.format`` reads them)."""
    if key[0] in _QUOTES:
        return value[key[1:-1]]
    if key.lstrip("-").isdigit():
        if isinstance(value, Mapping) and int(key) not in value and key in value:
            return value[key]  # a dict keyed by the string "1"
        return value[int(key)]
    return value[key]


def _missing_item(value: Any, key: str) -> str:
    if isinstance(value, Mapping):
        return f"no key {key if key[0] in _QUOTES else repr(key)}"
    return f"no item [{key}]"
