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
    gen.result(timeout=120)
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
            assert ended.wait_for(lambda: len(runs) == 1, timeout=60), "no warm-up after the load"
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
        release.wait(60)  # a first forward that takes long (seconds on a fresh CUDA process)
        real(loaded)

    monkeypatch.setattr(warm_up, "wanted", lambda: True)
    monkeypatch.setattr(warm_up, "warm", slow)
    worker = Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        assert started.wait(60)
        waiting = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=12)
        assert waiting.state == "queued"
        waiting.cancel()
        assert waiting.wait(timeout=1) and waiting.state == "stopped"
        assert waiting.stats.stop_latency_s is not None and waiting.stats.stop_latency_s < 0.1
        after = mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=12)
        release.set()
        after.result(timeout=120)
        assert after.state == "done" and len(after.tokens) == 12
    finally:
        release.set()
        assert worker.shutdown(timeout=30)
