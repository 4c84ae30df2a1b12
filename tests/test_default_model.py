"""The engine on the real default model (SmolLM2-135M-Instruct from GGUF).

A stop in every phase parks the worker within a few seconds even where the
phase alone would take a minute, and afterwards the model gives exactly the
greedy tokens it gave before.
"""

from __future__ import annotations

import time

import pytest
from conftest import needs_default_model

import mlx_notebook

pytestmark = needs_default_model

QUESTION = "What is the capital of France? Answer in one sentence."
LONG = "Summarize this text. " + " ".join(
    f"Paragraph {i}: the river flows through the valley and the town grows beside it." for i in range(70)
)


@pytest.fixture(scope="module")
def quantized_worker():
    """The default model kept 4-bit: prefill ~15 tok/s here, so a 1,200-token
    prompt takes over a minute, like the bug report this project started from."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLX_NOTEBOOK_CPU_DEQUANTIZE", "0")
    w = mlx_notebook.Worker()
    w.load_model()
    mp.undo()
    yield w
    assert w.shutdown(timeout=60)


def greedy(worker, prompt=QUESTION, n=24):
    gen = mlx_notebook.generate(prompt, max_tokens=n, worker=worker)
    gen.result(timeout=300)
    assert gen.state == "done", gen.error
    return gen


def test_default_model_answers_in_english(worker):
    gen = greedy(worker)
    assert "Paris" in gen.text
    assert gen.stats.finish_reason in ("stop", "length")


def test_stop_in_prefill_parks_within_seconds_not_a_minute(quantized_worker):
    before = greedy(quantized_worker).tokens
    gen = mlx_notebook.generate(LONG, max_tokens=8, worker=quantized_worker)
    while gen.state != "prefilling":
        assert not gen.finished
        time.sleep(0.005)
    time.sleep(1.0)
    t0 = time.perf_counter()
    gen.cancel()
    assert gen.wait(5), "the stop did not land within 5 s"
    waited = time.perf_counter() - t0
    assert gen.state == "stopped" and gen.stats.prompt_tokens > 1000
    # The whole prefill would have taken over a minute at the measured rate.
    per_token = quantized_worker.call(lambda s: s.get(None).prefill_cost[1])
    assert per_token * gen.stats.prompt_tokens > 30
    assert waited < 5 and gen.stats.stop_latency_s < 5
    assert greedy(quantized_worker).tokens == before


def test_stop_in_decode_and_load_then_same_tokens(worker):
    before = greedy(worker).tokens
    gen = mlx_notebook.generate(LONG[:400], max_tokens=1000, worker=worker)
    while len(gen.tokens) < 3:
        assert not gen.finished, gen.error
        time.sleep(0.005)
    gen.cancel()
    assert gen.wait(5) and gen.state == "stopped"
    assert gen.text
    worker.call(lambda s: s.unload(None))
    blocker = mlx_notebook.generate(QUESTION, max_tokens=1000, worker=worker)
    loading = mlx_notebook.generate(QUESTION, max_tokens=5, worker=worker)
    seen = []

    def on_event(event):
        if event.kind == "progress" and event.phase.startswith("load") and event.done and not seen:
            seen.append(event.done)
            event.generation.cancel()

    loading.add_listener(on_event)
    blocker.cancel()
    assert loading.wait(30) and loading.state == "stopped"
    assert seen
    assert greedy(worker).tokens == before


def test_pause_resume_on_the_default_model_is_exact(worker):
    before = greedy(worker, n=40).tokens
    gen = mlx_notebook.generate(QUESTION, max_tokens=40, worker=worker)
    while len(gen.tokens) < 4 and not gen.finished:
        time.sleep(0.002)
    gen.pause()
    deadline = time.monotonic() + 5
    while gen.state != "paused" and not gen.finished:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    held = len(gen.tokens)
    time.sleep(0.3)
    assert len(gen.tokens) == held
    gen.resume()
    gen.result(timeout=120)
    assert gen.tokens == before
