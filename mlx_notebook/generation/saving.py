"""Saving a generation from the worker thread: what its file holds, where that is now.

A paused generation's cache is its parked row's, exactly the state its
resume would continue from. A stopped or finished generation no longer has
a row: its cache went to the model's prompt cache, where the longest entry
holding its tokens is found (all of them unless it was evicted; none if the
prompt cache is off: the file then holds the tokens only, and a resume
prefills them). A generation paused inside its prefill has no consistent
cache to write (layers stop between groups): it says so.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import mlx.core as mx

from ..control import Pace
from ..errors import InvalidArgumentError
from ..loading.store import LoadedModel, ModelStore
from .batch_cache import length
from .handle import Generation
from .kv_settings import KVSettings
from .persist import CHAT_FORMAT, fingerprint, generation_json, write
from .prompt import prepare_prompt
from .request import GenerationRequest
from .states import State


class Rows(Protocol):
    """What saving needs from the running session."""

    loaded: LoadedModel | None

    def parked_row(self, gen: Any) -> Any: ...


def save_generation(
    gen: Generation, path: str | os.PathLike[str], store: ModelStore, rows: Rows | None, pace: Pace
) -> int:
    """Write ``gen`` to ``path`` (on the worker thread); return the bytes written.

    Raises:
        InvalidArgumentError: It cannot be saved now (queued, running, paused
          in its prefill, its model unloaded), in one line with what to do.
        Cancelled: A stop of the save between two pieces.
    """
    where = f"generation #{gen.id}"
    row = rows.parked_row(gen) if rows is not None else None
    kv = KVSettings.of(gen.request)
    if row is not None:
        assert rows is not None and rows.loaded is not None
        fed = row.fed_tokens()
        n = length(row.cache)
        key = row.sample.key.tolist() if not row.greedy else None
        data = generation_json(
            gen.request,
            row.prompt,
            list(row.tokens),
            n,
            key,
            rows.loaded.source.key,
            fingerprint(rows.loaded),
            kv.as_dict(),
        )
        assert n == len(fed) - 1, (n, len(fed))
        return write(path, row.cache, data, pace)
    if gen.state is State.QUEUED:
        raise InvalidArgumentError(f"{where} has not started: nothing to save yet")
    if not gen.finished:
        if gen.state is State.PAUSED:
            raise InvalidArgumentError(
                f"{where} is paused inside its prefill: resume it until it decodes, then pause and save"
            )
        raise InvalidArgumentError(f"{where} is {gen.state}: pause it first (gen.pause()), then save")
    prompt = gen.prompt_tokens
    if not prompt:
        raise InvalidArgumentError(f"{where} ended ({gen.state}) before its prompt was read: nothing to save")
    loaded = next((m for m in store.loaded() if m.source.key == gen.model_key), None)
    if loaded is None:
        raise InvalidArgumentError(f"{where}'s model is no longer loaded: load it again to save the generation")
    tokens = gen.tokens
    cache: list[Any] = []
    n = 0
    if loaded.prompt_cache is not None:
        found, n = loaded.prompt_cache.fetch(prompt + tokens, kv)
        cache = found or []
        if cache:
            mx.eval([layer.state for layer in cache])
    key = gen.sampler_key
    data = generation_json(gen.request, prompt, tokens, n, key, loaded.source.key, fingerprint(loaded), kv.as_dict())
    return write(path, cache, data, pace)


def save_chat(
    request: GenerationRequest, chat: dict[str, Any], path: str | os.PathLike[str], store: ModelStore, pace: Pace
) -> tuple[int, int]:
    """Write a chat (its JSON) with the KV cache its history left in the model's prompt cache.

    ``request`` is the chat's next turn without its user message: its
    prompt, the history with the template's generation prompt after it,
    shares with the next turn's prompt everything but that last piece. The
    longest prompt-cache entry of it is written (the last turn's prompt and
    answer): after a restart, :meth:`~mlx_notebook.Chat.load` serves the
    next turn from it.

    Returns:
        The bytes written, and how many tokens of KV they hold (0 when the
        model is not loaded or its prompt cache holds none of the history).
    """
    kv = KVSettings.of(request)
    if not kv.plain and kv.max_size is not None:
        raise InvalidArgumentError(
            "a chat with max_kv_size cannot keep its KV: a rotating cache drops what the next turn reads; "
            "save it without kv=True"
        )
    loaded = store.get(request.model, pace)
    tokens = prepare_prompt(loaded, request)
    cache: list[Any] = []
    n = 0
    if loaded.prompt_cache is not None:
        found, n = loaded.prompt_cache.fetch(tokens, kv)
        cache = found or []
    data = {
        "format": CHAT_FORMAT,
        "chat": chat,
        "kv_tokens": n,
        "tokens": tokens[:n],
        "model": loaded.source.key,
        "fingerprint": fingerprint(loaded),
        "kv": kv.as_dict(),
    }
    return write(path, cache, data, pace), n


__all__ = ["save_chat", "save_generation"]
