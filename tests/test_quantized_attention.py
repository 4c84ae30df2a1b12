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
        # fp32 sums in another order (OpenBLAS's matmuls against mlx-lm's quantized ones), over logits up to ~18.
        # The order depends on OpenBLAS's thread count, which the governor lowers under load: with 2 threads for
        # both runs the largest difference is 0.003, with 1 thread 0.03, with 1 and 2 mixed 0.07 (a full CI run
        # met 0.03). Keys and values shifted by one position show as 1.4-16 (0.24 on one single step).
        assert mx.allclose(ref, got, atol=0.15).item(), float(mx.abs(ref - got).max())


@pytest.mark.unit
@pytest.mark.parametrize("order", ["row first", "quantized first"])
def test_both_routes_stack_in_either_order(model, restored, monkeypatch, order) -> None:
    installs = [row_attention.install, quantized_attention.install]
    if order == "quantized first":
        installs.reverse()
    assert all(install(model) for install in installs)
    first = _current(model)
    assert all(install(model) for install in installs + installs[::-1])
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


@pytest.mark.unit
def test_decode_steps_take_the_fused_kernel_and_prefill_chunks_do_not(model, restored, monkeypatch) -> None:
    """Where the kernel runs (CUDA), every one-position call reaches it with the cache's own packed slices.

    The kernel itself is checked on the device (errors against fp32 attention,
    ``benchmarks/results/h200_quantized_decode_kernel_session14.json``); here it
    is replaced by the dequantized route, so the logits must stay mlx-lm's.
    """
    from mlx_notebook.generation import quantized_decode_kernel

    settings = KVSettings(bits=8, group_size=64, quantized_start=0)
    chunks = [list(range(10, 40)), list(range(40, 77)), [5], [6], list(range(100, 300)), [7]]
    reference = _forward(model, settings, chunks)
    calls: list[tuple[int, int, float, int, int]] = []

    def kernel(queries, keys, values, scale, group, bits):
        calls.append((queries.shape[2], keys[0].shape[2], scale, group, bits))
        k = mx.dequantize(*keys, group_size=group, bits=bits, dtype=queries.dtype)
        v = mx.dequantize(*values, group_size=group, bits=bits, dtype=queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=None)

    monkeypatch.setattr(quantized_decode_kernel, "available", lambda: True)
    monkeypatch.setattr(quantized_decode_kernel, "attend", kernel)
    assert quantized_attention.install(model)
    _refuse_quantized_matmuls(monkeypatch)
    routed = _forward(model, settings, chunks)
    for ref, got in zip(reference, routed, strict=True):
        # The tolerance of test_dequantized_route_equals_mlx_lms_quantized_attention (OpenBLAS's thread count).
        assert mx.allclose(ref, got, atol=0.15).item(), float(mx.abs(ref - got).max())
    layers = len(model.layers)
    # The first chunk fills a plain cache (quantized after it); the single steps at 68, 69 and 270 positions.
    assert sorted({(q, n) for q, n, *_ in calls}) == [(1, 68), (1, 69), (1, 270)]
    assert len(calls) == 3 * layers
    assert {(group, bits) for *_, group, bits in calls} == {(64, 8)}
    assert all(scale == pytest.approx(64**-0.5) for _, _, scale, _, _ in calls)


@pytest.mark.unit
def test_what_the_kernel_takes() -> None:
    from mlx_notebook.generation.quantized_decode_kernel import lanes_per_row, slices_for, supports

    def packed(heads: int, n: int, dim: int, bits: int, group: int):
        return (
            mx.zeros((1, heads, n, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((1, heads, n, dim // group)),
            mx.zeros((1, heads, n, dim // group)),
        )

    q = mx.zeros((1, 32, 1, 128))
    kv = packed(8, 300, 128, 8, 64)
    assert supports(q, kv, kv, 8, 64)
    assert supports(q, packed(8, 300, 128, 4, 32), packed(8, 300, 128, 4, 32), 4, 32)
    assert not supports(mx.zeros((1, 32, 3, 128)), kv, kv, 8, 64)  # a prefill chunk
    assert not supports(q, packed(8, 300, 128, 2, 64), packed(8, 300, 128, 2, 64), 2, 64)  # no 2-bit unpacking
    assert not supports(mx.zeros((1, 32, 1, 80)), packed(8, 300, 80, 8, 16), packed(8, 300, 80, 8, 16), 8, 16)
    assert not supports(mx.zeros((1, 12, 1, 128)), kv, kv, 8, 64)  # 12 heads over 8 KV heads
    assert lanes_per_row(128, 64) == 16 and lanes_per_row(128, 16) == 16 and lanes_per_row(64, 32) == 16
    assert lanes_per_row(256, 16) == 16 and lanes_per_row(128, 8) == 16 and lanes_per_row(256, 8) == 32
    # ~512 blocks over the cache, slices of >= 128 positions, at least one.
    assert slices_for(32768, 8) == 64 and slices_for(1000, 8) == 8 and slices_for(5, 8) == 1


@pytest.mark.unit
def test_unpatched_gives_mlx_lms_own_function_back_for_a_while(model, restored) -> None:
    """Benchmarks run mlx-lm's stream_generate on the same model: the module-wide routes must step aside."""
    import mlx_lm.models.base as base

    # A batch of an earlier test may have routed the module already (routes are module-wide; on the CPU too).
    attention_patch.unwrap(model, base.scaled_dot_product_attention)
    bare = _current(model)
    assert row_attention.install(model) and quantized_attention.install(model)
    routed = _current(model)
    assert routed is not bare
    with attention_patch.unpatched(model):
        assert _current(model) is bare
        assert _current(model) is base.scaled_dot_product_attention
    assert _current(model) is routed
