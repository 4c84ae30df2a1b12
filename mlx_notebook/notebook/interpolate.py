"""Put the values of notebook variables into a ``%%mlxgen`` prompt.

A placeholder is exactly ``{name}`` or ``{name.attr.attr}``: braces around an
identifier path and nothing else. Everything else with braces in it (a dict
literal, a comprehension, JSON, ``{}``, ``{ x }``) is left exactly as written,
so code pasted into a prompt passes through untouched. ``{{name}}`` is the
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

_PATH = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
# The escape is tried first, so "{{x}}" never reads as "{" + placeholder + "}".
_TOKEN = re.compile(r"\{\{(?P<escaped>" + _PATH + r")\}\}|\{(?P<path>" + _PATH + r")\}")


class UnknownVariableError(InvalidArgumentError, NameError):
    """A placeholder names a variable that is not defined."""


def placeholders(template: str) -> list[str]:
    """The placeholder paths in ``template``, in order (escapes excluded)."""
    return [m.group("path") for m in _TOKEN.finditer(template) if m.group("path")]


def interpolate(template: str, namespace: Mapping[str, Any]) -> str:
    """Replace each ``{name}`` / ``{name.attr}`` with ``str()`` of its value.

    Args:
        template: The prompt as typed.
        namespace: Where names are looked up (the user namespace).

    Returns:
        The prompt with placeholders filled and ``{{name}}`` turned into ``{name}``.

    Raises:
        UnknownVariableError: A placeholder's first name is not in ``namespace``.
        InvalidArgumentError: An attribute lookup or ``str()`` of a value failed.
    """

    def fill(match: re.Match) -> str:
        escaped = match.group("escaped")
        if escaped is not None:
            return "{" + escaped + "}"
        return _resolve(match.group("path"), namespace)

    return _TOKEN.sub(fill, template)


def _resolve(path: str, namespace: Mapping[str, Any]) -> str:
    root, *attrs = path.split(".")
    if root not in namespace:
        raise UnknownVariableError(
            f"unknown variable {{{root}}} in the prompt; define it or write {{{{{path}}}}} for literal braces"
        )
    value = namespace[root]
    walked = root
    for attr in attrs:
        try:
            value = getattr(value, attr)
        except Exception as exc:  # a property may raise anything
            raise InvalidArgumentError(
                f"{{{path}}} in the prompt: {walked} has no attribute {attr!r} "
                f"({type(exc).__name__}); write {{{{{path}}}}} for literal braces"
            ) from None
        walked += "." + attr
    try:
        return str(value)
    except Exception as exc:  # a broken __str__ must not take down the magic
        raise InvalidArgumentError(f"{{{path}}} in the prompt: str() failed with {type(exc).__name__}: {exc}") from None
