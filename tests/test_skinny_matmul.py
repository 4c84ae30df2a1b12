"""Linear layers of 2-8 rows take the skinny kernel (CUDA); every other product stays MLX's.

The kernel runs only on MLX's CUDA backend; it is checked there against
fp32 (``benchmarks/results/h200_skinny_matmul_library_check_session27.log``:
its errors equal MLX's own matmul's in 12 shapes and both dtypes). Here its
call is replaced by MLX's product of the same operands, so what is tested is
the routing: which calls reach it, with what, and that a model and a worker's
generations through it give exactly what they give without it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_notebook
from mlx_notebook.generation import skinny_matmul, warm_up
from testkit.tiny_model import make_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture
def routed(monkeypatch):
    """The route forced on (as on CUDA), the kernel replaced by MLX's product; the calls it got."""
    calls: list[tuple[int, int, int]] = []

    def product(x: mx.array, w: mx.array) -> mx.array:
        assert skinny_matmul.supports(x, w)
        calls.append((x.shape[0], x.shape[1], w.shape[0]))
        return x @ w.T

    monkeypatch.setattr(skinny_matmul, "product", product)
    monkeypatch.setattr(skinny_matmul, "wanted", lambda: True)
    return calls


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # K (the hidden and intermediate sizes) a multiple of 64, as the kernel needs; bf16 as the 8B models.
    return make_tiny_model(
        tmp_path_factory.mktemp("skinny") / "model", layers=2, hidden=128, intermediate=256, dtype="bfloat16"
    )


def test_what_the_kernel_takes() -> None:
    bf = mx.bfloat16
    w = mx.zeros((100, 128), dtype=bf)
    assert skinny_matmul.supports(mx.zeros((2, 128), dtype=bf), w)
    assert skinny_matmul.supports(mx.zeros((8, 128), dtype=mx.float16), w.astype(mx.float16))
    assert not skinny_matmul.supports(mx.zeros((1, 128), dtype=bf), w)  # one row: MLX's gemv
    assert not skinny_matmul.supports(mx.zeros((9, 128), dtype=bf), w)  # a prefill chunk
    assert not skinny_matmul.supports(mx.zeros((4, 128)), mx.zeros((100, 128)))  # float32
    assert not skinny_matmul.supports(mx.zeros((4, 96), dtype=bf), mx.zeros((100, 96), dtype=bf))  # K % 64
    assert not skinny_matmul.supports(mx.zeros((4, 128), dtype=bf), w.astype(mx.float16))  # mixed dtypes


def test_install_swaps_plain_linear_layers_only_and_unpatched_puts_them_back(routed) -> None:
    model = nn.Sequential(nn.Linear(128, 64), nn.QuantizedLinear(128, 64), nn.Embedding(10, 128))
    model.set_dtype(mx.bfloat16)
    assert skinny_matmul.install(model) == 1
    assert skinny_matmul.install(model) == 0  # idempotent
    kinds = [type(m).__name__ for m in model.layers]
    assert kinds == ["SkinnyLinear", "QuantizedLinear", "Embedding"]
    assert routed == [(2, 64, 16)]  # the compile at install: one dtype, once per install with layers of it
    with skinny_matmul.unpatched(model):
        assert type(model.layers[0]) is nn.Linear
    assert type(model.layers[0]) is skinny_matmul.SkinnyLinear


