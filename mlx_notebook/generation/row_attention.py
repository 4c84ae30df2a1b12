"""A batched decode step's attention in groups of rows, where a padded batch's mask is the slow path.

A batch of rows of different lengths is left-padded (mlx-lm's
``BatchKVCache``), so its decode steps pass ``scaled_dot_product_attention``
an array mask. MLX's CUDA backend runs its fused one-query kernel
(``sdpa_vector``) only without an array mask; with one it falls back to
separate matmuls and a softmax, which cost ~0.07 ms per 1,000 positions per
layer for 8 rows on an H200 (Qwen3-8B heads: 0.57 ms at 8k, 1.1 ms at 16k)
against 0.08-0.14 ms unmasked. Once a long prompt joins short rows, every
step pays it in each of 36 layers (a step of 7 rows of 1k and one of 8k took
~35 ms against ~12 ms before the join).

Rows of one padding need no mask over their own positions, so a padded
step's attention runs as a few calls, one per group of rows: a group of
equal paddings is one fused call over its positions, a group of different
ones a masked call over the positions of its longest row. Which rows go
together is chosen per batch by a cost model fitted to session 12's H200
table (:func:`plan`): one call costs ~0.03 ms whatever it does, a masked
call ~0.0085 ms per row and 1,000 positions on top, an unmasked one
~0.0006. Seven rows of one length and a joined 8k prompt take two fused
calls (~0.07 ms a layer) where one call per row took 0.36-0.45 ms and the
masked call 0.57; rows of many lengths under ~4k positions stay one masked
call, as before. Rows of one length (no padding) are one fused call.

On the CPU MLX has no fused kernel: masked or not, attention is matmuls and
a softmax over every position a call reads, so a short row padded to a
joined long prompt's length reads all of it. There a call costs ~0.1 ms and
every row and 1,000 positions ~0.3 ms (:data:`CPU_COSTS`): three rows of 64
tokens and a joined 3,000-token prompt (the default model) stepped in 158-164
ms split against 249-262 ms masked. Not on Metal: its fused kernel takes the mask itself.

The model's module keeps mlx-lm's own function for everything else:
:func:`install` wraps the module's ``scaled_dot_product_attention``, and the
wrapper acts only on a cache layer that carries ``row_plan`` (set by the
decode batch for its steps) and a single query position.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from .attention_patch import route
from .chunks import KV_STEP, builds_kernels_per_shape


@dataclass(frozen=True)
class Costs:
    """What a layer's attention costs, ms: any call, then per row and 1,000 positions masked, unmasked, gathered."""

    call: float
    masked: float
    unmasked: float
    gather: float


# Fitted to session 12's H200 table (8 rows, Qwen3-8B heads;
# benchmarks/results/h200_sdpa_mask_session12.jsonl). They reproduce its
# crossover: one masked call for 8 rows of different lengths up to ~4k
# positions, a call per row beyond. Gathering rows that are not neighbours in
# the batch is not in the table: its cost is its memory traffic (keys and
# values, 4 KB a row and position for those heads, read and written at ~3 TB/s).
CUDA_COSTS = Costs(call=0.03, masked=0.0085, unmasked=0.0006, gather=0.0025)
# This 2-core CPU, SmolLM2-135M's heads (9 / 3 / 64, fp32; session 43): a call
# 0.10 ms, every row and 1,000 positions 0.25-0.40 ms masked or not, a gather of
# two rows' keys and values 0.12-0.4 ms per row and 1,000 positions. Bigger
# heads cost more per position for the same call, so a split pays sooner there.
CPU_COSTS = Costs(call=0.1, masked=0.33, unmasked=0.3, gather=0.3)
# Keys above which MLX 0.32's CUDA backend runs a one-token query in two passes (``sdpa_vector_fallback``: kL > 1024).
VECTOR_TWO_PASS_ABOVE = 1024


@dataclass(frozen=True)
class Group:
    """Rows attended by one call: their batch indices (ascending), the first position read, and their pads."""

    rows: tuple[int, ...]
    start: int
    pads: tuple[int, ...]

    @property
    def masked(self) -> bool:
        return any(p != self.start for p in self.pads)


def wanted() -> bool:
    """Whether a padded step's attention reads every row's padding: the CUDA backend (its fused kernel refuses masks) and the CPU."""
    return builds_kernels_per_shape() or mx.default_device().type == mx.cpu


def costs() -> Costs:
    """This device's attention costs (the CPU's, or CUDA's)."""
    return CPU_COSTS if mx.default_device().type == mx.cpu else CUDA_COSTS


def install(model: Any) -> bool:
    """Wrap the attention function of ``model``'s module; return whether it has one (idempotent)."""
    return route(model, "rows", _grouped)


