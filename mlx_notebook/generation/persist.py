"""A generation as data: one file with its KV cache, tokens, request and sampler state.

``gen.save(path)`` writes a paused, stopped or finished generation to one
file; ``mlx_notebook.resume_from(path)`` continues it in any process that
can load the same model, with exactly the tokens the uninterrupted run gives
(greedy and seeded): the KV cache comes back as it was, the sampler's PRNG
key too, and the next step is the one the pause undid.

The file is :mod:`.kv_file`'s: mlx-lm's prompt-cache format (safetensors;
``mlx_lm.models.cache.load_prompt_cache`` reads it), with this module's JSON
as one metadata string under :data:`META_KEY`. Nothing in it is executed:
the JSON is checked field by field, the request is validated as any other.

What a file holds:

- ``request``: the request's fields (a Pydantic ``schema`` as its JSON Schema);
- ``prompt``: the prompt's token ids; ``tokens``: the generated ones so far;
- ``kv_tokens``: how many of ``prompt + tokens`` the cache holds (all but the
  last, for a paused generation; fewer, or 0, when the cache of an ended one
  was no longer kept: resume prefills the rest);
- ``key``: the sampler's PRNG key; ``model`` and ``fingerprint``
  (:func:`~mlx_notebook.loading.fingerprint.weights_fingerprint`): a file
  resumes only on the weights that computed its cache.

A :class:`KVSeed` is the part a resume or a loaded :class:`~mlx_notebook.Chat`
needs on the worker: the file and the tokens its cache holds.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from ..control import Pace
from ..errors import InvalidArgumentError
from ..loading.fingerprint import weights_fingerprint
from ..loading.store import LoadedModel
from .kv_settings import KVSettings
from .request import GenerationRequest

# The metadata key of this module's JSON in the file, and its format tag.
META_KEY = "mlx_notebook"
FORMAT = "mlx-notebook.generation/1"
CHAT_FORMAT = "mlx-notebook.chat/1"


@dataclass
class KVSeed:
    """A KV cache file and the tokens its cache holds, for the worker to start from.

    Args:
        path: The file.
        tokens: The token ids its cache holds, in order.
        fingerprint: The weights it was computed with.
        model: The model's name when it was saved (for messages).
        kv: Its KV settings (``KVSettings.as_dict``).
    """

    path: str
    tokens: list[int]
    fingerprint: str
    model: str
    kv: dict[str, Any]


@dataclass
class Resume:
    """What a resumed generation continues from (besides its request).

    Args:
        seed: The file's cache.
        prompt: The prompt's token ids.
        tokens: The tokens generated before the save (EOS excluded).
        key: The sampler's PRNG key (two uint32), or ``None``.
    """

    seed: KVSeed
    prompt: list[int]
    tokens: list[int]
    key: list[int] | None = None


def request_to_json(request: GenerationRequest) -> dict[str, Any]:
    """The request's fields as JSON data."""
    out: dict[str, Any] = {}
    for f in fields(GenerationRequest):
        value = getattr(request, f.name)
        if f.name == "schema" and value is not None and not isinstance(value, dict):
            value = value.model_json_schema()  # a Pydantic class: its JSON Schema (resumes as a dict)
        elif f.name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}
        out[f.name] = value
    return out


