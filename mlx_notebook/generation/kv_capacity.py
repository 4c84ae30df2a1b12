"""How many positions a decode step's KV buffers hold, chosen so that MLX's CUDA attention builds few graphs.

MLX 0.32's CUDA backend runs a one-token query through cuDNN only when the
keys are a slice of a buffer whose length is a multiple of 256 (mlx-lm's
``KVCache.step``), and builds a cuDNN graph for every (rows, buffer length)
it meets: 72-90 ms each on an H200, Qwen3-8B shape, inside the step that
meets it (736 ms for a process's first). mlx-lm grows its buffers 256
positions at a time, so a fresh process's generation stalled once every 256
tokens, and a batch once more whenever its rows changed
(``benchmarks/results/h200_decode_kernel_session20.log``). Any other buffer
length takes MLX's vector kernel, which builds nothing per length. Measured
in the same process (1 row / 8 rows, synchronized steps, medians): at 1k
positions 9.4 against 9.7 ms / 17.4 against 20.5 ms (vector / cuDNN); at 8k
~12.6 against ~12.2 ms / 22.2 against 20.5 ms; at 32k 17.6 against 11 ms.

So on CUDA a decode buffer below :data:`FUSED_FROM` positions is given a
length off that grid (vector kernel, no build ever), and one at or above it
a length on the grid that grows by an eighth at a time (cuDNN's speed at
long context, a build per eighth instead of per 256 positions). Elsewhere
(the CPU, Metal) buffers stay as mlx-lm makes them.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

from .chunks import KV_STEP, builds_kernels_per_shape

# Positions from which cuDNN's decode attention is worth a graph per buffer length (see the module docstring).
FUSED_FROM = 16384
# Added to a grid length to take it off the grid: any length not a multiple of KV_STEP would do.
OFF_GRID = 8
# A buffer grows by this share of what it holds (at least KV_STEP): on the grid, one graph build per share;
# off it, one copy per share instead of one per KV_STEP.
GROWTH = 8


def capacity(needed: int, *, per_shape: bool | None = None) -> int:
    """Positions to allocate for a decode buffer that must hold ``needed``.

    ``per_shape``: whether the device builds attention graphs per shape
    (default: :func:`~.chunks.builds_kernels_per_shape`).
    """
    if not _per_shape(per_shape):
        return _on_grid(needed)
    grown = needed + max(KV_STEP, needed // GROWTH)
    return _on_grid(grown) + OFF_GRID if needed < FUSED_FROM else _on_grid(grown)


def fits(length: int, needed: int, *, per_shape: bool | None = None) -> bool:
    """Whether a buffer of ``length`` positions serves ``needed`` as :func:`capacity` would lay it out."""
    if length < needed:
        return False
    if not _per_shape(per_shape):
        return True
    return (length % KV_STEP != 0) == (needed < FUSED_FROM)


def make_room(cache: list[Any], n: int, *, per_shape: bool | None = None) -> None:
    """Give each plain layer of ``cache`` room for ``n`` more positions, laid out by :func:`capacity` (lazy).

    Only mlx-lm's own ``KVCache`` and ``BatchKVCache`` layers are touched
    (quantized and rotating ones keep their own layout); a layer whose
    buffer already fits is left alone, so most steps cost a comparison per
    layer. Without per-shape builds nothing is done: mlx-lm grows its buffers.
    """
    if not _per_shape(per_shape):
        return
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    for layer in cache:
        kind = type(layer)
        if (kind is not KVCache and kind is not BatchKVCache) or layer.keys is None:
            continue
        used = layer._idx if kind is BatchKVCache else layer.offset
        needed = used + n
        if fits(layer.keys.shape[2], needed, per_shape=True):
            continue
        length = capacity(needed, per_shape=True)
        layer.keys, layer.values = (
            mx.concatenate([a[..., :used, :], mx.zeros((*a.shape[:2], length - used, a.shape[3]), a.dtype)], axis=2)
            for a in (layer.keys, layer.values)
        )


def _on_grid(n: int) -> int:
    return (n + KV_STEP - 1) // KV_STEP * KV_STEP


def _per_shape(per_shape: bool | None) -> bool:
    return builds_kernels_per_shape() if per_shape is None else per_shape


__all__ = ["FUSED_FROM", "capacity", "fits", "make_room"]
