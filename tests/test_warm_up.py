"""An idle worker runs a loaded model's first forward ahead of its first prompt (where first uses are costly).

The warm-up is wanted on MLX's CUDA backend only; here it is switched on for
the CPU, on the tiny random model, to check what it must not change: the
tokens of later generations, the worker's queue (it runs only while nothing
is queued, once per model), and a stop of a generation that waits behind it.
"""

from __future__ import annotations

import threading

import pytest

import mlx_notebook
from mlx_notebook import Worker
from mlx_notebook.generation import warm_up

PROMPT = "Once upon a time the quick brown fox"
# Waits here catch a hang, not a slow machine: CI's run of 12-04 had this file's ladder tests
# run 30-300x slower than anywhere else for four minutes (a 12-token generation unfinished
# after 120 s, the tests before and after at their usual speed). A failed test's report says
# what the machine did meanwhile (testkit.machine); pytest's own timeout is 600 s.
DEADLINE_S = 300


@pytest.fixture
def warmed_runs(monkeypatch):
    """Turn the warm-up on; yield the list of model keys it ran for and the event of each run's end."""
    runs: list[str] = []
    ended = threading.Condition()
    real = warm_up.warm

    def recording(loaded):
        real(loaded)
        with ended:
            runs.append(loaded.source.key)
            ended.notify_all()

    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "warm", recording)
    return runs, ended


def greedy_tokens(worker: Worker, model: str) -> list[int]:
    gen = mlx_notebook.generate(PROMPT, model=model, worker=worker, max_tokens=12)
    gen.result(timeout=DEADLINE_S)
    assert gen.state == "done"
    return gen.tokens


def test_an_idle_worker_warms_a_loaded_model_once_and_its_tokens_do_not_change(
    tiny_model, warmed_runs, monkeypatch, caplog
) -> None:
    runs, ended = warmed_runs
    caplog.set_level("DEBUG", logger=warm_up.__name__)
    monkeypatch.setattr(warm_up, "wanted", lambda: False)
    cold = Worker(prompt_cache_gb=0)
    try:
        cold.load_model(tiny_model)
        expected = greedy_tokens(cold, tiny_model)
    finally:
        assert cold.shutdown(timeout=30)
    assert runs == []

    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        with ended:
            assert ended.wait_for(lambda: len(runs) == 1, timeout=DEADLINE_S), "no warm-up after the load"
        assert greedy_tokens(worker, tiny_model) == expected
        worker.call(lambda store: None)  # another idle moment: nothing more to warm
        assert greedy_tokens(worker, tiny_model) == expected
        assert len(runs) == 1 and worker.store.loaded()[0].warmed
        assert not [r for r in caplog.records if "failed" in r.getMessage()]  # its forward ran
    finally:
        assert worker.shutdown(timeout=30)


def test_a_model_a_generation_loaded_is_not_warmed_after_it(tiny_model, warmed_runs) -> None:
    runs, _ = warmed_runs
    worker = Worker(prompt_cache_gb=0)
    try:
        greedy_tokens(worker, tiny_model)  # loads it inside the generation, which paid the first uses
        worker.call(lambda store: None)  # the worker was idle before this call and is again after it
        worker.call(lambda store: None)
        assert runs == []
    finally:
        assert worker.shutdown(timeout=30)


def test_a_generation_waiting_behind_the_warm_up_stops_at_once(tiny_model, monkeypatch) -> None:
    started, release = threading.Event(), threading.Event()
    real = warm_up.warm

    def slow(loaded):
        started.set()
        release.wait(DEADLINE_S)  # a first forward that takes long (seconds on a fresh CUDA process)
        real(loaded)

    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "warm", slow)
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        assert started.wait(DEADLINE_S)
        waiting = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=12)
        assert waiting.state == "queued"
        waiting.cancel()
        assert waiting.wait(timeout=1) and waiting.state == "stopped"
        assert waiting.stats.stop_latency_s is not None and waiting.stats.stop_latency_s < 0.1
        after = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=12)
        release.set()
        after.result(timeout=DEADLINE_S)
        assert after.state == "done" and len(after.tokens) == 12
    finally:
        release.set()
        assert worker.shutdown(timeout=30)


@pytest.fixture
def small_ladder(monkeypatch):
    """A ladder the tiny model runs in a second on the CPU: every power of two from 256, to 2k tokens."""
    monkeypatch.setattr(warm_up, "LADDER_SIZES", (256, 512, 1024))
    monkeypatch.setattr(warm_up, "LADDER_CONTEXT", 2048)


