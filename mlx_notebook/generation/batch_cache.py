"""Rows of a batched KV cache: merge, drop, extract, without reading the device.

mlx-lm's ``BatchKVCache`` keeps each row's left padding as a device array, and
its ``filter`` and ``extract`` read it back to the host (``tolist``, one read
per layer). On a stream with a decode step queued, every such read waits for
that step: removing one sequence from a batch of 8 took 12-18 ms on an H200
(issue 11). The decode batch knows every row's padding on the host, so these
helpers do the same edits with the host copy and never synchronize.

Only plain ``KVCache`` layers are batched (the layouts of llama, qwen, mistral,
phi3, gemma without sliding windows); :func:`batchable` says whether a model's
cache is made of them.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import kv_capacity
from .chunks import KV_STEP

Cache = list[Any]
# mlx-lm is imported inside the functions: importing it takes ~1.3 s
# (transformers), which the first load does on a helper thread, stoppably.


def batchable(cache: Cache) -> bool:
    """Whether every layer of ``cache`` is a plain ``KVCache`` (rows can be merged and split)."""
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(layer) is KVCache for layer in cache)


def length(cache: Cache) -> int:
    """Tokens in a single sequence's cache."""
    return int(cache[0].offset) if cache else 0


def merge(caches: list[Cache]) -> tuple[Cache, list[int]]:
    """One batched cache from single-sequence caches (copies); return it and each row's left padding."""
    from mlx_lm.models.cache import BatchKVCache

    lengths = [length(c) for c in caches]
    top = max(lengths)
    merged = [BatchKVCache.merge(list(layers)) for layers in zip(*caches)]
    return merged, [top - n for n in lengths]


def extend(batch: Cache, pads: list[int], joining: list[Cache], reserve: Reserve | None = None) -> list[int]:
    """Append the single-sequence caches ``joining`` to ``batch`` as rows, in place; return the new paddings.

    Both sides are right-aligned at the longest row's end, the difference added
    to the shorter rows' padding, as ``BatchKVCache.extend`` does. Unlike it,
    each layer's keys and values are built in one allocation, with room for
    the next steps (:func:`capacity_for`): mlx-lm's ``extend`` pads both sides (two
    copies) and then concatenates them (a third), and leaves no room, so the
    first decode step after it grew the cache again, copying every row once
    more. On an H200 (Qwen3-8B shape, 7 rows of 1k joined by an 8k prompt,
    7.7 GB of new KV) those were 20-28 ms of extend and ~15 ms on the first
    step, both inside the other rows' gap between two tokens.

    The joining rows are copied from their own caches straight into those
    buffers, not merged into a batch of their own first (``BatchKVCache.merge``,
    ~6 ops a layer: no copy on the device, which shares a whole-array update,
    but host time inside the others' gap before the admit, 1.3 ms median on
    an H100 host, ``benchmarks/results/h100_pre_admit_anatomy_session56.txt``),
    and the offsets and paddings are the host's: an 8-row join of 36 layers
    queues 144 ops into the buffers reserved, not 432
    (``benchmarks/results/join_ops_probe_session57.py.txt``; host time on this
    CPU in ``join_host_probe_session57.py.txt``). The others' gap before the
    admit stayed as it was (a quiet H100, alternated: median 23.9 ms against
    23.0, ``h100_join_ab_session58.jsonl``): queuing beside an 8B step waits
    for MLX's commits in flight, whatever their count of ops.

    ``reserve``: buffers allocated ahead for exactly this join, used when they
    fit (:class:`Reserve`); else the allocation happens here.
    """
    size = batch[0]._idx
    lengths = [length(c) for c in joining]
    top = max([size, *lengths])
    rows = len(pads) + len(joining)
    capacity = capacity_for(top, rows)
    buffers = reserve.take(rows, capacity) if reserve is not None else None
    new_pads = [p + top - size for p in pads] + [top - n for n in lengths]
    for i, layer in enumerate(batch):
        extras = [c[i] for c in joining]
        if layer.keys is None or any(e.keys is None for e in extras):
            from mlx_lm.models.cache import BatchKVCache

            layer.extend(BatchKVCache.merge(extras))  # an empty side: nothing to copy (mlx-lm's own)
            continue
        keys_out = buffers.pop(0) if buffers else None
        values_out = buffers.pop(0) if buffers else None
        layer.keys = _joined(layer.keys, [e.keys for e in extras], size, lengths, top, capacity, keys_out)
        layer.values = _joined(layer.values, [e.values for e in extras], size, lengths, top, capacity, values_out)
        layer._idx = top
        _set_paddings(layer, new_pads)
    return new_pads


def _set_paddings(layer: Any, pads: list[int]) -> None:
    """A batch layer's paddings and offsets from the host's: no cut, shift or concatenate of its arrays to queue.

    A row's offset is its position, the layer's write index less the row's
    padding (what :func:`extract` cuts by). Written as constants, a join's
    offsets are no longer 3 kernels a layer inside the others' gap.
    """
    layer.offset = mx.array([layer._idx - p for p in pads])
    layer.left_padding = mx.array(pads)