def plan(pads: list[int], positions: int, cost: Costs | None = None) -> list[Group] | None:
    """The cheapest split of a step's rows into calls, or ``None`` where one masked call (mlx-lm's) is it.

    ``positions``: the keys each row's query sees, padding included. Rows
    are ordered by padding and cut into runs (every best split is such a
    run: a group's cost grows with its longest row and its spread). Made
    again when the rows change or every ``KV_STEP`` positions: 32 rows take
    ~1 ms of host time to plan. ``cost``: the device's own (:func:`costs`) where not given.
    """
    return _plan(tuple(pads), (positions + KV_STEP - 1) // KV_STEP * KV_STEP, cost or costs())


@lru_cache(maxsize=64)
def _plan(pads: tuple[int, ...], positions: int, cost: Costs) -> list[Group] | None:
    if not any(pads):
        return [Group(tuple(range(len(pads))), 0, tuple(pads))]
    order = sorted(range(len(pads)), key=lambda i: pads[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for begin in range(end):
            rows = order[begin:end]
            total = best[begin] + _cost(rows, pads, positions, cost)
            if total < best[end]:
                best[end], cut[end] = total, begin
    groups = []
    end = n
    while end:
        rows = sorted(order[cut[end] : end])
        groups.append(Group(tuple(rows), min(pads[i] for i in rows), tuple(pads[i] for i in rows)))
        end = cut[end]
    if len(groups) == 1 and groups[0].masked:
        return None
    # In the batch's order, not the pads': where every group is a run of neighbours (seven rows and the
    # prompt that joined them at the end), their outputs concatenate in the rows' order, with no gather
    # after them in each layer (the pads' order put the joined row first: 36 gathers a step on Qwen3-8B).
    return sorted(groups, key=lambda g: g.rows[0])


def _cost(rows: list[int], pads: tuple[int, ...], positions: int, cost: Costs) -> float:
    span = (positions - min(pads[i] for i in rows)) / 1000
    masked = any(pads[i] != pads[rows[0]] for i in rows)
    total = cost.call + (cost.masked if masked else cost.unmasked) * len(rows) * span
    if max(rows) - min(rows) + 1 != len(rows):
        total += cost.gather * len(rows) * span
    return total


def mark(cache: list[Any], pads: list[int] | None) -> None:
    """Give every layer of a batch's cache the plan of its next step (``pads=None``: the masked call).

    ``pads``: the rows' paddings. A plan is made once per step for all layers.
    """
    apply(cache, plan(pads, cache[0]._idx + 1) if pads is not None and cache else None)


def apply(cache: list[Any], groups: list[Group] | None) -> None:
    """Set ``groups`` (every row once) as the plan of the next step of ``cache``; ``None``: the masked call."""
    order = None
    if groups is not None:
        flat = [i for g in groups for i in g.rows]
        if flat != sorted(flat):
            order = mx.array([flat.index(i) for i in range(len(flat))], dtype=mx.uint32)
    for layer in cache:
        layer.row_plan = (groups, order) if groups is not None else None


def warm(heads: int, kv_heads: int, dim: int, dtype: Any) -> None:
    """Run each way a batch's step is split once, on a small batch: the first use of its kernels is paid here.

    The first split step of a process paid a one-off ~9 ms on an H100 (8
    rows of Qwen3-8B heads: 9.83 ms, then 0.33-0.47, also at a new buffer
    length; ``benchmarks/results/h100_probe_session40.log``): rows of one
    padding decode as one call, so the split first comes when a prompt joins
    them, inside the others' gap. Three rows over a buffer with room, as a
    batch's cache hands them: groups of neighbours (a group of several rows
    and one of a single row), a group gathered out of order, and a masked
    one. The single row reads more than :data:`VECTOR_TWO_PASS_ABOVE`
    positions, as a joined long prompt does: MLX's CUDA backend runs such a
    one-token query with another pair of kernels (``sdpa_vector_2pass``),
    which rows of short prompts never meet before a join.
    """
    q = mx.zeros((3, heads, 1, dim), dtype=dtype)
    used = VECTOR_TWO_PASS_ABOVE + 8
    k = mx.zeros((3, kv_heads, used + 8, dim), dtype=dtype)[..., :used, :]
    layer = SimpleNamespace()  # a cache layer as _grouped reads it: its row_plan
    outs = []
    for groups in (
        [Group((0, 1), 8, (8, 8)), Group((2,), 0, (0,))],
        [Group((0, 2), 8, (8, 8)), Group((1,), 0, (0,))],
        [Group((0, 1), 8, (8, 10)), Group((2,), 0, (0,))],
    ):
        apply([layer], groups)
        outs.append(_grouped(q, k, k, layer, dim**-0.5, None, None))
    mx.eval(outs)


def _grouped(
    queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any
) -> mx.array | None:
    row_plan = getattr(cache, "row_plan", None)
    if row_plan is None or queries.shape[2] != 1 or sinks is not None:
        return None
    groups, order = row_plan
    outs = [_attend_group(g, queries, keys, values, scale) for g in groups]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return out if order is None else out[order]


def _attend_group(g: Group, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """One group's call. A group of every row starts at 0 (the longest row has no padding): MLX's
    cuDNN decode path takes a slice of all of a buffer's rows as read from its first position."""
    first, last = g.rows[0], g.rows[-1]
    if last - first + 1 == len(g.rows):
        q, k, v = (
            queries[first : last + 1],
            keys[first : last + 1, :, g.start :],
            values[first : last + 1, :, g.start :],
        )
    else:
        index = mx.array(g.rows, dtype=mx.uint32)
        q, k, v = queries[index], keys[index, :, g.start :], values[index, :, g.start :]
    if not g.masked:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    # Row r sees its own positions: from its pad on (the group reads from its smallest).
    offsets = mx.array([p - g.start for p in g.pads], dtype=mx.int32)
    keep = mx.arange(k.shape[2], dtype=mx.int32)[None] >= offsets[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep[:, None, None, :])


__all__ = ["CPU_COSTS", "CUDA_COSTS", "Costs", "Group", "apply", "costs", "install", "mark", "plan", "wanted", "warm"]
