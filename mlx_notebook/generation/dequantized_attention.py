"""Attention over a quantized KV cache where MLX has no usable kernel for it: the CUDA backend.

mlx-lm attends over a ``QuantizedKVCache`` with two ``quantized_matmul``
calls (``quantized_scaled_dot_product_attention``). On MLX's CUDA backend
(mlx 0.32.4) the first refuses the cache's keys, a strided slice of a buffer
grown in steps of 256 (``No implementation for problem shape``), in mlx-lm's
own ``stream_generate`` as in ours. Handed contiguous copies it runs, but at
2.26 tok/s decode and 71.5 tok/s prefill against 104 and 19,192 with bf16
(Qwen3-8B shape, 8k context, H200; docs/benchmarks.md, session 9).

Here each layer's keys and values are dequantized to the queries' dtype for
the call, and MLX's fused kernel attends over them. The cache itself stays
quantized, which is the memory ``kv_bits`` is for; the full-precision copy
of one layer exists only while that layer attends (it is an intermediate of
the step's graph, freed once the layer's attention has run). The values
differ from mlx-lm's quantized matmuls by rounding only: both attend over
the same dequantized numbers.

Only on the CUDA backend (the CPU and Metal run mlx-lm's own path): the
model's module keeps mlx-lm's function for every call whose cache is not
quantized.

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
    return wrap(model, "dequantized", _dequantizing)


def _dequantizing(original: Attention) -> Attention:
    def attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        bits = getattr(cache, "bits", None)
        if bits is None:  # not a quantized cache
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        group = cache.group_size
        k = mx.dequantize(*keys, group_size=group, bits=bits, dtype=queries.dtype)
        v = mx.dequantize(*values, group_size=group, bits=bits, dtype=queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)

    return attention


__all__ = ["install", "wanted"]