class Reserve:
    """The buffers of a batch's cache after a prompt joins, allocated ahead, a layer at a time.

    The allocation is most of a join's extend when the memory is new (after
    the prefill's ``mx.clear_cache``): on an H200, 7 rows of 512 joined by an
    8k prompt (~10 GB of keys and values) took 18-39 ms to extend, against
    4-5 ms into buffers allocated ahead (``benchmarks/results/
    h200_admit_*_session19.log``). The session allocates a layer's buffers
    at each checkpoint of the joining prompt's prefill (:meth:`advance`), so
    the others' gaps each hold a sliver of it, not all of it in one step. A
    prompt fed in turn on the worker (the CPU, Apple GPUs) queues its sliver
    after their step at that checkpoint, so it runs before the prompt's next
    piece and is timed as the prompt's (:meth:`.Session.between`).

    Args:
        batch: The batch's cache now (its layers' head counts, sizes, dtype).
        rows: Rows after the join.
        top: Positions of the longest row after the join (the joining prompt's,
          when it is the longest: otherwise the batch keeps growing and no
          reservation is made).
    """

    def __init__(self, batch: Cache, rows: int, top: int) -> None:
        self.rows = rows
        self.capacity = capacity_for(top, rows)
        self._shapes = [
            ((rows, a.shape[1], self.capacity, a.shape[3]), a.dtype)
            for layer in batch
            if layer.keys is not None
            for a in (layer.keys, layer.values)
        ]
        self.buffers: list[mx.array] = []

    @property
    def done(self) -> bool:
        return len(self.buffers) == len(self._shapes)

    def advance(self, layers: int = 1) -> None:
        """Allocate the next ``layers`` layers' keys and values (queued on the stream; nothing waits)."""
        new = [
            mx.zeros(shape, dtype) for shape, dtype in self._shapes[len(self.buffers) : len(self.buffers) + 2 * layers]
        ]
        if new:
            mx.async_eval(new)
            self.buffers += new

    def take(self, rows: int, capacity: int) -> list[mx.array] | None:
        """The buffers made so far (the first layers'), handed over once, if the join is the one reserved for.

        The caller's slice updates write into them in place; the layers a
        short prefill left without buffers are allocated by the caller.
        """
        buffers, self.buffers = self.buffers, []
        if rows != self.rows or capacity != self.capacity:
            return None
        return buffers


def capacity_for(top: int, rows: int) -> int:
    """Positions a joined cache of ``rows`` rows holds when its longest has ``top``: room for ``KV_STEP`` steps.

    Laid out for the device's decode attention (:func:`.kv_capacity.capacity`):
    on the CPU the next multiple of mlx-lm's ``KVCache.step``, as mlx-lm grows it.
    With room for only one step, an 8k prompt joining filled its rung at once
    and the second joined step grew every layer (new buffers and a copy of
    all rows): on an H100 (Qwen3-8B shape, 8 rows) that step's build held the
    host 16-17 ms against 6-7 ms later, inside the others' gaps right after
    the join (``benchmarks/results/h100_admit_probe_session47.log``). The
    larger buffer is the one the batch would grow into a step later anyway.
    """
    return kv_capacity.capacity(top + 1 + KV_STEP, rows)


def _joined(
    a: mx.array,
    joining: list[mx.array],
    a_size: int,
    sizes: list[int],
    top: int,
    capacity: int,
    out: mx.array | None = None,
) -> mx.array:
    """Rows of ``a`` then one from each of ``joining``, their first ``a_size`` / ``sizes`` positions ending at ``top``.

    In a ``capacity`` buffer: ``out``, zeroed, when it was allocated ahead; it
    must have no other reference, so that the slice updates write into it,
    not a copy.
    """
    rows = a.shape[0]
    if out is None:
        out = mx.zeros((rows + len(joining), a.shape[1], capacity, a.shape[3]), a.dtype)
    out[:rows, :, top - a_size : top, :] = a[..., :a_size, :]
    for i, (b, n) in enumerate(zip(joining, sizes)):
        out[rows + i : rows + i + 1, :, top - n : top, :] = b[..., :n, :]
    return out


def keep_rows(batch: Cache, pads: list[int], keep: list[int]) -> list[int]:
    """Keep only rows ``keep`` (in that order) in place; return their paddings.

    Padding every kept row shares is cut off the front, as ``BatchKVCache.filter`` does,
    but before the rows are copied, so that only the positions kept are: when an 8k
    prompt left seven rows of ~600 on an H100 (Llama-3-8B), gathering the rows first
    (mlx-lm's order) copied every layer's whole capacity, 7.6 GB in 36 ms; cut first,
    a copy per run of neighbours took 1.1-1.8 ms (:func:`take_rows`).
    """
    shift = min(pads[i] for i in keep)
    new_pads = [pads[i] - shift for i in keep]
    for layer in batch:
        if layer.keys is not None:
            layer.keys = mx.contiguous(take_rows(layer.keys[..., shift:, :], keep))
            layer.values = mx.contiguous(take_rows(layer.values[..., shift:, :], keep))
        layer._idx -= shift
        _set_paddings(layer, new_pads)
    return new_pads


