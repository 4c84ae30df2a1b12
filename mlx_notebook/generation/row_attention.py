"""A batched decode step's attention row by row, where a padded batch's mask is the slow path.

A batch of rows of different lengths is left-padded (mlx-lm's
``BatchKVCache``), so its decode steps pass ``scaled_dot_product_attention``
an array mask. MLX's CUDA backend runs its fused one-query kernel
(``sdpa_vector``) only without an array mask; with one it falls back to
separate matmuls and a softmax, which cost ~0.07 ms per 1,000 positions per
layer for 8 rows on an H200 (Qwen3-8B heads: 0.57 ms at 8k, 1.1 ms at 16k)
against 0.08-0.14 ms unmasked. Once a long prompt joins short rows, every
step pays it in each of 36 layers (a step of 7 rows of 1k and one of 8k took
~35 ms against ~12 ms before the join).

Each row's own positions (after its padding) need no mask, so here a
padded step's attention is one fused call per row: 0.36 ms at 8k, 0.45 ms
at 16k for 8 rows, and the same numbers as the masked call. Eight calls
cost more than one below ~4k positions (0.19 against 0.10 ms at 1k), so
only longer batches go row by row. Rows of one length (no padding) need
no mask at all: one fused call (0.04 against 0.10 ms at 1k). Only on the
CUDA backend: Metal's fused kernel takes the mask itself.

The model's module keeps mlx-lm's own function for everything else:
:func:`install` wraps the module's ``scaled_dot_product_attention``, and the
wrapper acts only on a cache layer that carries ``row_pads`` (set by the
decode batch for its steps) and a single query position.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .attention_patch import route
from .chunks import builds_kernels_per_shape

# Positions from which a padded batch's step attends row by row (measured
# crossover on an H200: masked 0.30 vs rows 0.26 ms at 4k, 0.17 vs 0.42 at 2k).
MIN_POSITIONS = 4096


def wanted() -> bool:
    """Whether this device's fused attention refuses masks: the CUDA backend (the same test as the chunk planner's)."""
    return builds_kernels_per_shape()


def install(model: Any) -> bool:
    """Wrap the attention function of ``model``'s module; return whether it has one (idempotent)."""
    return route(model, "rows", _row_by_row)


def _row_by_row(
    queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any
) -> mx.array | None:
    pads = getattr(cache, "row_pads", None)
    if pads is None or queries.shape[2] != 1 or sinks is not None:
        return None
    if not any(pads):
        # Rows of one length: the mask hides nothing, and one fused call does it all.
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)
    return mx.concatenate(
        [
            mx.fast.scaled_dot_product_attention(
                queries[i : i + 1], keys[i : i + 1, :, pad:], values[i : i + 1, :, pad:], scale=scale
            )
            for i, pad in enumerate(pads)
        ]
    )


def mark(cache: list[Any], pads: list[int] | None) -> None:
    """Give every layer of a batch's cache its rows' paddings (``None``: the masked call)."""
    for layer in cache:
        layer.row_pads = pads


__all__ = ["MIN_POSITIONS", "install", "mark", "wanted"]
