"""The engine, worker and Generation API on a small random-weight model.

Fast tests of the invariants: exact greedy output (against plain mlx-lm),
exact pause/resume, bounded stop in every phase, nothing lost after a stop or
an MLX error, queue order, and clear errors for bad input.
"""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_notebook
from mlx_notebook import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from testkit.waiting import (
    assert_stays_paused,
    held,
    in_prefill,
    other_generation,
    wait_state,
    wait_tokens,
    wait_until,
)

PROMPT = "Once upon a time the quick brown fox"


def run(worker, model, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 40)
    return mlx_notebook.generate(prompt, model=model, worker=worker, **kw)


def reference(worker, model, **kw):
    gen = run(worker, model, **kw)
    gen.result(timeout=120)
    assert gen.state == "done"
    return gen.tokens


def test_greedy_matches_plain_mlx_lm(worker, tiny_model):
    from mlx_lm import stream_generate

    gen = run(worker, tiny_model, max_tokens=30)
    gen.result(timeout=120)
    model, tokenizer = mlx_notebook.load_model(tiny_model, worker=worker)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    # Plain mlx-lm must run on the worker thread too: streams belong to threads.
    expected = worker.call(lambda store: [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=30)])
    eos = set(tokenizer.eos_token_ids)
    expected = [t for t in expected if t not in eos]
    assert gen.tokens == expected
    assert gen.stats.generated_tokens == len(expected)
    assert gen.stats.prompt_tokens == len(ids)
    assert gen.text == tokenizer.decode(expected)


def test_stats_are_filled(worker, tiny_model):
    gen = run(worker, tiny_model, max_tokens=12)
    gen.result(timeout=60)
    s = gen.stats
    assert s.generated_tokens == 12 and s.finish_reason == "length"
    assert s.ttft_s > 0 and s.prompt_tps > 0 and s.generation_tps > 0
    assert s.peak_memory_gb > 0 and s.stop_latency_s is None
    assert s.prefill_pieces == "layers"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}])
def test_pause_resume_gives_uninterrupted_tokens(worker, tiny_model, sampling):
    expected = reference(worker, tiny_model, max_tokens=60, **sampling)
    assert len(expected) == 60, "the reference meets EOS early: pauses below need room"
    gen = run(worker, tiny_model, max_tokens=60, **sampling)
    rng = random.Random(1)
    # Pauses at random token counts, each before the end: each must take effect and hold.
    for at in sorted(rng.sample(range(2, 50), 5)):
        wait_tokens(gen, at)
        gen.pause()
        assert_stays_paused(gen, lambda: other_generation(worker, tiny_model))
        gen.resume()
    gen.result(timeout=60)
    assert gen.tokens == expected


def test_seeded_sampling_is_reproducible_and_seed_dependent(worker, tiny_model):
    a = reference(worker, tiny_model, temperature=1.0, seed=3, max_tokens=30)
    b = reference(worker, tiny_model, temperature=1.0, seed=3, max_tokens=30)
    c = reference(worker, tiny_model, temperature=1.0, seed=4, max_tokens=30)
    assert a == b
    assert a != c


def test_stop_during_decode_keeps_partial_text_and_model(worker, tiny_model):
    expected = reference(worker, tiny_model, max_tokens=40)
    gen = run(worker, tiny_model, max_tokens=100000)
    wait_tokens(gen, 5)
    gen.cancel()
    assert gen.wait(60)
    assert gen.state == "stopped"
    assert gen.stats.finish_reason == "stopped"
    assert 0 <= gen.stats.stop_latency_s < 5
    assert gen.tokens[:5] == expected[:5]
    partial = gen.text
    assert partial and gen.result() == partial
    assert reference(worker, tiny_model, max_tokens=40) == expected


def test_stop_during_load_keeps_nothing_half_loaded(worker, tiny_model, tmp_path):
    from testkit.tiny_model import make_tiny_model

    folder = str(make_tiny_model(tmp_path / "m", layers=8, hidden=256, intermediate=512))
    cancelled_at = []

    def on_event(event):
        # Stop as soon as the first parameter batch is in.
        if event.kind == "progress" and event.phase.startswith("load") and 0 < event.done < event.total:
            if not cancelled_at:
                cancelled_at.append(event.done)
                event.generation.cancel()

    # A running job keeps the next one queued while its listener is attached.
    blocker = run(worker, tiny_model, max_tokens=100000)
    gen = run(worker, folder, stop_budget=0.0005)
    gen.add_listener(on_event)
    blocker.cancel()
    assert gen.wait(30)
    assert cancelled_at, "no load progress was reported"
    assert gen.state == "stopped" and gen.stats.stop_latency_s < 5
    assert all(m.source.path.name != "m" for m in worker.store.loaded())
    # The model loads and generates afterwards.
    assert len(reference(worker, folder, max_tokens=5)) == 5


