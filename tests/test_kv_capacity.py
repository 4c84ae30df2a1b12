"""Decode KV buffers laid out for CUDA's attention kernels (kv_capacity), checked on real mlx-lm caches (CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlx_notebook.generation import kv_capacity
from mlx_notebook.generation.chunks import KV_STEP

pytestmark = pytest.mark.unit

VECTOR = kv_capacity.VECTOR_BELOW


def test_the_ladder_has_four_rungs_per_doubling_on_the_grid() -> None:
    rungs = sorted({kv_capacity.rung(n) for n in range(1, 70_000)})
    assert rungs[:6] == [256, 512, 768, 1024, 1280, 1536]
    assert [r for r in rungs if 4096 <= r <= 8192] == [4096, 5120, 6144, 7168, 8192]
    assert all(r % KV_STEP == 0 for r in rungs)
    assert all(b <= 1.25 * a for a, b in zip(rungs[3:], rungs[4:]))  # at most a quarter more than needed
    assert all(kv_capacity.rung(r) == r and kv_capacity.rung(r + 1) > r for r in rungs)


@pytest.mark.parametrize(("needed", "rows"), [(1, 1), (256, 1), (257, 1), (5000, 1), (VECTOR - 1, 1), (1000, 8)])
def test_small_buffers_are_off_the_grid_for_the_vector_kernel(needed: int, rows: int) -> None:
    length = kv_capacity.capacity(needed, rows, per_shape=True)
    assert length >= needed and length % KV_STEP != 0
    assert kv_capacity.fits(length, needed, rows, per_shape=True)
    assert not kv_capacity.fits(kv_capacity.rung(needed), needed, rows, per_shape=True)  # mlx-lm's grid length


@pytest.mark.parametrize(("needed", "rows"), [(VECTOR, 1), (32768, 1), (100_000, 1), (1024, 8), (8192, 8)])
def test_large_buffers_are_rungs_on_the_grid_for_cudnn(needed: int, rows: int) -> None:
    length = kv_capacity.capacity(needed, rows, per_shape=True)
    assert length == kv_capacity.rung(needed) and length % KV_STEP == 0
    assert kv_capacity.fits(length, needed, rows, per_shape=True)


def test_a_buffer_is_laid_out_again_when_its_kind_or_rung_is_wrong() -> None:
    # What a prefill leaves on the grid, off the ladder (17 x 256): it would build a graph of its own.
    assert kv_capacity.rung(4352) != 4352
    assert not kv_capacity.fits(4352, 4300, 8, per_shape=True)
    # Laid out for one row's vector kernel, then joined by seven more rows: cuDNN's rung now.
    one = kv_capacity.capacity(1024, 1, per_shape=True)
    assert not kv_capacity.fits(one, 1024, 8, per_shape=True)
    # And back when the rows leave.
    assert not kv_capacity.fits(kv_capacity.capacity(1024, 8, per_shape=True), 1024, 1, per_shape=True)


@pytest.mark.parametrize("needed", [1, 256, 257, 40_000])
def test_without_per_shape_builds_buffers_grow_as_mlx_lm_grows_them(needed: int) -> None:
    assert kv_capacity.capacity(needed, 4, per_shape=False) == (needed + KV_STEP - 1) // KV_STEP * KV_STEP
    assert kv_capacity.fits(needed, needed, per_shape=False)
    assert not kv_capacity.fits(needed - 1, needed, per_shape=False)


def _filled(cache, steps: int) -> mx.array:
    """Feed ``steps`` single positions of distinct values; return them all (for comparison)."""
    values = mx.arange(steps * 2 * 4, dtype=mx.float32).reshape(1, 2, steps, 4)
    for i in range(steps):
        cache.update_and_fetch(values[..., i : i + 1, :], -values[..., i : i + 1, :])
    return values


def test_make_room_lays_out_a_plain_cache_and_keeps_every_position() -> None:
    cache = KVCache()
    values = _filled(cache, 300)
    assert cache.keys.shape[2] % KV_STEP == 0  # as mlx-lm grew it
    kv_capacity.make_room([cache], 1, per_shape=True)
    length = cache.keys.shape[2]
    assert length == kv_capacity.capacity(301, 1, per_shape=True) and length % KV_STEP != 0
    keys, vals = cache.update_and_fetch(values[..., :1, :], values[..., :1, :])
    assert cache.keys.shape[2] == length  # mlx-lm found room: no growth of its own
    assert mx.array_equal(keys[..., :300, :], values) and mx.array_equal(vals[..., :300, :], -values)
    # A buffer that fits is left as it is (the same array).
    before = cache.keys
    kv_capacity.make_room([cache], 1, per_shape=True)
    assert cache.keys is before


def test_make_room_lays_out_a_batch_cache_by_its_written_positions() -> None:
    batch = BatchKVCache(left_padding=[2, 0])
    rows = mx.arange(2 * 2 * 40 * 4, dtype=mx.float32).reshape(2, 2, 40, 4)
    batch.update_and_fetch(rows, rows + 1)
    kv_capacity.make_room([batch], 1, per_shape=True)
    assert batch.keys.shape[2] == kv_capacity.capacity(41, 2, per_shape=True)
    assert mx.array_equal(batch.keys[..., :40, :], rows) and mx.array_equal(batch.values[..., :40, :], rows + 1)


def test_make_room_leaves_quantized_layers_and_roomy_buffers_alone() -> None:
    quantized = QuantizedKVCache(group_size=32, bits=8)
    quantized.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    plain = KVCache()
    _filled(plain, 3)
    before = (quantized.keys, plain.keys)
    kv_capacity.make_room([quantized], 1, per_shape=True)
    kv_capacity.make_room([plain], 1, per_shape=False)
    assert quantized.keys is before[0] and plain.keys is before[1]


@pytest.mark.parametrize("per_shape", [False, True])
def test_a_decode_crossing_its_buffers_end_grows_one_layer_a_step(per_shape: bool) -> None:
    # What DecodeBatch does each step: make room for one position, then the model's write. mlx-lm alone grows
    # every layer in the step that runs out of room (a copy of the whole cache in one step).
    layers = 6
    cache = [BatchKVCache(left_padding=[1, 0]) for _ in range(layers)]
    prompt = mx.arange(2 * 2 * 240 * 4, dtype=mx.float32).reshape(2, 2, 240, 4)
    for layer in cache:
        layer.update_and_fetch(prompt, -prompt)
    grown_per_step = []
    written = [prompt]
    previous: list[mx.array] = []
    for step in range(1200 - 240):
        kv_capacity.make_room(cache, 1, per_shape=per_shape)
        buffers = [layer.keys for layer in cache]
        token = mx.full((2, 2, 1, 4), float(step))
        written.append(token)
        for layer in cache:
            layer.update_and_fetch(token, -token)
        # mlx-lm found room in every layer: the write grew nothing.
        assert all(layer.keys.shape == b.shape for layer, b in zip(cache, buffers)), step
        if step:  # the first call lays out what the prompt left (on CUDA, off the grid): every layer at once
            grown_per_step.append(sum(b.shape[2] != p.shape[2] for b, p in zip(buffers, previous)))
        previous = buffers
    # A crossing is `layers` steps in a row, a layer each: the first layers first, the last when it must.
    runs = "".join(map(str, grown_per_step)).split("0")
    assert [len(r) for r in runs if r] == [layers] * 4, grown_per_step
    everything = mx.concatenate(written, axis=2)
    for layer in cache:
        assert mx.array_equal(layer.keys[..., :1200, :], everything)
        assert mx.array_equal(layer.values[..., :1200, :], -everything)


def test_the_lead_is_below_a_growth_so_every_layer_grows_once_a_crossing() -> None:
    assert [kv_capacity.lead(i, 4) for i in range(4)] == [3, 2, 1, 0]
    assert max(kv_capacity.lead(i, 1000) for i in range(1000)) < KV_STEP
