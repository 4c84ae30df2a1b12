"""Batched KV cache edits against mlx-lm's own: the same rows, paddings and positions."""

from __future__ import annotations

import re
from collections import Counter

import mlx.core as mx
import pytest

from mlx_notebook.generation import batch_cache
from mlx_notebook.generation.chunks import KV_STEP

pytestmark = pytest.mark.unit


def _single(n: int, seed: int):
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    if n:
        k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
        cache.update_and_fetch(k, k * 2)
    return cache


@pytest.mark.parametrize("sizes, joining", [([5, 9], [300]), ([300, 40], [7]), ([12], [12, 3]), ([257, 1], [256])])
def test_extend_gives_mlx_lms_rows_with_room_for_the_next_steps(sizes: list[int], joining: list[int]) -> None:
    from mlx_lm.models.cache import BatchKVCache

    ours, pads = batch_cache.merge([[_single(n, i)] for i, n in enumerate(sizes)])
    theirs, _ = batch_cache.merge([[_single(n, i)] for i, n in enumerate(sizes)])
    other, _ = batch_cache.merge([[_single(n, 50 + i)] for i, n in enumerate(joining)])
    new_pads = batch_cache.extend(ours, pads, [[_single(n, 50 + i)] for i, n in enumerate(joining)])
    BatchKVCache.extend(theirs[0], other[0])
    mine, ref = ours[0], theirs[0]
    assert mine._idx == ref._idx == max(sizes + joining)
    assert mine.left_padding.tolist() == ref.left_padding.tolist() == new_pads
    assert mine.offset.tolist() == ref.offset.tolist()
    for a, b in zip(mine.keys_and_values(), ref.keys_and_values()):
        for row, pad in enumerate(new_pads):  # padding positions hold nothing read
            assert mx.array_equal(a[row, :, pad:], b[row, :, pad:])
    # The next KV_STEP decode steps write in place: no growth (a copy of every row) among them.
    assert mine.keys.shape[2] >= mine._idx + KV_STEP
    k = mx.ones((len(new_pads), 2, 1, 4))
    before = mine.keys.shape[2]
    for _ in range(KV_STEP):
        mine.update_and_fetch(k, k)
        ref.update_and_fetch(k, k)
    assert mine.keys.shape[2] == before
    for a, b in zip(mine.keys_and_values(), ref.keys_and_values()):
        for row, pad in enumerate(new_pads):
            assert mx.array_equal(a[row, :, pad:], b[row, :, pad:])


def _ops(arrays: list[mx.array], tmp_path) -> Counter:
    """The ops of the graph that evaluating ``arrays`` would run, by name (MLX's dot export)."""
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *arrays)
    return Counter(re.findall(r'label\s*=\s*"([A-Za-z]+)', path.read_text()))


def test_a_join_into_reserved_buffers_queues_only_the_rows_copies(tmp_path) -> None:
    # The admit's ops are encoded inside the others' gap between two tokens. Before session 57 a join of a
    # prompt to 7 rows queued 12 ops a layer here (the joiner merged into a batch first, every layer's offsets
    # concatenated and shifted on the device); the rows' keys and values into the buffers are 4.
    layers = 3
    batch, pads = batch_cache.merge([[_single(n, i) for _ in range(layers)] for i, n in enumerate([5, 9, 7])])
    joiner = [_single(40, 50) for _ in range(layers)]
    mx.eval([(layer.keys, layer.values, layer.offset, layer.left_padding) for layer in batch])
    mx.eval([(layer.keys, layer.values) for layer in joiner])
    reserve = batch_cache.Reserve(batch, 4, 40)
    reserve.advance(layers)
    mx.eval(reserve.buffers)
    new_pads = batch_cache.extend(batch, pads, [joiner], reserve)
    ops = _ops([a for layer in batch for a in (layer.keys, layer.values, layer.offset, layer.left_padding)], tmp_path)
    # A slice is a view (the joiner's buffer is longer than its rows); nothing else runs.
    assert ops["SliceUpdate"] == 4 * layers and set(ops) <= {"SliceUpdate", "Slice"}, ops
    assert new_pads == [35, 31, 33, 0]
    assert batch[0].offset.tolist() == [5, 9, 7, 40] and batch[0].left_padding.tolist() == new_pads


