"""Structured output: what a generation's text must be, checked once, and the value read back.

A request constrains its answer with one of ``schema=`` (a JSON Schema dict or
a Pydantic model class), ``choices=`` (exactly one of these strings) or
``regex=``. :func:`constraint_of` turns those fields into a
:class:`Constraint`: the grammar llguidance matches (built and checked here,
before anything is queued, so a bad schema is one line at submit time) and the
way :meth:`Constraint.parse` reads the finished text back (the Pydantic
instance, the dict, the chosen string). The matcher that masks a row's logits
token by token is :mod:`.constraint_matcher`.

Why llguidance (docs/benchmarks.md, "Structured output"): on 128k-152k
vocabularies it needs no per-schema index over the vocabulary (compiles in
about a millisecond where outlines-core takes seconds), its masks take
tens of microseconds, and it covered the most JSON Schema features of the
three; it is what llama.cpp, vLLM, SGLang and mlx-vlm use.

Example::

    from pydantic import BaseModel
    class Place(BaseModel):
        city: str
        year: int
    gen = mlx_notebook.generate("Where and when? Lisbon, 1755.", schema=Place)
    gen.wait(); gen.parsed          # Place(city='Lisbon', year=1755)

This module never imports IPython or ipywidgets, nor MLX.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, MLXNotebookError
from .stats import FinishReason

# The pyproject extra that brings the constraint libraries.
EXTRA = "structured"

# JSON as Python's json.dumps writes it: one space after ':' and ',', no newlines. A fixed
# layout keeps the answer short and ends the value at its closing brace (free whitespace
# lets a weak model pad forever), and it is the layout models see most.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class IncompleteOutputError(MLXNotebookError, ValueError):
    """A constrained generation ended before its value closed (``gen.parsed`` has nothing to read)."""


def llguidance_module() -> Any:
    """llguidance, or a one-line error naming the extra that installs it."""
    try:
        import llguidance
    except ImportError:
        raise InvalidArgumentError(f"structured output needs llguidance: pip install 'mlx-notebook[{EXTRA}]'") from None
    return llguidance


def pydantic_class(value: Any) -> bool:
    """Whether ``value`` is a Pydantic model class (without importing pydantic when it is not loaded)."""
    return isinstance(value, type) and callable(getattr(value, "model_json_schema", None))


@dataclass(frozen=True)
class Constraint:
    """What a constrained generation's answer must be.

    Args:
        kind: ``"schema"``, ``"choices"`` or ``"regex"``.
        grammar: The llguidance grammar (its JSON or Lark text).
        schema: The JSON Schema (``kind == "schema"``). Default: ``None``.
        model: The Pydantic class the schema came from. Default: ``None``.
        choices: The allowed strings (``kind == "choices"``). Default: ``()``.
    """

    kind: str
    grammar: str
    schema: dict[str, Any] | None = None
    model: Any = None
    choices: tuple[str, ...] = ()

    @property
    def fields(self) -> list[str]:
        """The top-level properties of an object schema (a table's columns), else ``[]``."""
        props = (self.schema or {}).get("properties")
        return list(props) if isinstance(props, dict) else []

    def parse(self, text: str, finish: FinishReason | None, *, max_tokens: int) -> Any:
        """The value of a finished generation's ``text``.

        Raises:
            IncompleteOutputError: It ended before the value closed (length,
              stop, stop string) or the text does not hold a valid value.
        """
        if finish is not FinishReason.GRAMMAR:
            raise IncompleteOutputError(f"no value to parse: {_why_incomplete(finish, max_tokens)}")
        if self.kind == "choices" or self.kind == "regex":
            if self.kind == "choices" and text not in self.choices:
                raise IncompleteOutputError(f"the answer {text[:60]!r} is none of the choices")
            return text
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise IncompleteOutputError(f"the answer is not JSON: {exc.msg} at character {exc.pos}") from None
        if self.model is not None:
            from pydantic import ValidationError

            try:
                return self.model.model_validate(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "the value"
                raise IncompleteOutputError(f"{where}: {first['msg']}") from None
        _validate(value, self.schema)
        return value


def _why_incomplete(finish: FinishReason | None, max_tokens: int) -> str:
    if finish is FinishReason.LENGTH:
        return f"max_tokens ({max_tokens}) ran out before the value closed; raise max_tokens"
    if finish is FinishReason.STOPPED:
        return "the generation was stopped before the value closed"
    if finish is FinishReason.STOP_STRING:
        return "a stop string ended the answer before the value closed; leave stop= out"
    if finish is FinishReason.FAILED:
        return "the generation failed"
    if finish is None:
        return "the generation has not finished: wait() for it first"
    return f"it ended ({finish}) before the value closed"


def _validate(value: Any, schema: dict[str, Any] | None) -> None:
    # The grammar already held the text to the schema; jsonschema (when installed) checks
    # what a grammar cannot say exactly (e.g. number bounds on floats).
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validate(value, schema or {})
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "the value"
        raise IncompleteOutputError(f"{where}: {exc.message}") from None


def constraint_of(schema: Any = None, choices: Any = None, regex: Any = None) -> Constraint | None:
    """The request's :class:`Constraint` (``None`` when unconstrained), its grammar checked.

    Raises:
        InvalidArgumentError: More than one given, an invalid schema or an
          unsupported keyword, empty or non-string choices, a regex that does
          not compile, or llguidance missing.
    """
    given = [name for name, value in (("schema", schema), ("choices", choices), ("regex", regex)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgumentError(f"give one of schema=, choices=, regex=, not {' and '.join(given)}")
    if schema is not None:
        return _schema_constraint(schema)
    if choices is not None:
        return _choices_constraint(choices)
    return _regex_constraint(regex)


def check_constraint(name: str, value: Any) -> None:
    """The request's check of one constraint field (``None``: unconstrained)."""
    if value is not None:
        constraint_of(**{name: value})


def _schema_constraint(schema: Any) -> Constraint:
    model = None
    if pydantic_class(schema):
        model = schema
        schema = schema.model_json_schema()
    elif not isinstance(schema, dict):
        raise InvalidArgumentError(
            f"schema must be a JSON Schema dict or a Pydantic model class, got {type(schema).__name__}"
        )
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"schema is not JSON: {exc}") from None
    llg = llguidance_module()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(schema)), overrides=JSON_LAYOUT)
    _check_grammar(llg, grammar, "schema")
    if not isinstance(schema, dict):  # a Pydantic class's schema is always a dict; this keeps mypy sure
        raise InvalidArgumentError("schema must be a JSON object")
    return Constraint("schema", grammar, schema=schema, model=model)


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say.

    JSON Schema lets an object hold keys it does not list, and Pydantic's schemas
    do not forbid them: a grammar that follows it lets the model add keys after the
    last field, forever. Like OpenAI's strict mode and xgrammar's ``strict_mode``,
    the answer holds the listed fields only.
    """
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed and "patternProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _choices_constraint(choices: Any) -> Constraint:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise InvalidArgumentError(f"choices must be a list of strings, e.g. ['yes', 'no'], got {choices!r}")
    if not choices:
        raise InvalidArgumentError("choices is empty: give at least one string the answer may be")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise InvalidArgumentError(f"choices must be non-empty strings, got {choice!r}")
    llg = llguidance_module()
    # Lark string literals take JSON's escapes: each choice exactly, whatever it holds.
    grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    _check_grammar(llg, grammar, "choices")
    return Constraint("choices", grammar, choices=tuple(choices))


def _regex_constraint(regex: Any) -> Constraint:
    if not isinstance(regex, str) or not regex:
        raise InvalidArgumentError(f"regex must be a non-empty string, got {regex!r}")
    llg = llguidance_module()
    grammar = llg.LLMatcher.grammar_from_regex(regex)
    _check_grammar(llg, grammar, "regex")
    return Constraint("regex", grammar)


def _check_grammar(llg: Any, grammar: str, name: str) -> None:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        first = next((line.strip() for line in messages[0].splitlines() if line.strip()), messages[0])
        raise InvalidArgumentError(f"invalid {name}: {first}")


__all__ = ["EXTRA", "Constraint", "IncompleteOutputError", "check_constraint", "constraint_of", "pydantic_class"]