def test_stop_during_prefill_of_a_long_prompt(worker, tiny_model):
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 300)
    gen = run(worker, tiny_model, prompt=long_prompt, max_tokens=5, stop_budget=0.01)
    # Stop once a prefill chunk is done, with most of the prompt still ahead.
    in_prefill(gen, gen.cancel)
    assert gen.wait(60)
    assert gen.state == "stopped"
    assert gen.stats.generated_tokens == 0 and gen.stats.ttft_s is None
    # Layer pieces let a stop land inside the first chunk, so no chunk count
    # is promised; the stop itself is what must be quick.
    assert gen.stats.stop_latency_s < 5


def test_pause_during_prefill_then_resume_is_exact(worker, tiny_model):
    long_prompt = " ".join(["rivers flow to the sea"] * 400)
    worker.prompt_cache_gb = 0  # the second run must prefill the prompt again
    try:
        expected = reference(worker, tiny_model, prompt=long_prompt, max_tokens=20)
        beside = run(worker, tiny_model, max_tokens=100000)
        wait_tokens(beside, 2)
        gen = run(worker, tiny_model, prompt=long_prompt, max_tokens=20, stop_budget=0.005)
    finally:
        worker.prompt_cache_gb = 2
    try:
        # Pause once a prefill chunk is done and most of the prompt is still ahead
        # (right after "prefilling" the test thread may be scheduled too late).
        in_prefill(gen, gen.pause)
        # The chunk in flight when the pause came may still end and count: nothing moves
        # from the moment the pause took effect. A paused prefill runs the other rows'
        # steps (a new generation would queue behind it): while a generation that was
        # decoding before makes 8 more tokens, no chunk and no token comes.
        wait_state(gen, "paused")
        chunks = gen.stats.prefill_chunks
        assert_stays_paused(gen, lambda: wait_tokens(beside, len(beside.tokens) + 8))
        assert gen.tokens == [] and gen.stats.prefill_chunks == chunks
        beside.cancel()
        gen.resume()
        gen.result(timeout=60)
        assert gen.tokens == expected
    finally:
        # A failure must not leave the shared worker behind a paused prefill.
        for g in (beside, gen):
            g.cancel()
            g.wait(60)


def test_queue_runs_in_order_and_cancelled_queued_job_never_runs(worker, tiny_model):
    order = []
    lock = threading.Lock()

    def track(event):
        if event.kind == "state" and event.state == "loading":
            with lock:
                order.append(event.generation.id)

    gens = []
    with held(worker):  # all four queued while the listeners go on and the third is cancelled
        for _ in range(4):
            g = run(worker, tiny_model, max_tokens=8)
            g.add_listener(track)
            gens.append(g)
        gens[2].cancel()
    for g in gens:
        assert g.wait(60)
    assert gens[2].state == "stopped" and gens[2].tokens == []
    ran = [g.id for g in gens if g is not gens[2]]
    assert order == ran and gens[2].id not in order


def test_mlx_error_fails_only_that_generation(worker, tiny_model):
    expected = reference(worker, tiny_model, max_tokens=10)
    model, _ = mlx_notebook.load_model(tiny_model, worker=worker)
    layers = model.model.layers
    original = layers[1]

    class Broken:
        """Fault injection: the layer fails like an impossible allocation."""

        def __call__(self, *args, **kwargs):
            raise RuntimeError("[metal::malloc] Attempting to allocate 1e15 bytes")

        def __getattr__(self, name):
            return getattr(original, name)

    layers[1] = Broken()
    try:
        gen = run(worker, tiny_model, max_tokens=10)
        with pytest.raises(RuntimeError, match="allocate"):
            gen.result(timeout=60)
        assert gen.state == "failed" and isinstance(gen.error, RuntimeError)
    finally:
        layers[1] = original
    assert worker.alive
    assert reference(worker, tiny_model, max_tokens=10) == expected