def take_rows(a: mx.array, keep: list[int]) -> mx.array:
    """``a``'s rows ``keep`` (its first axis), in that order: a slice per run of neighbours, a gather past three runs.

    A row's leave keeps the others (their caches, offsets, next tokens): MLX's
    CUDA backend compiles a gather with NVRTC at its first use for each dtype,
    once per machine, 2.1-2.2 s (an H100 with its PTX cache empty; session 43),
    and a machine's first leave of a row waited for it in the next step's
    queue. A run of neighbours is a view, a few runs one concatenate: the
    usual leave, one row out of a batch, is one or two runs.
    """
    runs: list[tuple[int, int]] = []
    for i in keep:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    if len(runs) == 1:
        return a[runs[0][0] : runs[0][1]]
    if len(runs) <= 3:
        return mx.concatenate([a[start:end] for start, end in runs], axis=0)
    return a[mx.array(keep)]


LayerState = tuple[mx.array | None, mx.array | None, int]


def snapshot(batch: Cache) -> list[LayerState]:
    """Each layer's ``(keys, values, write index)`` now: what :func:`extract` may cut rows from later.

    A step built (lazily) writes its position into the layers' arrays; a
    copy cut from them after that computes the whole step up to each layer.
    The write rewrites the layer's array object in place (``__setitem__``),
    so the snapshot holds views (``[:]``, no copy) of what they are now.
    Hold it only until that step is queued: while it holds the arrays the
    step's write cannot reuse their buffers, and copies them.
    """
    return [(_view(layer.keys), _view(layer.values), layer._idx) for layer in batch]


def _view(a: mx.array | None) -> mx.array | None:
    return a[:] if a is not None else None


def extract(batch: Cache, pads: list[int], row: int, state: list[LayerState] | None = None) -> Cache:
    """Row ``row`` as a single-sequence cache (a copy), as ``BatchKVCache.extract`` without the read-back.

    ``state``: a :func:`snapshot` of ``batch`` to cut from instead of its arrays now.
    """
    from mlx_lm.models.cache import KVCache

    out = []
    pad = pads[row]
    layers = state if state is not None else [(layer.keys, layer.values, layer._idx) for layer in batch]
    for keys, values, idx in layers:
        single = KVCache()
        if keys is not None and values is not None and idx > pad:
            single.keys = mx.contiguous(keys[row : row + 1, :, pad:idx])
            single.values = mx.contiguous(values[row : row + 1, :, pad:idx])
            single.offset = idx - pad
        out.append(single)
    return out


def warm(kv_heads: int, dim: int, dtype: mx.Dtype) -> None:
    """Run a row's leave once on a tiny batch of the model's cache shape: the first use of its kernels is paid here.

    With MLX's PTX cache empty (a machine's first process), an H100 paid 86-95 ms
    for a row's first copy out (:func:`extract`), 56-63 ms for a first
    concatenate, and 2.1-2.2 s for a first gather of a dtype; an 8k prompt's
    leave then held the others' next token 2.1 s. Tiny arrays pay them as big
    ones do (the kernels are built per dtype and layout, not per size).
    Seven rows, as a batch's cache hands them: one leaving from the end (one run
    kept), then one from the middle (two runs), then every other one (a gather);
    and the next tokens cut alike.
    """
    from mlx_lm.models.cache import KVCache

    singles = []
    for n in range(1, 8):
        single = KVCache()
        k = mx.zeros((1, kv_heads, n, dim), dtype=dtype)
        single.update_and_fetch(k, k)
        singles.append([single])
    out: list[mx.array] = []
    tokens = mx.zeros((7,), dtype=mx.uint32)
    for keep in ([0, 1, 2, 3, 4, 5], [0, 1, 2, 4, 5], [0, 2, 4, 6]):
        batch, pads = merge(singles)
        out += state_arrays(extract(batch, pads, 3))
        keep_rows(batch, pads, keep)
        out += [batch[0].keys, batch[0].values, batch[0].offset, batch[0].left_padding, take_rows(tokens, keep)]
    mx.eval(out)


def state_arrays(cache: Cache) -> list[mx.array]:
    """The arrays holding ``cache``'s keys and values (to evaluate them)."""
    return [a for layer in cache if layer.keys is not None for a in (layer.keys, layer.values)]


__all__ = [
    "Reserve",
    "batchable",
    "extend",
    "extract",
    "keep_rows",
    "length",
    "merge",
    "snapshot",
    "state_arrays",
    "take_rows",
    "warm",
]
