"""Attention over dequantized layers (the CUDA route for ``kv_bits``) gives mlx-lm's quantized attention's numbers.

The route is switched on only on MLX's CUDA backend, whose quantized matmul
refuses the cache's slices; here it is forced on the CPU, against mlx-lm's
own quantized attention on the same caches (with its matmuls made to fail
as on CUDA while the route runs, so a call that reaches them shows), and
through whole generations.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

import mlx_notebook
from mlx_notebook.generation import attention_patch, quantized_attention, row_attention
from mlx_notebook.generation.kv_settings import KVSettings
from testkit.tiny_model import make_tiny_model
from testkit.waiting import assert_stays_paused, other_generation, wait_tokens

PROMPT = "The history of the lighthouse keepers on the northern coast, told by one of them " * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama with head size 64 (hidden 256, 4 heads, 2 KV heads)."""
    return make_tiny_model(tmp_path_factory.mktemp("qa") / "model", layers=2, hidden=256, heads=4, intermediate=256)


@pytest.fixture(scope="module")
def model(folder: Path):
    from mlx_lm.utils import load_model

    loaded, _ = load_model(folder)
    return loaded


@pytest.fixture
def restored(model):
    """Put mlx-lm's attention function back after the test (the route must not leak into other tests)."""
    original = getattr(attention_patch.module_of(model), attention_patch.NAME)
    yield
    attention_patch.unwrap(model, original)


def _forward(model, settings: KVSettings, chunks: list[list[int]]) -> list[mx.array]:
    """Logits of each call: a prompt in chunks, quantized before each call as the engine does, then steps."""
    cache = settings.make_cache(model)
    out = []
    for ids in chunks:
        settings.quantize(cache)
        out.append(model(mx.array([ids], dtype=mx.uint32), cache=cache))
        mx.eval(out[-1])
    return out


def _refuse_quantized_matmuls(monkeypatch) -> None:
    """Make mlx-lm's quantized attention fail as it does on CUDA, so a call that reaches it shows."""
    import mlx_lm.models.base as base

    def refused(*args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape (as on CUDA)")

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", refused)


def _current(model):
    return getattr(attention_patch.module_of(model), attention_patch.NAME)


@pytest.mark.unit
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 32)])
def test_dequantized_route_equals_mlx_lms_quantized_attention(model, restored, monkeypatch, bits, group) -> None:
    settings = KVSettings(bits=bits, group_size=group, quantized_start=0)
    # A first chunk (plain cache), chunks over the quantized cache (causal mask), then single steps, past
    # the buffer's first 256 positions so that it grows.
    chunks = [list(range(10, 40)), list(range(40, 77)), list(range(77, 90)), [5], [6], [7]]
    chunks += [list(range(100, 300)), [8], list(range(3, 60)), [9]]
    reference = _forward(model, settings, chunks)
    assert quantized_attention.install(model) and quantized_attention.install(model)  # idempotent
    _refuse_quantized_matmuls(monkeypatch)
    routed = _forward(model, settings, chunks)
    for ref, got in zip(reference, routed, strict=True):
        # fp32 sums in another order (OpenBLAS's matmuls against the fused kernel), over logits up to ~18: most
        # agree to 1e-5, the largest difference seen is 0.006 (a wrong key or value shows as >0.5).
        assert mx.allclose(ref, got, atol=2e-2).item(), float(mx.abs(ref - got).max())


@pytest.mark.unit
def test_both_routes_stack_in_either_order(model, restored, monkeypatch) -> None:
    assert row_attention.install(model) and quantized_attention.install(model)
    first = _current(model)
    assert row_attention.install(model) and quantized_attention.install(model)
    assert _current(model) is first  # neither wrapped again
    _refuse_quantized_matmuls(monkeypatch)
    settings = KVSettings(bits=8, quantized_start=0)
    mx.eval(_forward(model, settings, [list(range(10, 40)), list(range(40, 60)), [5]]))


def test_generations_with_the_route_forced(worker, folder, model, restored, monkeypatch) -> None:
    """With mlx-lm's quantized matmuls refused as on CUDA: the same greedy tokens, and an exact pause and resume."""
    name = str(folder)
    settings = {"kv_bits": 8, "quantized_kv_start": 0}
    worker.prompt_cache_gb = 0  # every run prefills its own prompt
    try:
        reference = mlx_notebook.generate(PROMPT, model=name, worker=worker, max_tokens=24, **settings)
        reference.result(timeout=120)
        assert reference.state == "done", reference.error

        monkeypatch.setattr(quantized_attention, "wanted", lambda: True)
        _refuse_quantized_matmuls(monkeypatch)
        routed = mlx_notebook.generate(PROMPT, model=name, worker=worker, max_tokens=24, **settings)
        routed.result(timeout=120)
        assert routed.state == "done", routed.error
        assert routed.tokens == reference.tokens

        gen = mlx_notebook.generate(PROMPT, model=name, worker=worker, max_tokens=24, **settings)
        wait_tokens(gen, 6)
        gen.pause()
        assert_stays_paused(gen, lambda: other_generation(worker, name))
        gen.resume()
        gen.result(timeout=120)
        assert gen.tokens == reference.tokens
    finally:
        worker.prompt_cache_gb = mlx_notebook.generation.prefix_cache.DEFAULT_PROMPT_CACHE_GB