def test_a_layer_swapped_before_the_first_generation_and_back_is_what_runs(worker, tiny_model):
    """The layers list ``load_model`` hands out is the one the forward pass reads, before the model's first
    generation too (the engine gives it its final form on first use: an edit of the list taken before went
    nowhere, and a layer broken for a fault and put back stayed broken; session 37's fault campaign)."""
    expected = reference(worker, tiny_model, max_tokens=10)
    fresh = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        model, _ = mlx_notebook.load_model(tiny_model, worker=fresh)
        layers = model.model.layers
        original = layers[1]

        class Broken(nn.Module):
            def __call__(self, *args, **kwargs):
                raise RuntimeError("[fault injection] layer failed on purpose")

            def __getattr__(self, name):  # the model reads attributes off its layers (use_sliding)
                return getattr(original, name)

        layers[1] = Broken()
        gen = run(fresh, tiny_model, max_tokens=10)
        with pytest.raises(RuntimeError, match="fault injection"):
            gen.result(timeout=60)
        layers[1] = original
        assert model.model.layers is layers
        assert reference(fresh, tiny_model, max_tokens=10) == expected
    finally:
        assert fresh.shutdown(timeout=60)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"prompt": ""}, InvalidArgumentError, "prompt is empty"),
        ({"prompt": "   \n\t"}, InvalidArgumentError, "prompt is empty"),
        ({"prompt": None}, InvalidArgumentError, "prompt must be a string"),
        ({"max_tokens": 0}, InvalidArgumentError, "max_tokens must be >= 1"),
        ({"max_tokens": -5}, InvalidArgumentError, "max_tokens must be >= 1"),
        ({"max_tokens": 2.5}, InvalidArgumentError, "max_tokens must be an integer"),
        ({"stop_budget": 0}, InvalidArgumentError, "stop_budget must be > 0"),
        ({"stop_budget": -1.0}, InvalidArgumentError, "stop_budget must be > 0"),
        ({"stop_budget": float("nan")}, InvalidArgumentError, "stop_budget must be a number"),
        ({"temperature": -0.1}, InvalidArgumentError, "temperature must be >= 0"),
        ({"top_p": 0}, InvalidArgumentError, "top_p must be > 0"),
        ({"top_p": 1.5}, InvalidArgumentError, "top_p must be > 0.0 and <= 1.0"),
        ({"seed": -1}, InvalidArgumentError, "seed must be >= 0"),
        ({"model": "no-such-model"}, ModelNotFoundError, "not found"),
        ({"model": "/nonexistent/model.gguf"}, ModelNotFoundError, "no such file"),
        ({"model": "someorg/not-cached-model"}, ModelNotFoundError, "not in the local Hugging Face cache"),
    ],
)
def test_bad_input_is_one_clear_line_and_worker_survives(worker, tiny_model, kwargs, error, words):
    kw = {"prompt": PROMPT, "model": tiny_model, **kwargs}
    prompt = kw.pop("prompt")
    with pytest.raises(error) as info:
        mlx_notebook.generate(prompt, worker=worker, **kw)
    message = str(info.value)
    assert words in message and "\n" not in message
    assert len(reference(worker, tiny_model, max_tokens=3)) == 3


def test_non_model_files_are_rejected_clearly(worker, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelFormatError, match="not a model file"):
        mlx_notebook.generate("hi", model=str(text), worker=worker)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        mlx_notebook.generate("hi", model=str(empty_dir), worker=worker)


def test_prompt_longer_than_context_fails_cleanly(worker, tiny_model):
    gen = run(worker, tiny_model, prompt="fox " * 5000, max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="context is 4096"):
        gen.result(timeout=60)
    assert gen.state == "failed"
    assert len(reference(worker, tiny_model, max_tokens=3)) == 3


def test_listener_errors_do_not_break_generation(worker, tiny_model):
    expected = reference(worker, tiny_model, max_tokens=10)
    calls = []

    def broken(event):
        calls.append(event.kind)
        raise ValueError("display bug")

    with held(worker):  # the broken listener is attached before the generation starts
        gen = run(worker, tiny_model, max_tokens=10)
        gen.add_listener(broken)
    gen.result(timeout=60)
    assert gen.state == "done" and gen.tokens == expected
    # It ran, and raised, on every kind of event.
    assert {"state", "progress", "tokens"} <= set(calls), calls


def test_worker_shutdown_cancels_and_joins(tiny_model):
    w = mlx_notebook.Worker()
    gen = mlx_notebook.generate(PROMPT, model=tiny_model, worker=w, max_tokens=100000)
    wait_tokens(gen, 2)
    assert w.shutdown(timeout=30)
    assert gen.state == "stopped" and not w.alive
    with pytest.raises(RuntimeError, match="shut down"):
        mlx_notebook.generate(PROMPT, model=tiny_model, worker=w)


def test_memory_returns_to_baseline_after_stops(worker, tiny_model):
    reference(worker, tiny_model, max_tokens=5)
    base = worker.call(lambda store: mx.get_active_memory())
    for _ in range(3):
        gen = run(worker, tiny_model, max_tokens=100000)
        wait_tokens(gen, 3)
        gen.cancel()
        assert gen.wait(60) and gen.state == "stopped"
    after = worker.call(lambda store: mx.get_active_memory())
    assert after <= base * 1.05 + 1_000_000


def test_freed_cache_is_returned_once_the_worker_is_idle(worker, tiny_model):
    """The worker frees a stopped generation's cached buffers once idle, a
    moment after the stop (so a thread woken by the stop is not kept waiting
    for the GIL while GBs are returned to the device)."""
    gen = run(worker, tiny_model, prompt=" ".join(["word"] * 200), max_tokens=100000)
    wait_tokens(gen, 3)
    gen.cancel()
    assert gen.wait(60) and gen.state == "stopped"
    # Read from this thread: a worker.call would itself make the worker clean up.
    wait_until(lambda: mx.get_cache_memory() < 1_000_000, 30, "the idle worker to free the cache")


