"""A small prefill chunk's attention as matmuls and a softmax gives what the fused kernel gives.

The route is switched on only where the fused kernel builds a graph per shape
(the CUDA backend); here it is forced on the CPU to check its numbers, on
mlx-lm's model with real caches, and put back after.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_notebook.generation import attention_patch, small_attention
from testkit.tiny_model import make_tiny_model

pytestmark = pytest.mark.unit


def _qkv(n: int, s: int, heads: int = 8, kv_heads: int = 2, d: int = 16):
    k = mx.random.split(mx.random.key(n * 1000 + s), 3)
    q = mx.random.normal((2, heads, n, d), key=k[0])
    return q, mx.random.normal((2, kv_heads, s, d), key=k[1]), mx.random.normal((2, kv_heads, s, d), key=k[2])


@pytest.mark.parametrize(("n", "s"), [(8, 8), (24, 32), (5, 300), (64, 64)])
def test_unfused_equals_fused_causal_and_unmasked(n: int, s: int) -> None:
    q, k, v = _qkv(n, s)
    for mask in ("causal", None):
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        ours = small_attention.attend(q, k, v, 0.25, mask)
        assert mx.allclose(fused, ours, atol=1e-5).item(), (mask, float(mx.abs(fused - ours).max()))


@pytest.mark.parametrize("per_head", [False, True])
def test_unfused_equals_fused_with_array_masks(per_head: bool) -> None:
    n, s = 6, 20
    q, k, v = _qkv(n, s)
    shape = (2, 8, n, s) if per_head else (n, s)
    keep = mx.random.uniform(shape=shape, key=mx.random.key(3)) > 0.3
    keep = keep | (mx.arange(s) == 0)  # every query keeps a key
    for mask in (keep, mx.where(keep, 0.0, -1e9).astype(mx.float32)):
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        ours = small_attention.attend(q, k, v, 0.25, mask)
        assert mx.allclose(fused, ours, atol=1e-5).item(), float(mx.abs(fused - ours).max())


def test_a_models_prefill_chunks_match_and_big_ones_keep_the_fused_call(tmp_path: Path, monkeypatch) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(make_tiny_model(tmp_path / "model", layers=2)))
    ids = mx.array([[(5 * j) % 300 + 10 for j in range(40)]], dtype=mx.uint32)

    def chunks() -> mx.array:
        cache = make_prompt_cache(model)
        model(ids[:, :8], cache=cache)
        model(ids[:, 8:32], cache=cache)
        return model(ids[:, 32:], cache=cache)

    fused = chunks()
    module = attention_patch.module_of(model)
    original = getattr(module, attention_patch.NAME)
    calls: list[tuple[int, int]] = []
    attend = small_attention.attend
    monkeypatch.setattr(
        small_attention, "attend", lambda q, k, *a: calls.append((q.shape[2], k.shape[2])) or attend(q, k, *a)
    )
    try:
        assert small_attention.install(model) and small_attention.install(model)  # idempotent
        assert mx.allclose(chunks(), fused, atol=1e-4).item()
        assert calls == [(8, 8)] * 2 + [(24, 32)] * 2 + [(8, 40)] * 2  # every chunk, in both layers
        calls.clear()
        monkeypatch.setattr(small_attention, "MAX_SCORES", 4 * 24 * 32 - 1)  # tiny model: 4 query heads
        assert mx.allclose(chunks(), fused, atol=1e-4).item()
        assert calls == [(8, 8)] * 2 + [(8, 40)] * 2  # the 24-token chunk over 32 keys went to the fused call
        cache = make_prompt_cache(model)
        model(ids[:, :8], cache=cache)
        calls.clear()
        model(ids[:, 8:9], cache=cache)
        assert calls == []  # a decode step (one query) keeps the fused call
    finally:
        attention_patch.unwrap(model, original)
