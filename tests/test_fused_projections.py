"""q/k/v and gate/up as one product each: the same logits, each weight held once, a way back.

The fusion is for CUDA decode steps bound by host time per kernel call; what
is tested here, on the CPU, is that it changes nothing a user sees: a model's
logits (plain and quantized, llama and qwen3 layouts), a worker's
generations, a saved generation's fingerprint.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_notebook
from mlx_notebook.generation import fused_projections, persist, warm_up
from mlx_notebook.loading.fingerprint import weights_fingerprint
from testkit.real_tokenizer import make_real_model
from testkit.tiny_model import make_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fused") / "llama", layers=2, hidden=64, intermediate=128)


def _load(folder: Path) -> tuple[nn.Module, str]:
    from mlx_lm.utils import load_model

    model, config = load_model(folder)
    return model, config["model_type"]


def _decode(model: nn.Module, rows: int = 3, steps: int = 4) -> list[mx.array]:
    """Logits of a prompt and a few greedy steps over ``rows`` rows (a batched cache where ``rows`` > 1)."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    cache = make_prompt_cache(model) if rows == 1 else [BatchKVCache([0] * rows) for _ in model.layers]
    prompt = mx.array([[5 + r + i for i in range(9)] for r in range(rows)])
    out = [model(prompt, cache=cache)]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    mx.eval(out)
    return out


def _assert_close(reference: list[mx.array], got: list[mx.array]) -> None:
    for ref, new in zip(reference, got, strict=True):
        # The same dot products; a wider product may block its sums differently, so ~1 ulp, not bits.
        assert mx.allclose(ref, new, atol=1e-4, rtol=1e-4).item(), mx.abs(ref - new).max().item()
        assert mx.array_equal(mx.argmax(ref, axis=-1), mx.argmax(new, axis=-1)).item()


