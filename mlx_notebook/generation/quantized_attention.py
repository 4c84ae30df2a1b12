"""Attention over a quantized KV cache on MLX's CUDA backend: the cache's whole buffer, its unused tail masked.

mlx-lm attends over a ``QuantizedKVCache`` with two ``quantized_matmul``
calls (``quantized_scaled_dot_product_attention``) on the keys and values
``update_and_fetch`` returns: ``buffer[..., :offset, :]``, a strided slice of
a buffer grown in steps of 256. MLX's CUDA ``quantized_matmul`` (mlx 0.32.4)
has no kernel for such a slice (``No implementation for problem shape``),
so there mlx-lm's own ``stream_generate`` fails at its first step with
``kv_bits``; handed contiguous copies it runs (a copy of the layer's cache
per call).

Here the same two matmuls take the cache's whole buffer, which is
contiguous, and the positions past ``offset`` (at most 255, zeros) are
masked out of the scores, so no copy is made and the numbers are mlx-lm's:
the kept positions' scores, softmax and weighted sum are the same operations
on the same data. The cache stays quantized, which is the memory ``kv_bits``
is for. Only on the CUDA backend: the CPU and Metal take mlx-lm's path, and
the model's module keeps mlx-lm's function for every call whose cache is
not quantized.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .attention_patch import Attention, wrap
from .chunks import builds_kernels_per_shape


def wanted() -> bool:
    """Whether this device needs the route: MLX's CUDA backend (the same test as the chunk planner's)."""
    return builds_kernels_per_shape()


def install(model: Any) -> bool:
    """Route ``model``'s attention over quantized caches through here; return whether it could (idempotent)."""
    return wrap(model, "quantized", _over_whole_buffer)


def _over_whole_buffer(original: Attention) -> Attention:
    def attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        if getattr(cache, "bits", None) is None or sinks is not None:
            # Not a quantized cache; or sinks, which mlx-lm refuses over one in one line.
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return whole_buffer_attention(queries, cache, scale, mask)

    return attention


def whole_buffer_attention(queries: mx.array, cache: Any, scale: float, mask: Any) -> mx.array:
    """mlx-lm's quantized attention over ``cache``'s whole key and value buffers, after ``update_and_fetch``."""
    batch, n_heads, length, dim = queries.shape
    keys, values = cache.keys, cache.values
    n_kv_heads, capacity = keys[0].shape[-3], keys[0].shape[-2]
    repeats = n_heads // n_kv_heads
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(batch, n_kv_heads, repeats, length, dim)
        keys = tuple(mx.expand_dims(x, -3) for x in keys)
        values = tuple(mx.expand_dims(x, -3) for x in values)
    group, bits = cache.group_size, cache.bits
    scores = mx.quantized_matmul(queries, *keys, transpose=True, group_size=group, bits=bits)
    allowed = _allowed(mask, cache.offset, length, capacity, repeats)
    if allowed.dtype == mx.bool_:
        scores = mx.where(allowed, scores, mx.finfo(scores.dtype).min)
    else:
        scores = scores + allowed
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *values, transpose=False, group_size=group, bits=bits)
    return out.reshape(batch, n_heads, length, -1) if repeats > 1 else out


def _allowed(mask: Any, offset: int, length: int, capacity: int, repeats: int) -> mx.array:
    """The key positions each query may attend to, over the whole buffer (boolean, or additive for a float mask)."""
    positions = mx.arange(capacity)
    if mask is None:
        return positions < offset
    if isinstance(mask, str):  # "causal": the queries are the last `length` of `offset` positions
        return positions[None] <= mx.arange(offset - length, offset)[:, None]
    # An array mask over the `offset` kept positions: the tail is masked too.
    tail = [(0, 0)] * (mask.ndim - 1) + [(0, capacity - mask.shape[-1])]
    if mask.dtype == mx.bool_:
        padded = mx.pad(mask, tail, constant_values=False)
    else:
        padded = mx.pad(mask, tail, constant_values=mx.finfo(mask.dtype).min)
    return mx.expand_dims(padded, -3) if repeats > 1 and padded.ndim > 3 else padded


__all__ = ["install", "wanted", "whole_buffer_attention"]
