"""A padded batch's decode attention row by row gives what the masked call gives (mlx-lm's model, real caches).

The path is switched on only where MLX's fused attention refuses masks (the
CUDA backend); here it is forced on the CPU to check its numbers.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_notebook.generation import batch_cache, row_attention
from testkit.tiny_model import make_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm.utils import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("rows") / "model", layers=2)
    loaded, _ = load_model(Path(folder))
    return loaded


def _batch(model, lengths: list[int]):
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        ids = mx.array([[(7 * i + j) % 300 + 10 for j in range(n)]], dtype=mx.uint32)
        model(ids, cache=cache)
        caches.append(cache)
    return batch_cache.merge(caches)


@pytest.mark.parametrize("lengths", [[5, 40, 17], [12, 12, 12], [1, 64]])
def test_row_by_row_equals_the_masked_step(model, lengths: list[int]) -> None:
    assert row_attention.install(model) and row_attention.install(model)  # idempotent
    inputs = mx.array([[3]] * len(lengths), dtype=mx.uint32)
    masked_cache, pads = _batch(model, lengths)
    rows_cache, _ = _batch(model, lengths)
    row_attention.mark(masked_cache, None)
    row_attention.mark(rows_cache, pads)
    for _ in range(3):  # the cache grows step by step; each step compared
        masked = model(inputs, cache=masked_cache)
        rows = model(inputs, cache=rows_cache)
        assert mx.allclose(masked, rows, atol=1e-4).item(), float(mx.abs(masked - rows).max())
        inputs = mx.argmax(masked[:, -1:, :], axis=-1).astype(mx.uint32)


def test_a_cache_without_row_pads_and_a_prefill_take_mlx_lms_call(model) -> None:
    row_attention.install(model)
    cache, pads = _batch(model, [4, 9])
    row_attention.mark(cache, pads)
    # Several query positions (a prefill chunk): the wrapper leaves it to mlx-lm's masked call.
    out = model(mx.array([[3, 4], [5, 6]], dtype=mx.uint32), cache=cache)
    assert out.shape[:2] == (2, 2)
