"""Prompts that join a decoding batch, prefilled on the prefill thread while the worker steps the others.

The CUDA backend's default (``MLX_NOTEBOOK_PREFILL_THREAD=auto``: where
kernels are built per shape); forced on here, on the CPU, with the tiny
random-weight model: the tokens must equal solo runs exactly, pauses and stops
land in the side prefill, and the others keep streaming through them.
"""

from __future__ import annotations

import threading

import pytest

import mlx_notebook
from mlx_notebook.generation import session as session_module
from testkit.waiting import assert_stays_paused, in_prefill, wait_prefill_chunks, wait_state, wait_tokens

PROMPT = "Once upon a time the quick brown fox"
LONG = [(41 * i) % 250 + 20 for i in range(1500)]
PREFILL_THREAD = "mlx-notebook-prefill"


@pytest.fixture
def prefill_threads(monkeypatch):
    """The name of the thread each prefill ran on, in order."""
    names: list[str] = []
    real = session_module.prefill

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "prefill", spy)
    return names


def endless(worker, model) -> dict:
    """Keyword arguments that keep a generation going until stopped (its EOS tokens banned)."""
    eos = worker.call(lambda store: list(store.get(model).tokenizer.eos_token_ids))
    return {"max_tokens": 100_000, "logit_bias": {int(t): -1e9 for t in eos}}


def alone(worker, model, prompt, max_tokens, **kw):
    gen = mlx_notebook.generate(prompt, model=model, worker=worker, max_tokens=max_tokens, max_batch=1, **kw)
    gen.result(timeout=120)
    return gen.tokens


def test_a_joining_prompt_is_prefilled_on_the_prefill_thread_and_both_rows_stay_exact(
    side_worker, tiny_model, prefill_threads
):
    keep_going = endless(side_worker, tiny_model)
    joiner_alone = alone(side_worker, tiny_model, LONG, 12)
    first_alone = alone(side_worker, tiny_model, PROMPT, 400, logit_bias=keep_going["logit_bias"])
    prefill_threads.clear()
    first = mlx_notebook.generate(PROMPT, model=tiny_model, worker=side_worker, **keep_going)
    wait_tokens(first, 5)
    joiner = mlx_notebook.generate(LONG, model=tiny_model, worker=side_worker, max_tokens=12)
    joiner.result(timeout=120)
    wait_tokens(first, 400)
    first.cancel()
    assert first.wait(60)
    assert prefill_threads == ["mlx-notebook-worker", PREFILL_THREAD], prefill_threads
    assert joiner.stats.batch_size == 2, "the joining prompt never decoded with the other row"
    assert joiner.tokens == joiner_alone
    assert first.tokens[:400] == first_alone


def test_a_pause_lands_in_the_side_prefill_and_the_others_stream_through_it(side_worker, tiny_model, prefill_threads):
    keep_going = endless(side_worker, tiny_model)
    long = [(37 * i) % 250 + 20 for i in range(3500)]
    joiner_alone = alone(side_worker, tiny_model, long, 8)
    first = mlx_notebook.generate(PROMPT, model=tiny_model, worker=side_worker, **keep_going)
    wait_tokens(first, 5)
    joiner = mlx_notebook.generate(long, model=tiny_model, worker=side_worker, max_tokens=8, stop_budget=0.01)
    in_prefill(joiner, joiner.pause, chunks=2)
    wait_state(joiner, "paused")
    chunks = joiner.stats.prefill_chunks

    def others_stream() -> None:
        n = len(first.tokens)
        wait_tokens(first, n + 50)

    assert_stays_paused(joiner, others_stream)
    assert joiner.stats.prefill_chunks == chunks, "the prefill went on while paused"
    assert chunks < 3500 and not joiner.tokens, "the pause did not land in the prefill"
    assert prefill_threads[-1] == PREFILL_THREAD
    joiner.resume()
    joiner.result(timeout=120)
    first.cancel()
    assert first.wait(60)
    assert joiner.stats.batch_size == 2 and joiner.tokens == joiner_alone