def buffers_after_each_update(monkeypatch) -> dict[tuple[int, int], int]:
    """``(offset before, tokens) -> cache buffer length after`` of every KVCache update from now on."""
    from mlx_lm.models.cache import KVCache

    seen: dict[tuple[int, int], int] = {}
    real = KVCache.update_and_fetch

    def recording(self, keys, values):
        start = self.offset
        out = real(self, keys, values)
        seen[(start, keys.shape[2])] = self.keys.shape[2]
        return out

    monkeypatch.setattr(KVCache, "update_and_fetch", recording)
    return seen


def test_the_ladder_runs_each_chunk_on_the_cache_layout_a_prompts_prefill_leaves(
    tiny_model, small_ladder, monkeypatch
) -> None:
    # cuDNN's attention graphs are keyed on shapes and strides: a ladder chunk builds the graph a
    # prompt's chunk then uses only if the key buffer it attends over is as long as the prompt's.
    from mlx_notebook.generation import prefill

    monkeypatch.setattr(prefill, "builds_kernels_per_shape", lambda: True)  # the planner's CUDA plan
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        loaded = worker.store.loaded()[0]
        in_prompt = buffers_after_each_update(monkeypatch)
        gen = mlx_notebook.generate([5 + i % 200 for i in range(2000)], model=tiny_model, worker=worker, max_tokens=1)
        gen.result(timeout=DEADLINE_S)
        # The big chunks, powers of two (the last, the prompt's rest, has a length of its own).
        prompt_chunks = {k: v for k, v in in_prompt.items() if k[1] >= 256 and k[1] & (k[1] - 1) == 0}
        assert len(prompt_chunks) >= 2, in_prompt
        loaded.prefill_shapes_seen.clear()
        in_ladder = buffers_after_each_update(monkeypatch)
        assert worker.call(lambda store: warm_up.warm_ladder(loaded, lambda: True))
        assert set(prompt_chunks) <= set(in_ladder)
        assert {k: in_ladder[k] for k in prompt_chunks} == prompt_chunks
        assert warm_up.ladder(loaded) == [] and len(loaded.prefill_shapes_seen) == 8 + 4 + 2
    finally:
        assert worker.shutdown(timeout=30)


def test_the_warm_ups_token_ids_stay_inside_the_models_vocabulary(tiny_model, small_ladder, monkeypatch) -> None:
    # MLX's gather checks no bounds: an id past the embedding's rows reads past its weights. The
    # ladder fed ids up to 1000 to this 376-token model, and CI's run of 12-06 segfaulted there.
    import mlx.nn as nn

    seen: list[tuple[int, int]] = []  # (largest id, rows) of every embedding lookup
    real = nn.Embedding.__call__

    def recording(self, x):
        seen.append((int(x.max()), self.weight.shape[0]))
        return real(self, x)

    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        loaded = worker.store.loaded()[0]
        monkeypatch.setattr(nn.Embedding, "__call__", recording)
        worker.call(lambda store: warm_up.warm(loaded))
        assert worker.call(lambda store: warm_up.warm_ladder(loaded, lambda: True))
        assert len(seen) == 2 + 1 + 8 + 4 + 2  # the warm-up's two forwards, the ladder's layout probe and chunks
        assert max(top for top, _ in seen) > 200  # varied ids, not one
        assert all(top < rows for top, rows in seen), seen
    finally:
        assert worker.shutdown(timeout=30)


def test_the_ladder_stops_when_a_job_is_queued_and_takes_up_where_it_left(tiny_model, small_ladder) -> None:
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        loaded = worker.store.loaded()[0]
        full = warm_up.ladder(loaded)
        assert len(full) == 8 + 4 + 2 and full[0][0] == 0 and full[-1][0] == 2048 - 256
        asked = []

        def three_then_a_job() -> bool:
            asked.append(1)
            return len(asked) <= 3

        assert worker.call(lambda store: warm_up.warm_ladder(loaded, three_then_a_job)) is False
        assert len(asked) == 4  # asked before each chunk: the job waited for one
        assert loaded.prefill_shapes_seen == set(full[:3])  # the lowest starts first
        assert warm_up.ladder(loaded) == full[3:]
        assert worker.call(lambda store: warm_up.warm_ladder(loaded, lambda: True)) is True
        assert warm_up.ladder(loaded) == []
    finally:
        assert worker.shutdown(timeout=30)


