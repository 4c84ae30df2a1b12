"""Attention over a quantized KV cache on MLX's CUDA backend: a fused kernel per decode step, dequantized layers in prefill.

mlx-lm attends over a ``QuantizedKVCache`` with two ``quantized_matmul``
calls (``quantized_scaled_dot_product_attention``) on the keys and values
``update_and_fetch`` returns: ``buffer[..., :offset, :]``, a strided slice of
a buffer grown in steps of 256. MLX's CUDA ``quantized_matmul`` (mlx 0.32.4)
has no kernel for such a slice (``No implementation for problem shape``),
so there mlx-lm's own ``stream_generate`` fails at its first step with
``kv_bits``. Measured per layer on an H200 (Qwen3-8B heads, one query,
32k keys; ``benchmarks/results/h200_dequantize_routes_session13.json``):

- mlx-lm's matmuls on contiguous copies of the slices: 0.75 ms (8-bit),
  0.98 ms (4-bit); on the whole buffer with its tail masked: no faster;
- dequantizing the slices, then the fused kernel (here): 0.50 / 0.34 ms,
  against 0.17 ms for the same attention over a bf16 cache.

The dequantized route is also the accurate one: against fp32 attention over
the same dequantized numbers its largest error was 0.004, mlx-lm's CUDA
matmuls' 1.6 (bf16 scores; ``h200_quantized_attention_routes_session13.json``).

A decode step (one query position, no mask) goes further: the fused kernel
of :mod:`.quantized_decode_kernel` reads the packed slices in place, with no
full-precision copy at all: 0.10-0.11 ms per layer at 32k against the
dequantized route's 0.27 (8-bit) and 0.18 ms (4-bit)
(``h200_quantized_decode_kernel_session14.json``). Prefill chunks (many
query positions, a causal mask) keep the dequantized route, whose cost the
chunk's tokens share.

The cache itself stays quantized, which is the memory ``kv_bits`` is for;
in the dequantized route the full-precision copy of one layer's keys and
values is an intermediate of the step's graph, freed once that layer has
attended. Only on the CUDA backend: the CPU and Metal take mlx-lm's path,
and the model's module keeps mlx-lm's function for every call whose cache
is not quantized.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import quantized_decode_kernel
from .attention_patch import route
from .chunks import builds_kernels_per_shape

# A decode step (one query position) reads the packed cache in one fused
# kernel (quantized_decode_kernel); off only for benchmarks' A/B runs.
fused_decode = True


def wanted() -> bool:
    """Whether this device needs the route: MLX's CUDA backend (the same test as the chunk planner's)."""
    return builds_kernels_per_shape()


def install(model: Any) -> bool:
    """Route ``model``'s attention over quantized caches through here; return whether it could (idempotent)."""
    return route(model, "quantized", _dequantizing)


def _dequantizing(
    queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any
) -> mx.array | None:
    bits = getattr(cache, "bits", None)
    if bits is None:  # not a quantized cache
        return None
    group = cache.group_size
    # One query position needs no mask ("causal" over one row is none).
    unmasked = mask is None or isinstance(mask, str)
    if (
        fused_decode
        and unmasked
        and sinks is None
        and quantized_decode_kernel.available()
        and quantized_decode_kernel.supports(queries, keys, values, bits, group)
    ):
        return quantized_decode_kernel.attend(queries, keys, values, scale, group, bits)
    k = _dequantized(keys, group, bits, queries.dtype)
    v = _dequantized(values, group, bits, queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def _dequantized(packed: Any, group: int, bits: int, dtype: mx.Dtype) -> mx.array:
    """One layer's keys or values, ``(data, scales, biases)`` as the cache holds them, in ``dtype``."""
    data, scales, biases = packed
    return mx.dequantize(data, scales, biases, group_size=group, bits=bits, dtype=dtype)


__all__ = ["install", "wanted"]
