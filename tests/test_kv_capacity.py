"""Decode KV buffers laid out for CUDA's attention kernels (kv_capacity), checked on real mlx-lm caches (CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlx_notebook.generation import kv_capacity
from mlx_notebook.generation.chunks import KV_STEP

pytestmark = pytest.mark.unit

FUSED = kv_capacity.FUSED_FROM


@pytest.mark.parametrize("needed", [1, 255, 256, 257, 5000, FUSED - 1])
def test_below_the_fused_length_a_buffer_is_off_the_grid_and_holds_what_is_needed(needed: int) -> None:
    length = kv_capacity.capacity(needed, per_shape=True)
    assert length >= needed + KV_STEP and length % KV_STEP != 0
    assert kv_capacity.fits(length, needed, per_shape=True)
    # Grown by an eighth at least: one copy per eighth, not per KV_STEP.
    assert length >= needed + needed // kv_capacity.GROWTH


@pytest.mark.parametrize("needed", [FUSED, FUSED + 1, 32768, 100_000])
def test_from_the_fused_length_a_buffer_is_on_the_grid_and_grows_by_an_eighth(needed: int) -> None:
    length = kv_capacity.capacity(needed, per_shape=True)
    assert length % KV_STEP == 0 and length >= needed + needed // kv_capacity.GROWTH
    assert length < needed + needed // kv_capacity.GROWTH + KV_STEP
    assert kv_capacity.fits(length, needed, per_shape=True)
    # An off-grid buffer that crosses the fused length is laid out again (once), and back.
    assert not kv_capacity.fits(kv_capacity.capacity(FUSED - 1, per_shape=True), needed, per_shape=True)
    assert not kv_capacity.fits(length, FUSED - 1, per_shape=True)


@pytest.mark.parametrize("needed", [1, 256, 257, FUSED + 3])
def test_without_per_shape_builds_buffers_grow_as_mlx_lm_grows_them(needed: int) -> None:
    assert kv_capacity.capacity(needed, per_shape=False) == (needed + KV_STEP - 1) // KV_STEP * KV_STEP
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
    assert length == kv_capacity.capacity(301, per_shape=True) and length % KV_STEP != 0
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
    assert batch.keys.shape[2] == kv_capacity.capacity(41, per_shape=True)
    assert mx.array_equal(batch.keys[..., :40, :], rows) and mx.array_equal(batch.values[..., :40, :], rows + 1)


def test_make_room_leaves_quantized_layers_and_the_cpu_alone() -> None:
    quantized = QuantizedKVCache(group_size=32, bits=8)
    quantized.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    plain = KVCache()
    _filled(plain, 3)
    before = (quantized.keys, plain.keys)
    kv_capacity.make_room([quantized], 1, per_shape=True)
    kv_capacity.make_room([plain], 1, per_shape=False)
    assert quantized.keys is before[0] and plain.keys is before[1]
