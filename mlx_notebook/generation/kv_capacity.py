"""How many positions a decode step's KV buffers hold, chosen so that MLX's CUDA attention builds few graphs.

MLX 0.32's CUDA backend runs a one-token query through cuDNN only when the
keys are a slice of a buffer whose length is a multiple of 256 (mlx-lm's
``KVCache.step``), and builds a cuDNN graph for every (rows, buffer length)
it meets, inside the step that meets it: 70-90 ms, at times 680-770 ms, on
an H200 (Qwen3-8B shape). mlx-lm grows its buffers 256 positions at a time,
so a fresh process's generation stalled at every 256th token (positions
512, 768, 1024, 1280: 769, 680, 79, 81 ms against 8-12 ms steps), and a
batch again whenever its rows changed. Any other buffer length takes MLX's
vector kernel, which builds nothing. Its speed against cuDNN's, 36 calls (a
step's worth), Qwen3-8B heads: 1 row at 1k / 4k / 8k / 32k positions 0.88 /
1.60 / 2.22 / 6.15 ms against 1.19 / 1.50 / 1.52 / 1.83 ms; 8 rows at 1k /
4k / 8k 2.06 / 6.69 / 11.7 ms against 1.89 / 2.74 / 3.57 ms
(``benchmarks/results/h200_kernel_ab_qwen3-8b_session20.log``). So the
vector kernel costs about as much as the keys it reads, and cuDNN little
more at 32k than at 1k.

So on CUDA a buffer whose rows times positions stay below
:data:`VECTOR_BELOW` gets a length off the 256 grid (the vector kernel,
never a build; at most ~0.7 ms a step slower, at 8k positions, 1 row), and
a larger one a length from a fixed ladder on the grid (:func:`rung`: four
rungs per doubling), so a generation builds a graph per rung, not per 256
positions, and later generations of the process find the rungs built.
Elsewhere (the CPU, Metal) buffers grow by mlx-lm's ``KVCache.step``, but a
layer at a time (:func:`make_room`).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .chunks import KV_STEP, builds_kernels_per_shape, with_room

# Rows x positions below which a decode buffer is laid out for the vector kernel (see the module docstring).
VECTOR_BELOW = 8192
# Added to a rung to take it off the grid: any length not a multiple of KV_STEP would do.
OFF_GRID = 8


def rung(n: int) -> int:
    """The smallest ladder length >= ``n``: multiples of ``KV_STEP`` up to 1,024, then 4 rungs per doubling."""
    step = max(KV_STEP, 1 << max(0, (n - 1).bit_length() - 3))
    return max(KV_STEP, (n + step - 1) // step * step)


def capacity(needed: int, rows: int = 1, *, per_shape: bool | None = None) -> int:
    """Positions to allocate for a decode buffer of ``rows`` rows that must hold ``needed``.

    ``per_shape``: whether the device builds attention graphs per shape
    (default: :func:`~.chunks.builds_kernels_per_shape`).
    """
    if not _per_shape(per_shape):
        return with_room(needed, 0)
    return rung(needed) + OFF_GRID if rows * needed < VECTOR_BELOW else rung(needed)


def fits(length: int, needed: int, rows: int = 1, *, per_shape: bool | None = None) -> bool:
    """Whether a buffer of ``length`` positions serves ``needed`` as :func:`capacity` lays it out.

    Off the grid any length that holds ``needed`` will do (nothing is built
    per length); on it, only a rung.
    """
    if length < needed:
        return False
    if not _per_shape(per_shape):
        return True
    if rows * needed < VECTOR_BELOW:
        return length % KV_STEP != 0
    return rung(length) == length


def make_room(cache: list[Any], n: int, *, per_shape: bool | None = None) -> None:
    """Give each plain layer of ``cache`` room for ``n`` more positions, laid out by :func:`capacity` (lazy).

    Only mlx-lm's own ``KVCache`` and ``BatchKVCache`` layers are touched
    (quantized and rotating ones keep their own layout); a layer whose
    buffer already fits is left alone, so most steps cost a comparison per
    layer. Layer ``i`` of ``L`` grows ``L - 1 - i`` positions before it must
    (:func:`lead`), so a decode crossing a buffer's end grows one layer a step
    over ``L`` steps, not all of them in one: mlx-lm grows every layer in the
    step that runs out of room, a copy of the whole cache, and holds every
    layer's old and new buffers at once. On this 2-core CPU, 4 rows decoding,
    the rows' longest gap between two tokens fell from 272-289 ms to
    171-203 (the default model, steps ~115 ms) and from 1,177-1,220 ms to
    487-549 (a Qwen3-0.6B shape, steps ~330 ms), throughput alike
    (``benchmarks/results/cpu_staggered_growth_session48.*``).
    """
    from mlx_lm.models.cache import BatchKVCache, KVCache  # imported here: mlx-lm takes ~1.3 s to import

    per = _per_shape(per_shape)
    plain: list[Any] = [
        layer for layer in cache if (type(layer) is KVCache or type(layer) is BatchKVCache) and layer.keys is not None
    ]
    for i, layer in enumerate(plain):
        used = layer._idx if type(layer) is BatchKVCache else layer.offset
        rows = layer.keys.shape[0]
        needed = used + n + lead(i, len(plain))
        if fits(layer.keys.shape[2], needed, rows, per_shape=per):
            continue
        length = capacity(needed, rows, per_shape=per)
        layer.keys, layer.values = (grown(a, used, length) for a in (layer.keys, layer.values))


def grown(a: Any, n: int, size: int) -> Any:
    """The first ``n`` positions of ``a`` (axis 2) in a new buffer of ``size`` positions (lazy).

    ``a`` may be a quantized cache's ``(data, scales, biases)``: each is cut and grown alike.
    """
    if isinstance(a, (tuple, list)):
        return tuple(grown(x, n, size) for x in a)
    return mx.concatenate([a[..., :n, :], mx.zeros((*a.shape[:2], size - n, a.shape[3]), a.dtype)], axis=2)


def lead(i: int, layers: int) -> int:
    """Positions ahead of need that layer ``i`` of ``layers`` grows (:func:`make_room`): the first layers first.

    Below ``KV_STEP``, the least a buffer grows by, so each layer still grows
    once per crossing.
    """
    return min(layers - 1 - i, KV_STEP - 1)


def _per_shape(per_shape: bool | None) -> bool:
    return builds_kernels_per_shape() if per_shape is None else per_shape


__all__ = ["VECTOR_BELOW", "capacity", "fits", "grown", "lead", "make_room", "rung"]