def test_a_batched_decode_step_gives_mlx_lms_logits_and_only_its_products_take_the_kernel(folder, routed) -> None:
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    prompts = mx.array([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [3, 4, 5, 6, 7, 8, 9]])

    def run() -> list[mx.array]:
        cache = [BatchKVCache([0, 0, 0]) for _ in model.layers]
        out = [model(prompts, cache=cache)]
        y = mx.argmax(out[-1][:, -1:], axis=-1)
        for _ in range(3):
            out.append(model(y, cache=cache))
            y = mx.argmax(out[-1][:, -1:], axis=-1)
        # A lone row: its 12-token prompt (12 rows) and its decode step (1 row) stay MLX's.
        lone = [BatchKVCache([0]) for _ in model.layers]
        one = [model(mx.arange(20, 32)[None], cache=lone)]
        one.append(model(mx.argmax(one[-1][:, -1:], axis=-1), cache=lone))
        mx.eval(out, one)
        return out + one

    reference = run()
    skinny_matmul.install(model)
    routed.clear()
    got = run()
    for ref, new in zip(reference, got, strict=True):
        assert mx.array_equal(ref, new).item()
    # Three steps of 3 rows through every linear layer (7 a layer; the head is the tied embedding);
    # the 21-row prompt chunk and the lone row's products go to MLX.
    linear = sum(type(m) is skinny_matmul.SkinnyLinear for _, m in model.named_modules())
    assert linear == 7 * len(model.layers)
    assert len(routed) == 3 * linear
    assert {rows for rows, _, _ in routed} == {3}


def test_a_workers_generations_together_equal_their_runs_without_the_route(folder, routed, monkeypatch) -> None:
    prompts = ["The lighthouse keeper", "On the northern coast", "Once upon a time", "A list of birds"]

    # The worker installs the route in its warm-up, at its first idle moment after a load (on CUDA; forced
    # here, the prefill ladder left out): not at a session's start, where the compile would hold up a job.
    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "warm_ladder", lambda loaded, idle: True)

    def generations() -> list[list[int]]:
        worker = mlx_notebook.Worker()
        try:
            model, _ = worker.load_model(str(folder))
            if skinny_matmul.wanted():
                deadline = time.monotonic() + 60
                while not any(type(m) is skinny_matmul.SkinnyLinear for _, m in model.named_modules()):
                    assert time.monotonic() < deadline, "the worker's warm-up did not install the route in 60 s"
                    time.sleep(0.01)
                worker.call(lambda store: None)  # after the warm-up's forward
            gens = [mlx_notebook.generate(p, model=str(folder), worker=worker, max_tokens=12) for p in prompts]
            for gen in gens:
                gen.result(timeout=120)
            assert all(gen.state == "done" for gen in gens), [(g.state, g.error) for g in gens]
            return [gen.tokens for gen in gens]
        finally:
            worker.shutdown()

    routed_tokens = generations()
    assert routed  # the route was taken (prefill chunks of 2-8 tokens and batched steps)
    monkeypatch.setattr(skinny_matmul, "wanted", lambda: False)
    assert generations() == routed_tokens


def test_a_job_queued_during_the_first_forward_runs_before_the_kernels_compile(folder, monkeypatch) -> None:
    """The compile (2.1-2.3 s a process on an H200) waits for its own idle moment, after the queued job."""
    events: list[str] = []
    queued = threading.Event()
    monkeypatch.setattr(skinny_matmul, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "warm_ladder", lambda loaded, idle: True)
    real_warm, real_install = warm_up.warm, skinny_matmul.install
    installed = threading.Event()
    gen = None  # the generation queued during the first forward

    def warm(loaded):
        real_warm(loaded)
        events.append("first forward")
        assert queued.wait(60), "the test did not queue its generation"  # a job arrives during the forward

    def install(model):
        events.append(f"compile, the generation {gen.state}")
        try:
            return real_install(model)
        finally:
            installed.set()

    monkeypatch.setattr(warm_up, "warm", warm)
    monkeypatch.setattr(skinny_matmul, "install", install)
    monkeypatch.setattr(skinny_matmul, "product", lambda x, w: x @ w.T)
    worker = mlx_notebook.Worker()
    try:
        worker.load_model(str(folder))
        gen = mlx_notebook.generate("The lighthouse keeper", model=str(folder), worker=worker, max_tokens=4)
        queued.set()
        gen.result(timeout=120)
        assert gen.state == "done", gen.error
        assert installed.wait(60), "the worker never compiled the kernel at a later idle moment"
    finally:
        worker.shutdown()
    assert events == ["first forward", "compile, the generation done"]