def _parameters(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_fused_llama_gives_its_logits_and_holds_each_weight_once(llama, rows) -> None:
    model, kind = _load(llama)
    reference, size = _decode(model, rows), _parameters(model)
    assert fused_projections.fuse(model, kind) == 2 * len(model.layers)  # q/k/v and gate/up in each layer
    assert fused_projections.fuse(model, kind) == 0  # idempotent
    assert _parameters(model) == size
    attention = model.layers[0].self_attn
    assert isinstance(attention.q_proj, fused_projections.Part)
    assert attention.q_proj.fused.weight.shape == (64 + 2 * 32, 64)  # 4 query heads, 2 KV heads of 16
    _assert_close(reference, _decode(model, rows))


def test_a_qwen3_layout_with_a_real_size_tokenizer_fuses_the_same(tmp_path: Path) -> None:
    folder = make_real_model(
        tmp_path / "qwen3",
        arch="qwen3",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        dtype="float32",
    )
    model, kind = _load(folder)
    reference = _decode(model)
    assert kind == "qwen3" and fused_projections.fuse(model, kind) == 4
    _assert_close(reference, _decode(model))


def test_quantized_projections_fuse_when_quantized_alike(llama) -> None:
    model, kind = _load(llama)
    nn.quantize(model, group_size=32, bits=4)
    reference = _decode(model)
    assert fused_projections.fuse(model, kind) == 4
    fused = model.layers[0].mlp.gate_proj.fused
    assert type(fused) is nn.QuantizedLinear and fused.bits == 4 and fused.group_size == 32
    _assert_close(reference, _decode(model))


def test_layers_unlike_each_other_or_other_model_types_stay_separate(llama) -> None:
    model, kind = _load(llama)
    assert fused_projections.fuse(model, "gemma3n") == 0  # a layout whose siblings may read other inputs
    layer = model.layers[0]
    # Quantized q, plain k/v: no one product computes all three.
    layer.self_attn.q_proj = nn.QuantizedLinear.from_linear(layer.self_attn.q_proj, group_size=32, bits=4)
    assert fused_projections.fuse(model, kind) == 2 * len(model.layers) - 1
    assert not isinstance(layer.self_attn.k_proj, fused_projections.Part)
    assert isinstance(layer.mlp.up_proj, fused_projections.Part)


def test_a_part_called_with_another_input_computes_its_own_slice(llama) -> None:
    # Two threads running one model (the prefill thread beside the decode worker) interleave calls.
    model, kind = _load(llama)
    attention = model.layers[0].self_attn
    separate = [attention.q_proj, attention.k_proj, attention.v_proj]
    fused_projections.fuse(model, kind)
    a, b = mx.random.normal((2, 5, 64), key=mx.random.key(1))
    q_a = attention.q_proj(a)
    k_b = attention.k_proj(b)  # another input between q(a) and k(a)
    k_a, v_a, v_b = attention.k_proj(a), attention.v_proj(a), attention.v_proj(b)
    for got, layer, x in [(q_a, 0, a), (k_a, 1, a), (v_a, 2, a), (k_b, 1, b), (v_b, 2, b)]:
        assert mx.allclose(got, separate[layer](x), atol=1e-5).item()


def test_two_threads_interleaving_calls_each_get_their_own_product_once(llama, monkeypatch) -> None:
    # The prefill thread builds a joining prompt's graph while the worker builds the others' step.
    model, kind = _load(llama)
    attention = model.layers[0].self_attn
    separate = [attention.q_proj, attention.k_proj, attention.v_proj]
    fused_projections.fuse(model, kind)
    products: list[int] = []
    fused = attention.q_proj.fused
    call = type(fused).__call__

    def counted(self, x):
        if self is fused:
            products.append(x.shape[1])
        return call(self, x)

    monkeypatch.setattr(type(fused), "__call__", counted)
    inputs = {
        "a": np.random.default_rng(2).normal(size=(1, 5, 64)),
        "b": np.random.default_rng(3).normal(size=(1, 3, 64)),
    }
    errors: dict[str, float] = {}
    q_done, other_done = threading.Event(), threading.Event()

    def run(name: str) -> None:
        # MLX's streams are per thread: each builds and evaluates its own arrays, as the worker and prefill thread do.
        x = mx.array(inputs[name], dtype=mx.float32)
        if name == "a":  # q(a), then waits while the other thread runs q, k, v on b, then k(a), v(a)
            parts = [attention.q_proj(x)]
            q_done.set()
            assert other_done.wait(30)
            parts += [attention.k_proj(x), attention.v_proj(x)]
        else:
            assert q_done.wait(30)
            parts = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
            other_done.set()
        errors[name] = max(mx.abs(p - layer(x)).max().item() for p, layer in zip(parts, separate, strict=True))

    threads = [threading.Thread(target=run, args=(name,)) for name in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert sorted(products) == [3, 5]  # one product per input: neither thread's evicted the other's
    assert set(errors) == {"a", "b"} and max(errors.values()) < 1e-5, errors


def test_unfused_gives_mlx_lm_its_own_layers_back_for_a_while(llama) -> None:
    model, kind = _load(llama)
    fused_projections.fuse(model, kind)
    reference = _decode(model)
    with fused_projections.unfused(model):
        attention = model.layers[1].self_attn
        assert [type(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj)] == [nn.Linear] * 3
        assert attention.k_proj.weight.shape == (32, 64)
        _assert_close(reference, _decode(model))
    assert isinstance(model.layers[1].self_attn.k_proj, fused_projections.Part)


def test_a_worker_fuses_at_its_idle_moment_with_the_same_generations_and_fingerprint(llama, monkeypatch) -> None:
    prompts = ["The lighthouse keeper", "On the northern coast", "Once upon a time"]
    # The worker fuses where it installs its kernels: its first idle moment after a load (CUDA; forced here).
    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "warm_ladder", lambda loaded, idle: True)

    def generations() -> tuple[list[list[int]], str]:
        worker = mlx_notebook.Worker()
        try:
            model, _ = worker.load_model(str(llama))
            if fused_projections.wanted():
                deadline = time.monotonic() + 60
                while not isinstance(model.layers[0].mlp.gate_proj, fused_projections.Part):
                    assert time.monotonic() < deadline, "the worker's idle moment did not fuse in 60 s"
                    time.sleep(0.01)
            gens = [mlx_notebook.generate(p, model=str(llama), worker=worker, max_tokens=12) for p in prompts]
            for gen in gens:
                gen.result(timeout=120)
            assert all(gen.state == "done" for gen in gens), [(g.state, g.error) for g in gens]
            # What a saved generation carries: the weights as loaded, whatever the idle moment did since.
            fingerprint = worker.call(lambda store: persist.fingerprint(store.get(str(llama))))
            return [gen.tokens for gen in gens], fingerprint
        finally:
            worker.shutdown()

    monkeypatch.setenv("MLX_NOTEBOOK_FUSED_PROJECTIONS", "1")
    fused = generations()
    monkeypatch.setenv("MLX_NOTEBOOK_FUSED_PROJECTIONS", "0")
    assert generations() == fused
    assert fused[1] == weights_fingerprint(_load(llama)[0])
