"""The prompt as token ids: chat template or not, then the context-length check.

The chat template gets the request's ``chat_template_kwargs`` and, when
``thinking`` is set, ``enable_thinking`` (mlx-lm's wrapper renames it for
templates that call it ``thinking``; left unset, the template's default).
An assistant message's ``reasoning`` reaches the template as
``reasoning_content`` only when the template reads that name.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from ..errors import InvalidArgumentError
from ..loading.store import LoadedModel
from .request import GenerationRequest, is_messages


def prepare_prompt(loaded: LoadedModel, request: GenerationRequest) -> list[int]:
    """Apply the chat template (or not) and tokenize; check the context length."""
    tokenizer = loaded.tokenizer
    if is_messages(request.prompt):
        if not getattr(tokenizer, "has_chat_template", False):
            raise InvalidArgumentError(
                "this model has no chat template, which a list of messages needs: give a text prompt"
            )
        ids = _chat_ids(tokenizer, _with_system(request.prompt, request.system), template_kwargs(request))
    elif isinstance(request.prompt, (list, tuple)):
        ids = list(cast("list[int]", request.prompt))
        vocab = loaded.config.get("vocab_size")
        if isinstance(vocab, int) and max(ids) >= vocab:
            raise InvalidArgumentError(f"token id {max(ids)} is outside the model's vocabulary of {vocab}")
    elif request.chat and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": request.prompt}]
        ids = _chat_ids(tokenizer, _with_system(messages, request.system), template_kwargs(request))
    else:
        text = request.prompt if request.system is None else f"{request.system}\n\n{request.prompt}"
        with _no_length_warning():
            ids = tokenizer.encode(text)
    ids = list(ids)
    if not ids:
        raise InvalidArgumentError("prompt tokenized to nothing: give some text to generate from")
    context = loaded.config.get("max_position_embeddings")
    if isinstance(context, int) and len(ids) >= context:
        raise InvalidArgumentError(
            f"prompt has {len(ids)} tokens but the model's context is {context}: shorten the prompt"
        )
    return ids


def _with_system(messages: list[dict[str, str]], system: str | None) -> list[dict[str, str]]:
    """``messages`` with the ``system`` option first, unless they start with a system message."""
    if not system or (messages and messages[0]["role"] == "system"):
        return list(messages)
    return [{"role": "system", "content": system}, *messages]


def template_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """What the chat template gets besides the messages: ``chat_template_kwargs``, then ``enable_thinking``."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking
    return kwargs


def takes_reasoning(tokenizer: Any) -> bool:
    """Whether the chat template reads ``reasoning_content`` on messages (Qwen3's, DeepSeek's do)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "reasoning_content" in t for t in texts)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> list[int]:
    # Rendered to text, then tokenized without BOS: the template writes its own
    # special tokens. Only role and content reach the template (a Chat marks
    # stopped answers with an extra key), and a kept reasoning where the template
    # reads it: sent back otherwise, it would be in the prompt as answer text.
    keep_reasoning = takes_reasoning(tokenizer)
    plain: list[dict[str, str]] = []
    for m in messages:
        message = {"role": m["role"], "content": m["content"]}
        if keep_reasoning and m.get("reasoning"):
            message["reasoning_content"] = m["reasoning"]
        plain.append(message)
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False, **kwargs)
    with _no_length_warning():
        return list(tokenizer.encode(text, add_special_tokens=False))


@contextmanager
def _no_length_warning() -> Iterator[None]:
    # transformers warns on stderr, i.e. in the user's cell, when a prompt is
    # longer than the tokenizer's model_max_length; the context check in
    # prepare_prompt says it in one line instead (or the prompt fits the model).
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