def test_a_stop_in_the_side_prefill_ends_it_alone_and_the_worker_goes_on(side_worker, tiny_model, prefill_threads):
    keep_going = endless(side_worker, tiny_model)
    after_alone = alone(side_worker, tiny_model, PROMPT, 10)
    first = mlx_notebook.generate(PROMPT, model=tiny_model, worker=side_worker, **keep_going)
    wait_tokens(first, 5)
    long = [(43 * i) % 250 + 20 for i in range(3500)]
    joiner = mlx_notebook.generate(long, model=tiny_model, worker=side_worker, max_tokens=8, stop_budget=0.05)
    in_prefill(joiner, joiner.cancel, chunks=2)
    assert joiner.wait(30) and joiner.state == "stopped" and not joiner.tokens
    assert prefill_threads[-1] == PREFILL_THREAD
    # The other row goes on, and a generation after it runs as it would alone.
    n = len(first.tokens)
    wait_tokens(first, n + 20)
    first.cancel()
    assert first.wait(60) and first.state == "stopped"
    after = mlx_notebook.generate(PROMPT, model=tiny_model, worker=side_worker, max_tokens=10)
    after.result(timeout=120)
    assert after.tokens == after_alone


def test_shutdown_during_a_side_prefill_ends_both_threads(monkeypatch, tiny_model, prefill_threads):
    monkeypatch.setenv("MLX_NOTEBOOK_PREFILL_THREAD", "1")
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    first = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, **endless(worker, tiny_model))
    wait_tokens(first, 5)
    joiner = mlx_notebook.generate(LONG * 2, model=tiny_model, worker=worker, max_tokens=8, stop_budget=0.05)
    wait_prefill_chunks(joiner, 2)
    assert worker.shutdown(cancel=True, timeout=60), "the worker thread did not end"
    assert joiner.state == "stopped" and first.state == "stopped"
    assert not [t for t in threading.enumerate() if t.name == PREFILL_THREAD and t.is_alive()]


def test_the_default_prefills_in_turn_off_cuda(worker, tiny_model, prefill_threads, monkeypatch):
    monkeypatch.delenv("MLX_NOTEBOOK_PREFILL_THREAD", raising=False)
    first = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, **endless(worker, tiny_model))
    wait_tokens(first, 5)
    joiner = mlx_notebook.generate(LONG, model=tiny_model, worker=worker, max_tokens=4)
    joiner.result(timeout=120)
    first.cancel()
    assert first.wait(60)
    assert prefill_threads == ["mlx-notebook-worker", "mlx-notebook-worker"]


@pytest.fixture
def clear_cache_calls(monkeypatch):
    """The thread of every ``mx.clear_cache`` call, in order."""
    import mlx.core as mx

    names: list[str] = []
    real = mx.clear_cache

    def spy() -> None:
        names.append(threading.current_thread().name)
        real()

    monkeypatch.setattr(mx, "clear_cache", spy)
    return names


def test_the_side_prefill_leaves_the_buffer_cache_to_the_others_steps(side_worker, tiny_model, clear_cache_calls):
    """The buffer cache is the process's: a clear on the prefill thread would take the buffers of the others'
    next step (and on CUDA wait for the device with the GIL held); a prefill on the worker still clears after
    every chunk, as mlx-lm's does."""
    keep_going = endless(side_worker, tiny_model)
    first = mlx_notebook.generate(PROMPT, model=tiny_model, worker=side_worker, **keep_going)
    wait_tokens(first, 5)
    # Prompts of their own: the module's worker keeps a prompt cache, which would serve LONG whole.
    joining = [(47 * i) % 250 + 20 for i in range(3500)]
    joiner = mlx_notebook.generate(joining, model=tiny_model, worker=side_worker, max_tokens=4, stop_budget=0.01)
    joiner.result(timeout=120)
    n = len(first.tokens)
    wait_tokens(first, n + 5)
    first.cancel()
    assert first.wait(60)
    assert joiner.stats.prefill_chunks > 1 and joiner.stats.batch_size == 2
    assert PREFILL_THREAD not in clear_cache_calls, clear_cache_calls
    clear_cache_calls.clear()
    solo = [(53 * i) % 250 + 20 for i in range(3500)]
    alone_gen = mlx_notebook.generate(solo, model=tiny_model, worker=side_worker, max_tokens=1, stop_budget=0.01)
    alone_gen.result(timeout=120)
    assert clear_cache_calls.count("mlx-notebook-worker") >= alone_gen.stats.prefill_chunks > 1
