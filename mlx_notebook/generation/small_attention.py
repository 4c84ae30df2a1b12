"""A prefill chunk's attention without the fused kernel where its scores are small (CUDA).

MLX's CUDA backend runs a prefill chunk's fused attention through cuDNN,
which builds a graph for every new pair of query and key lengths: ~40 ms
each on an H200 (mlx 0.32.4; the first of a process 70-900 ms), while the
same shape again costs 0.3 ms and a matmul of a new shape ~2.5 ms
(``benchmarks/results/h200_first_use_probe_session16.*``). Each prefill
chunk is such a new pair in a fresh process, and its first layer pays the
build inside one piece of work, which a stop waits for: a fresh process's
first prompt was stopped within budget + 50 ms in 3-4 of 8 rounds.

Where the scores are small (a chunk's first ~1k positions), the same
attention as separate matmuls and a softmax costs well under a millisecond
and builds nothing, so here it runs that way. Bigger chunks keep the fused
kernel (their scores would not fit in memory as a whole). Only on the CUDA
backend, only for chunks of more than one query over a plain cache; every
other call goes to what was there before.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .attention_patch import route
from .chunks import builds_kernels_per_shape

# Largest score tensor computed unfused, in elements (64 MB in float32): a
# 512-token chunk at 1k positions with 32 heads.
MAX_SCORES = 1 << 24


def wanted() -> bool:
    """Whether fused attention builds per shape on this device: the CUDA backend (the chunk planner's test)."""
    return builds_kernels_per_shape()


def install(model: Any) -> bool:
    """Wrap the attention function of ``model``'s module; return whether it has one (idempotent)."""
    return route(model, "small", _unfused_when_small)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` as matmuls and a float32 softmax (grouped-query heads too).

    ``mask``: ``None``, ``"causal"`` (the queries are the last positions of
    the keys) or an array that broadcasts to ``(batch, heads, queries, keys)``
    (boolean: keep where true; else added to the scores).
    """
    b, heads, n, d = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    q = (queries * scale).reshape(b, kv_heads, groups, n, d)
    scores = (q @ keys[:, :, None].swapaxes(-1, -2)).astype(mx.float32)
    if isinstance(mask, str):
        keep = mx.arange(s)[None] <= (s - n + mx.arange(n))[:, None]
        scores = mx.where(keep, scores, -mx.inf)
    elif mask is not None:
        m = _grouped(mask, kv_heads, groups)
        scores = mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m.astype(mx.float32)
    weights = mx.softmax(scores, axis=-1).astype(values.dtype)
    return (weights @ values[:, :, None]).reshape(b, heads, n, values.shape[-1])


def _grouped(mask: mx.array, kv_heads: int, groups: int) -> mx.array:
    """A ``(..., heads or 1, n, s)`` mask as ``(..., kv_heads, groups or 1, n, s)``."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:])


def _unfused_when_small(
    queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any
) -> mx.array | None:
    n = queries.shape[2]
    if (
        n == 1
        or sinks is not None
        or hasattr(cache, "bits")
        or not isinstance(keys, mx.array)
        or (isinstance(mask, str) and mask != "causal")
        or queries.shape[0] * queries.shape[1] * n * keys.shape[2] > MAX_SCORES
    ):
        return None
    return attend(queries, keys, values, scale, mask)


__all__ = ["MAX_SCORES", "attend", "install", "wanted"]
