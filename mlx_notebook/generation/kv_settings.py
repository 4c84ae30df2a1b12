"""A generation's KV cache settings: quantized keys and values, or a rotating (bounded) cache.

On the Macs people run MLX on, the KV cache of a long context is what runs
out of memory (a Qwen3-8B shape holds ~144 KB of bf16 KV per token). mlx-lm's
``generate_step`` takes four settings for it, used here with the same names,
meanings and defaults:

- ``kv_bits``: quantize keys and values to this many bits (``None``: keep the
  model's dtype), in groups of ``kv_group_size`` values, once the cache holds
  ``quantized_kv_start`` tokens (mlx-lm's ``maybe_quantize_kv_cache``);
- ``max_kv_size``: a rotating cache of at most that many tokens (the first 4
  are kept, older ones are overwritten: ``RotatingKVCache``).

mlx-lm converts the cache after each model call; here it is converted before
the next one (never before the first), which is the same cache at every call
(the condition reads the same offset) and lets a step built ahead be undone
on pause (its forward quantized only what the uninterrupted run's would
have). A saved cache is written as it is; the next call converts it if due.

On MLX's CUDA backend (mlx 0.32.4) mlx-lm's quantized attention fails on
the cache's strided slices; there each layer is attended over dequantized
(:mod:`.quantized_attention`).

Rows with either setting decode alone: mlx-lm batches plain ``KVCache``
layers only (there is no batched quantized cache, and a rotating row's
positions cannot be left-padded beside others). A prefix-cache entry keeps
its settings; a hit needs the same ones (:meth:`KVSettings.key`).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# mlx-lm's defaults (generate_step).
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
# mx.quantize's widths and group sizes.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
# RotatingKVCache keeps the first tokens (the attention sinks) of every window.
ROTATING_KEEP = 4


@dataclass(frozen=True)
class KVSettings:
    """How one generation's KV cache is kept.

    Args:
        bits: ``kv_bits``; ``None`` keeps the model's dtype. Default: ``None``.
        group_size: ``kv_group_size``. Default: ``DEFAULT_KV_GROUP_SIZE`` (64).
        quantized_start: ``quantized_kv_start``. Default: ``DEFAULT_QUANTIZED_KV_START`` (5000).
        max_size: ``max_kv_size``; ``None``: unbounded. Default: ``None``.
    """

    bits: int | None = None
    group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_start: int = DEFAULT_QUANTIZED_KV_START
    max_size: int | None = None

    @classmethod
    def of(cls, request: Any) -> KVSettings:
        """The settings of a :class:`~.request.GenerationRequest`."""
        return cls(request.kv_bits, request.kv_group_size, request.quantized_kv_start, request.max_kv_size)

    @property
    def plain(self) -> bool:
        """Whether the cache is the model's own (unquantized, unbounded): rows batch only then."""
        return self.bits is None and self.max_size is None

    def key(self) -> tuple[Any, ...]:
        """What a prefix-cache hit must match (group size and start matter only when quantized)."""
        if self.bits is None:
            return (None, None, None, self.max_size)
        return (self.bits, self.group_size, self.quantized_start, self.max_size)

    def make_cache(self, model: Any) -> list[Any]:
        """A new, empty cache for ``model`` with these settings.

        mlx-lm's ``make_prompt_cache(model, max_kv_size)`` ignores
        ``max_kv_size`` for every model with its own ``make_cache`` (llama,
        qwen3, gemma... in mlx-lm 0.32.2): its plain ``KVCache`` layers are made
        rotating here instead; layers the model already bounds (sliding
        windows) stay as it made them.
        """
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        cache = make_prompt_cache(model)
        if self.max_size is not None:
            cache = [
                RotatingKVCache(max_size=self.max_size, keep=ROTATING_KEEP) if type(layer) is KVCache else layer
                for layer in cache
            ]
        return cache

    def quantize(self, cache: list[Any]) -> None:
        """Quantize the layers of ``cache`` that are due (in place), as mlx-lm does after each call."""
        if self.bits is None:
            return
        for i, layer in enumerate(cache):
            # Not before the first call (offset 0): mlx-lm's first call runs on the plain cache,
            # and quantizes after it, however small quantized_kv_start is.
            if hasattr(layer, "to_quantized") and layer.offset > 0 and layer.offset >= self.quantized_start:
                cache[i] = layer.to_quantized(group_size=self.group_size, bits=self.bits)

    def describe(self) -> str:
        """A few words for the stats line, e.g. ``"kv 8-bit"``, ``"kv window 4096"``; ``""`` when plain."""
        parts = []
        if self.bits is not None:
            parts.append(f"kv {self.bits}-bit")
        if self.max_size is not None:
            parts.append(f"kv window {self.max_size}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The request fields (mlx-lm's names), for a saved file."""
        return {
            "kv_bits": self.bits,
            "kv_group_size": self.group_size,
            "quantized_kv_start": self.quantized_start,
            "max_kv_size": self.max_size,
        }


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes of keys and values ``cache`` holds (quantized data, scales and biases included)."""
    total = 0
    for layer in cache:
        try:
            total += int(layer.nbytes)
        except (AttributeError, TypeError):  # an empty layer of some cache types
            continue
    return total


__all__ = [
    "DEFAULT_KV_GROUP_SIZE",
    "DEFAULT_QUANTIZED_KV_START",
    "KV_BITS",
    "KV_GROUP_SIZES",
    "KVSettings",
    "cache_nbytes",
]
