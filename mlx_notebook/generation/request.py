"""What to generate: one declaration of a request's fields, one validation.

:class:`GenerationRequest` is the only place the options are declared; the
Python API (:func:`mlx_notebook.generate`) takes them as keywords and the
magic's traits validate their values with :func:`check_option`.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeGuard

from ..control import DEFAULT_STOP_BUDGET_S
from ..errors import InvalidArgumentError
from .constraints import Constraint, check_constraint, constraint_of
from .kv_settings import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    KV_BITS,
    KV_GROUP_SIZES,
    ROTATING_KEEP,
)

# Decode reads every weight once per step whatever the batch: on an H200 an
# 8B model decodes 8 sequences at ~5x one's aggregate rate (issue 11), on a
# 2-core CPU 4 at ~2.5x. More rows cost memory (each its KV cache) and make
# every row's step slower.
DEFAULT_MAX_BATCH = 8


@dataclass
class GenerationRequest:
    """What to generate. Validated by :meth:`validate` before queueing.

    Args:
        prompt: The user's prompt; a list of token ids used as they are
          (no chat template): exact prompt lengths for benchmarks; or a
          conversation, a list of ``{"role", "content"}`` dicts that the
          chat template renders (what :class:`mlx_notebook.Chat` sends).
        model: Model name (see :func:`mlx_notebook.loading.names.resolve`); the model's name is checked by resolving it. Default: ``None``.
        max_tokens: Most tokens to generate. Default: ``256``.
        temperature: 0 for greedy. Default: ``0.0``.
        top_p: Nucleus sampling mass; 1 disables it. Default: ``1.0``.
        seed: Seed of the sampling key; ``None`` for a random one. Default: ``None``.
        system: System message for the chat template. Default: ``None``.
        chat: Apply the model's chat template. Default: ``True``.
        stop_budget: Target seconds for one piece of work. Default: ``DEFAULT_STOP_BUDGET_S`` (0.1).
        max_batch: Most generations of the same model this one decodes
          together with (itself included); 1 runs it alone. Default: ``DEFAULT_MAX_BATCH`` (8).
        top_k: Sample among the ``top_k`` most likely tokens only. Default: ``None`` (all).
        min_p: Drop tokens less likely than ``min_p`` times the most likely one. Default: ``None``.
        repetition_penalty: mlx-lm's repetition penalty (> 1 discourages
          repeating the last ``repetition_context`` tokens). Default: ``None``.
        repetition_context: Tokens the repetition penalty looks back at. Default: ``20``.
        logit_bias: ``{token_id: bias}`` added to the logits before sampling
          (greedy too). Default: ``None``.
        stop: Strings that end the generation when the text contains one;
          the text ends before it (``finish_reason`` ``"stop_string"``). Default: ``None``.
        logprobs: Keep each generated token's log-probability and the ``logprobs``
          most likely alternatives (``gen.logprobs``); 0 keeps none. Default: ``0``.
        thinking: Whether a reasoning model thinks before it answers, passed to the
          chat template as ``enable_thinking``; ``None`` leaves the template's
          default. Default: ``None``.
        chat_template_kwargs: More variables for the chat template (mlx_lm.server's
          name), e.g. ``{"reasoning_effort": "low"}``. Default: ``None``.
        thinking_budget: Most reasoning tokens: after that many, the end of the
          reasoning (the end tag and what the template puts after it) is forced
          and the model answers. ``None``: no limit. Default: ``None``.
        schema: The answer is JSON valid against this JSON Schema dict or Pydantic
          model class (``gen.parsed`` reads it back). Default: ``None``.
        choices: The answer is exactly one of these strings. Default: ``None``.
        regex: The answer matches this regular expression (Rust ``regex`` syntax). Default: ``None``.
        kv_bits: Quantize the KV cache to this many bits (mlx-lm's ``kv_bits``:
          2, 3, 4, 5, 6 or 8) once it holds ``quantized_kv_start`` tokens;
          ``None`` keeps the model's dtype. Default: ``None``.
        kv_group_size: Values per quantization group of the KV cache (32, 64 or 128). Default: ``64``.
        quantized_kv_start: Tokens in the cache before it is quantized (mlx-lm's default). Default: ``5000``.
        max_kv_size: A rotating KV cache of at most this many tokens (the first 4
          are kept, older ones overwritten); ``None``: unbounded. Default: ``None``.
    """

    prompt: str | list[int] | list[dict[str, str]]
    model: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    system: str | None = None
    chat: bool = True
    stop_budget: float = DEFAULT_STOP_BUDGET_S
    max_batch: int = DEFAULT_MAX_BATCH
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repetition_context: int = 20
    logit_bias: dict[int, float] | None = None
    stop: list[str] | None = None
    logprobs: int = 0
    thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = None
    schema: Any = None
    choices: list[str] | None = None
    regex: str | None = None
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    max_kv_size: int | None = None

    def validate(self) -> None:
        """Raise :class:`InvalidArgumentError` with the fix for a bad field."""
        _check_prompt(self.prompt)
        if is_messages(self.prompt) and not self.chat:
            raise InvalidArgumentError("a list of messages needs the chat template: leave chat=True")
        for name in _CHECKS:
            if name not in _CONSTRAINTS:
                check_option(name, getattr(self, name))
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise InvalidArgumentError(
                "kv_bits and max_kv_size cannot be combined (mlx-lm cannot quantize a rotating cache): drop one"
            )
        self.__dict__["_constraint"] = constraint_of(self.schema, self.choices, self.regex)

    @property
    def constraint(self) -> Constraint | None:
        """What the answer must be (``schema``, ``choices`` or ``regex``), or ``None``; built once."""
        if "_constraint" not in self.__dict__:
            self.__dict__["_constraint"] = constraint_of(self.schema, self.choices, self.regex)
        found: Constraint | None = self.__dict__["_constraint"]
        return found


def option_names() -> list[str]:
    """The request's options: its fields but the prompt."""
    return [f.name for f in fields(GenerationRequest) if f.name != "prompt"]


def check_option(name: str, value: Any) -> None:
    """Raise :class:`InvalidArgumentError` when ``value`` is not valid for option ``name``."""
    check = _CHECKS.get(name)
    if check is not None:
        check(name, value)


def is_messages(prompt: Any) -> TypeGuard[list[dict[str, str]]]:
    """Whether ``prompt`` is a conversation (a list of message dicts), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _check_prompt(prompt: Any) -> None:
    if is_messages(prompt):
        _check_messages(prompt)
    elif isinstance(prompt, (list, tuple)):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise InvalidArgumentError("a token prompt must be a non-empty list of non-negative integers")
    elif not isinstance(prompt, str):
        raise InvalidArgumentError(
            f"prompt must be a string, a list of token ids or a list of messages, got {type(prompt).__name__}"
        )
    elif not prompt.strip():
        raise InvalidArgumentError("prompt is empty: give some text to generate from")
    else:
        _check_text("prompt", prompt)


def _check_messages(messages: Any) -> None:
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidArgumentError(f"message {i} needs a 'role' string (system, user, assistant), got {role!r}")
        if not isinstance(content, str):
            raise InvalidArgumentError(f"message {i} ({role}) needs a 'content' string, got {type(content).__name__}")
        _check_text(f"message {i} ({role})", content)
        reasoning = message.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise InvalidArgumentError(
                f"message {i} ({role}): 'reasoning' must be a string, got {type(reasoning).__name__}"
            )
    if not any(m["content"].strip() for m in messages):
        raise InvalidArgumentError("every message is empty: give some text to generate from")


def _check_optional_text(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be a string or None, got {type(value).__name__}")
    _check_text(name, value)


def _check_chat(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")


def _check_text(name: str, text: str) -> None:
    # Tokenizers take UTF-8 only; a lone surrogate (bytes decoded with
    # errors="surrogateescape") would fail later, on the worker, with a TypeError.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{name} is not valid UTF-8 text: {text[exc.start]!r} at position {exc.start} is a "
            "lone surrogate; decode the source bytes with errors='replace'"
        ) from None


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")


def _check_choice(name: str, value: Any, allowed: tuple[int, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _check_number(
    name: str,
    value: Any,
    *,
    minimum: float,
    exclusive_minimum: bool = False,
    maximum: float | None = None,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not low_ok or (maximum is not None and value > maximum) or math.isinf(value):
        bound = f"> {minimum}" if exclusive_minimum else f">= {minimum}"
        if maximum is not None:
            bound += f" and <= {maximum}"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")


def _optional(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    def checked(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return checked


def _check_logit_bias(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f"{name} must be a dict of token id to bias, e.g. {{1234: -100}}, got {type(value).__name__}"
        )
    for token, bias in value.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidArgumentError(f"{name} keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidArgumentError(f"{name}[{token}] must be a finite number, got {bias!r}")


def _check_stop(name: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"{name} must be a list of strings, e.g. ['###'], got {value!r}")
    for text in value:
        if not isinstance(text, str) or not text:
            raise InvalidArgumentError(f"{name} strings must be non-empty, got {text!r}")
        _check_text(name, text)


def _check_thinking(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True, False or None (the template's default), got {value!r}")


# What the prompt code passes to the chat template itself.
_TEMPLATE_OWN = ("messages", "conversation", "add_generation_prompt", "tokenize", "return_dict")


def _check_template_kwargs(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f"{name} must be a dict of template variables, e.g. {{'reasoning_effort': 'low'}}, got {type(value).__name__}"
        )
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidArgumentError(f"{name} keys must be template variable names, got {key!r}")
        if key in _TEMPLATE_OWN:
            raise InvalidArgumentError(f"{name} cannot set {key!r}: the prompt sets it")


def _check_seed(name: str, value: Any) -> None:
    if value is not None:
        _check_int(name, value, minimum=0)


_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "max_tokens": lambda name, v: _check_int(name, v, minimum=1),
    "temperature": lambda name, v: _check_number(name, v, minimum=0.0),
    "top_p": lambda name, v: _check_number(name, v, minimum=0.0, exclusive_minimum=True, maximum=1.0),
    "seed": _check_seed,
    "system": _check_optional_text,
    "chat": _check_chat,
    "stop_budget": lambda name, v: _check_number(name, v, minimum=0.0, exclusive_minimum=True),
    "max_batch": lambda name, v: _check_int(name, v, minimum=1),
    "top_k": _optional(lambda name, v: _check_int(name, v, minimum=1)),
    "min_p": _optional(lambda name, v: _check_number(name, v, minimum=0.0, exclusive_minimum=True, maximum=1.0)),
    "repetition_penalty": _optional(lambda name, v: _check_number(name, v, minimum=0.0, exclusive_minimum=True)),
    "repetition_context": lambda name, v: _check_int(name, v, minimum=1),
    "logit_bias": _optional(_check_logit_bias),
    "stop": _optional(_check_stop),
    "logprobs": lambda name, v: _check_int(name, v, minimum=0),
    "thinking": _check_thinking,
    "chat_template_kwargs": _optional(_check_template_kwargs),
    "thinking_budget": _optional(lambda name, v: _check_int(name, v, minimum=0)),
    "kv_bits": _optional(lambda name, v: _check_choice(name, v, KV_BITS)),
    "kv_group_size": lambda name, v: _check_choice(name, v, KV_GROUP_SIZES),
    "quantized_kv_start": lambda name, v: _check_int(name, v, minimum=0),
    "max_kv_size": _optional(lambda name, v: _check_int(name, v, minimum=ROTATING_KEEP + 1)),
    "schema": check_constraint,
    "choices": check_constraint,
    "regex": check_constraint,
}
# Checked together in validate(): at most one, and the grammar built once.
_CONSTRAINTS = ("schema", "choices", "regex")