def test_an_idle_worker_runs_the_ladder_and_a_generation_queued_meanwhile_goes_first(
    tiny_model, small_ladder, monkeypatch
) -> None:
    real_chunk, real_ladder = warm_up._first_layer, warm_up.warm_ladder
    in_chunk, release = threading.Event(), threading.Event()
    ended = threading.Condition()
    results: list[bool] = []

    def held_chunk(model, owner, cache, ids):
        if ids.shape[1] >= 256 and not release.is_set():
            in_chunk.set()
            release.wait(DEADLINE_S)  # a ladder chunk still running when the generation is submitted
        real_chunk(model, owner, cache, ids)

    def recording(loaded, keep_going):
        done = real_ladder(loaded, keep_going)
        with ended:
            results.append(done)
            ended.notify_all()
        return done

    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "_first_layer", held_chunk)
    monkeypatch.setattr(warm_up, "warm_ladder", recording)
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        assert in_chunk.wait(DEADLINE_S), "no ladder after the load"
        gen = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=12)
        assert gen.state == "queued"
        release.set()
        gen.result(timeout=DEADLINE_S)
        assert gen.state == "done" and len(gen.tokens) == 12
        with ended:
            assert ended.wait_for(lambda: True in results, timeout=DEADLINE_S), results
        assert results[0] is False  # given up for the generation, then taken up again
        loaded = worker.store.loaded()[0]
        worker.call(lambda store: None)  # the worker sets ladder_warmed after `recording` returns, before its next job
        assert loaded.ladder_warmed and warm_up.ladder(loaded) == []
    finally:
        release.set()
        assert worker.shutdown(timeout=30)


def test_a_prompts_rest_runs_padded_to_a_ladder_chunk_and_its_tokens_do_not_change(
    tiny_model, small_ladder, monkeypatch
) -> None:
    from mlx_notebook.generation import prefill

    monkeypatch.setattr(prefill, "builds_kernels_per_shape", lambda: True)  # the planner's CUDA plan
    real_padding = prefill.padded_to_seen
    prompt = [5 + i % 200 for i in range(1001)]  # 1,000 tokens prefilled, the last fed by the first step
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        loaded = worker.store.loaded()[0]

        def run() -> list[int]:
            gen = mlx_notebook.generate(prompt, model=tiny_model, worker=worker, max_tokens=8)
            gen.result(timeout=DEADLINE_S)
            assert gen.state == "done"
            return gen.tokens

        monkeypatch.setattr(prefill, "padded_to_seen", lambda n, *rest: n)
        unpadded = run()
        loaded.prefill_shapes_seen.clear()
        assert worker.call(lambda store: warm_up.warm_ladder(loaded, lambda: True))
        monkeypatch.setattr(prefill, "padded_to_seen", real_padding)
        updates = buffers_after_each_update(monkeypatch)
        assert run() == unpadded
        past_the_end = [(start, n) for start, n in updates if n > 1 and start + n > 1000]
        assert past_the_end and all((start, n) in loaded.prefill_shapes_seen for start, n in past_the_end)
        assert (1000, 1) in updates  # the first step wrote the last prompt token over the pad
    finally:
        assert worker.shutdown(timeout=30)


def test_a_failing_idle_warm_up_leaves_the_worker_serving(tiny_model, monkeypatch, caplog) -> None:
    # An error escaping the warm-up (here its kernels' step; on a device an MLX error such as
    # the CUDA graph cache's "Cache thrashing") ended the worker's thread: every later
    # generation stayed queued for good. Now the warm-up is given up and the prompts run.
    tried = threading.Event()

    def failing(loaded):
        tried.set()
        raise RuntimeError("injected: the kernels' compile failed")

    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "install_kernels", failing)
    caplog.set_level("WARNING", logger="mlx_notebook.generation.worker")
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        assert tried.wait(DEADLINE_S), "the warm-up never reached its kernels"
        gen = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=6)
        gen.result(timeout=DEADLINE_S)
        assert gen.state == "done" and len(gen.tokens) == 6
        assert worker.alive and not worker.closed
        loaded = worker.store.loaded()[0]
        assert loaded.warmed and loaded.kernels_installed and loaded.ladder_warmed  # not tried again
        assert [r for r in caplog.records if "idle warm-up" in r.getMessage() and "injected" in r.getMessage()]
    finally:
        assert worker.shutdown(timeout=30)