def test_a_rows_leave_queues_no_op_on_the_offsets(tmp_path) -> None:
    sizes = [30, 7, 12, 900]
    batch, pads = batch_cache.merge([[_single(n, i)] for i, n in enumerate(sizes)])
    mx.eval([(layer.offset, layer.left_padding) for layer in batch])
    batch_cache.keep_rows(batch, pads, [0, 2, 3])
    assert sum(_ops([batch[0].offset, batch[0].left_padding], tmp_path).values()) == 0


def test_keep_rows_gives_mlx_lms_rows_and_copies_only_the_positions_kept() -> None:
    # A long prompt leaving short rows: gathering the rows first (mlx-lm's order) copied every
    # layer's whole capacity, 7.6 GB on Llama-3-8B when an 8k prompt left seven rows of ~600.

    sizes = [40, 4000, 60, 25]
    ours, pads = batch_cache.merge([[_single(n, i)] for i, n in enumerate(sizes)])
    theirs, _ = batch_cache.merge([[_single(n, i)] for i, n in enumerate(sizes)])
    mine, ref = ours[0], theirs[0]
    mx.eval(mine.keys, mine.values, ref.keys, ref.values)
    keep = [0, 2, 3]
    whole = mine.keys[mx.array(keep)].nbytes  # what gathering the rows' whole capacity copies, per array
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    new_pads = batch_cache.keep_rows(ours, pads, keep)
    mx.eval(mine.keys, mine.values)
    copied = mx.get_peak_memory() - base
    assert copied < 0.25 * whole, (copied, whole)

    ref.filter(keep)
    assert mine._idx == ref._idx
    assert mine.left_padding.tolist() == ref.left_padding.tolist() == new_pads
    assert mine.offset.tolist() == ref.offset.tolist()
    for a, b in zip(mine.keys_and_values(), ref.keys_and_values()):
        assert a.shape == b.shape
        for row, pad in enumerate(new_pads):
            assert mx.array_equal(a[row, :, pad:], b[row, :, pad:])


@pytest.mark.parametrize("keep", [[1, 2], [0, 2, 4], [0, 1, 3, 4], [0, 2, 3, 5], [1, 3, 5], [5, 0, 1], [5, 3, 1, 0]])
def test_keep_rows_keeps_any_rows_in_their_order(keep: list[int]) -> None:
    # Runs of neighbours are copied as slices, more than three runs as a gather: either way the rows asked for.
    sizes = [30, 7, 12, 900, 3, 45]
    ours, pads = batch_cache.merge([[_single(n, i)] for i, n in enumerate(sizes)])
    before = [(ours[0].keys[i, :, pads[i] : ours[0]._idx], ours[0].values[i, :, pads[i] : ours[0]._idx]) for i in keep]
    new_pads = batch_cache.keep_rows(ours, pads, keep)
    layer = ours[0]
    assert layer.keys.shape[0] == len(keep) and layer.offset.tolist() == [sizes[i] for i in keep]
    for row, (pad, (k, v)) in enumerate(zip(new_pads, before)):
        assert mx.array_equal(layer.keys[row, :, pad : layer._idx], k)
        assert mx.array_equal(layer.values[row, :, pad : layer._idx], v)


@pytest.mark.parametrize("keep", [[0, 1, 2], [3, 4], [0, 2], [4, 0, 1], [0, 2, 4, 6], [6, 5, 4, 3]])
def test_take_rows_gives_the_rows_asked_for_in_their_order(keep: list[int]) -> None:
    a = mx.arange(7 * 3, dtype=mx.uint32).reshape(7, 3)
    assert batch_cache.take_rows(a, keep).tolist() == [a[i].tolist() for i in keep]
    assert batch_cache.take_rows(mx.arange(7), keep).tolist() == keep


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_the_leave_warm_up_runs_on_a_models_cache_shape(dtype) -> None:
    # The idle warm-up (CUDA) runs it once per model: it must not fail for any cache dtype a model has.
    batch_cache.warm(2, 16, dtype)