def test_layer_groups_shrink_as_the_context_grows(tiny_model):
    """Attention makes each token cost more the longer the context before it:
    layer groups are planned from a fit over recent chunks, not the last one."""
    from pathlib import Path

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mlx_notebook.control import CancelToken, Pace
    from mlx_notebook.generation.pieces import LayerRunner

    model, _ = load_model(Path(tiny_model))
    cache = make_prompt_cache(model)
    runner = LayerRunner(model.model, model, cache, Pace(CancelToken(), 0.1))
    runner.queued = 1  # one group queued, as on a GPU: the budget halves per group
    # Seconds per layer per token measured at mean context positions 100 and 300.
    runner._samples = [(100.0, 1e-4), (300.0, 2e-4)]
    assert runner._per_layer_token(500.0) == pytest.approx(3e-4)
    cache[0].offset = 450  # the next 100-token chunk's mean position: 500
    runner._plan(100)
    assert runner.group == int(0.1 / 2 / (3e-4 * 100))  # 1 layer; the last rate alone would give 2
    # A falling rate (noise) never plans below the last measurement.
    runner._samples = [(100.0, 2e-4), (300.0, 1e-4)]
    assert runner._per_layer_token(500.0) == pytest.approx(1e-4)


def test_decode_keeps_one_step_in_flight_when_two_do_not_fit(worker, tiny_model):
    expected = reference(worker, tiny_model, max_tokens=24)
    roomy = run(worker, tiny_model, max_tokens=24, stop_budget=10.0)
    roomy.result(timeout=60)
    # A budget below one step: one step in flight, said in the stats, same tokens.
    tight = run(worker, tiny_model, max_tokens=24, stop_budget=1e-7)
    tight.result(timeout=60)
    assert roomy.tokens == tight.tokens == expected
    assert roomy.stats.decode_in_flight == 2 and not roomy.stats.budget_below_step
    assert tight.stats.decode_in_flight == 1 and tight.stats.budget_below_step
    assert tight.stats.decode_step_s is not None and tight.stats.decode_step_s > 1e-7


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 3}])
def test_pause_resume_is_exact_with_one_step_in_flight(worker, tiny_model, sampling):
    expected = reference(worker, tiny_model, max_tokens=30, stop_budget=1e-7, **sampling)
    gen = run(worker, tiny_model, max_tokens=30, stop_budget=1e-7, **sampling)
    wait_tokens(gen, 5)
    gen.pause()
    assert_stays_paused(gen, lambda: other_generation(worker, tiny_model))
    gen.resume()
    gen.result(timeout=60)
    assert gen.tokens == expected


def test_wired_limit_on_metal_is_raised_and_restored_after_a_sync(worker, tiny_model, monkeypatch):
    """Metal faked (nothing here runs on Apple hardware): what mlx-lm's wired_limit does, on the worker's stream."""
    from mlx_notebook.generation import wired

    # The limit is raised when a session opens. An earlier test's session may
    # still be in its loop (its generation ended, the loop not yet returned):
    # a generation submitted then joins it and opens nothing. A call queued
    # now runs only once that session has ended.
    worker.call(lambda store: None, timeout=30)
    calls = []
    real_sync = mx.synchronize
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 1 << 30})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(("limit", n)) or 7)

    def sync(*args):
        calls.append(("sync",))
        return real_sync(*args)

    monkeypatch.setattr(wired.mx, "synchronize", sync)
    expected = reference(worker, tiny_model, max_tokens=12)
    # The limit is held while the worker runs generations of the model: a
    # call queued behind them runs once that ends.
    worker.call(lambda store: None, timeout=30)
    limits = [c for c in calls if c[0] == "limit"]
    assert limits == [("limit", 1 << 30), ("limit", 7)]
    # The old limit comes back only after the stream was synchronized.
    restore = calls.index(("limit", 7))
    assert ("sync",) in calls[calls.index(("limit", 1 << 30)) : restore]
    # A stop restores it too.
    calls.clear()
    gen = run(worker, tiny_model, max_tokens=100000)
    wait_tokens(gen, 3)
    gen.cancel()
    assert gen.wait(30) and gen.state == "stopped"
    worker.call(lambda store: None, timeout=30)
    assert [c for c in calls if c[0] == "limit"] == [("limit", 1 << 30), ("limit", 7)]
    assert expected  # the model kept generating normally under the fake


def test_no_wired_limit_off_metal(worker, tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n) or 0)
    reference(worker, tiny_model, max_tokens=4)
    assert calls == []
