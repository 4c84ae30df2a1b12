"""The prompt as token ids: chat template or not, then the context-length check.

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
        ids = _chat_ids(tokenizer, _with_system(request.prompt, request.system))
    elif isinstance(request.prompt, (list, tuple)):
        ids = list(cast("list[int]", request.prompt))
        vocab = loaded.config.get("vocab_size")
        if isinstance(vocab, int) and max(ids) >= vocab:
            raise InvalidArgumentError(f"token id {max(ids)} is outside the model's vocabulary of {vocab}")
    elif request.chat and getattr(tokenizer, "has_chat_template", False):
        ids = _chat_ids(tokenizer, _with_system([{"role": "user", "content": request.prompt}], request.system))
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


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    # Rendered to text, then tokenized without BOS: the template writes its own
    # special tokens. Only role and content reach the template (a Chat marks
    # stopped answers with an extra key).
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
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