def request_from_json(data: Any, where: str) -> GenerationRequest:
    """A request from :func:`request_to_json`'s output, validated.

    Raises:
        InvalidArgumentError: Unknown or bad fields, in one line.
    """
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{where}: 'request' must be an object")
    names = {f.name for f in fields(GenerationRequest)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown request field {unknown[0]!r}; was it saved by a newer version?")
    data = dict(data)
    bias = data.get("logit_bias")
    if isinstance(bias, dict):
        try:
            data["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise InvalidArgumentError(f"{where}: logit_bias keys must be token ids") from None
    if "prompt" not in data:
        raise InvalidArgumentError(f"{where}: the request has no prompt")
    request = GenerationRequest(**data)
    try:
        request.validate()
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None
    return request


def _token_list(value: Any, name: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise InvalidArgumentError(f"{where}: '{name}' must be a list of token ids")
    return value


def seed_of(data: dict[str, Any], path: str, tokens: list[int]) -> KVSeed:
    """The :class:`KVSeed` of a file's JSON, checked."""
    n = data.get("kv_tokens", 0)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(tokens):
        raise InvalidArgumentError(f"{path}: 'kv_tokens' must be a count of at most {len(tokens)} tokens")
    fingerprint, model, kv = data.get("fingerprint"), data.get("model"), data.get("kv") or {}
    if not isinstance(fingerprint, str) or not isinstance(model, str) or not isinstance(kv, dict):
        raise InvalidArgumentError(f"{path}: 'fingerprint' and 'model' must be strings, 'kv' an object")
    return KVSeed(path, tokens[:n], fingerprint, model, kv)


def read(path: str | os.PathLike[str], expect: str) -> dict[str, Any]:
    """This module's JSON from a file's header (cheap: no tensor is read), checked to be of kind ``expect``.

    Raises:
        InvalidArgumentError: Not such a file (one line: what it is, what to do).
        OSError: It cannot be read.
    """
    from .kv_file import read_metadata

    metadata = read_metadata(path)
    raw = metadata.get(META_KEY)
    what = "gen.save" if expect == FORMAT else "Chat.save(path, kv=True)"
    if raw is None:
        raise InvalidArgumentError(f"{path} is a KV cache file but not one {what} wrote (no {META_KEY!r} metadata)")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{path}: its {META_KEY!r} metadata is not JSON ({exc.msg})") from None
    if not isinstance(data, dict) or data.get("format") != expect:
        found = data.get("format") if isinstance(data, dict) else None
        raise InvalidArgumentError(
            f"{path} holds {found or 'something else'}, not {expect}: open it with the matching call"
        )
    return data


def read_resume(path: str | os.PathLike[str]) -> tuple[GenerationRequest, Resume]:
    """The request and :class:`Resume` of a saved generation (header only)."""
    where = str(path)
    data = read(path, FORMAT)
    request = request_from_json(data.get("request"), where)
    prompt = _token_list(data.get("prompt"), "prompt", where)
    tokens = _token_list(data.get("tokens"), "tokens", where)
    if not prompt:
        raise InvalidArgumentError(f"{where}: the saved prompt has no tokens")
    key = data.get("key")
    if key is not None and not (
        isinstance(key, list) and len(key) == 2 and all(isinstance(k, int) and 0 <= k < 2**32 for k in key)
    ):
        raise InvalidArgumentError(f"{where}: 'key' must be two 32-bit integers")
    seed = seed_of(data, where, prompt + tokens)
    return request, Resume(seed, prompt, tokens, key)


def write(path: str | os.PathLike[str], cache: list[Any], data: dict[str, Any], pace: Pace) -> int:
    """Write ``cache`` and ``data`` (this module's JSON) to ``path``; return the bytes written."""
    from .kv_file import save

    return save(path, cache, {META_KEY: json.dumps(data, ensure_ascii=False)}, pace)


def generation_json(
    request: GenerationRequest,
    prompt: list[int],
    tokens: list[int],
    kv_tokens: int,
    key: list[int] | None,
    model: str,
    fingerprint: str,
    kv: dict[str, Any],
) -> dict[str, Any]:
    """The JSON of a saved generation (see the module's docstring)."""
    return {
        "format": FORMAT,
        "request": request_to_json(request),
        "prompt": prompt,
        "tokens": tokens,
        "kv_tokens": kv_tokens,
        "key": key,
        "model": model,
        "fingerprint": fingerprint,
        "kv": kv,
    }


def fingerprint(loaded: LoadedModel) -> str:
    """The loaded model's :func:`~mlx_notebook.loading.fingerprint.weights_fingerprint` (computed once)."""
    if loaded.fingerprint is None:
        loaded.fingerprint = weights_fingerprint(loaded.model)
    return loaded.fingerprint


def load_seed(seed: KVSeed, loaded: LoadedModel, kv: KVSettings, pace: Pace, *, room: int = 0) -> list[Any]:
    """The cache of ``seed``'s file, checked to belong to ``loaded`` and ``kv`` (on the worker thread).

    ``room``: positions left free after the tokens (``kv_file.load``).

    Raises:
        InvalidArgumentError: Another model's file, other KV settings, a cache
          that does not fit the model (one line each).
        KVFileError: A damaged file.
        Cancelled: A stop between two pieces of the read.
    """
    from .kv_file import load

    if seed.fingerprint != fingerprint(loaded):
        raise InvalidArgumentError(
            f"{seed.path} was saved from other weights ({seed.model}) than the loaded {loaded.source.key}: "
            "load the model it was saved from"
        )
    if seed.kv != kv.as_dict():
        raise InvalidArgumentError(f"{seed.path} holds a KV cache made with {seed.kv}, not {kv.as_dict()}")
    cache, _ = load(seed.path, pace, room=room)
    expected = kv.make_cache(loaded.model)
    if len(cache) != len(expected):
        raise InvalidArgumentError(
            f"{seed.path} holds {len(cache)} cache layers; {loaded.source.key} has {len(expected)}: a file of another model"
        )
    for layer in cache:
        offset = int(getattr(layer, "offset", 0) or 0)
        if offset != len(seed.tokens):
            raise InvalidArgumentError(
                f"{seed.path}: a cache layer holds {offset} tokens, its JSON says {len(seed.tokens)}; save it again"
            )
    return cache


__all__ = [
    "CHAT_FORMAT",
    "FORMAT",
    "META_KEY",
    "KVSeed",
    "Resume",
    "fingerprint",
    "generation_json",
    "load_seed",
    "read",
    "read_resume",
    "request_from_json",
    "request_to_json",
    "seed_of",
    "write",
]
