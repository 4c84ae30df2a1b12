"""The worker's queue without loading a model: order, cancel while queued, cancel_all, drain, shutdown.

The worker is held by a blocking ``call`` job, so generations stay queued and
never reach the engine; the model they name is an in-memory one (resolving it
is the only thing submit does with it).
"""

from __future__ import annotations

import threading

import mlx.nn as nn
import pytest

import mlx_notebook
from mlx_notebook import GenerationRequest, InvalidArgumentError, State, Worker

pytestmark = pytest.mark.unit


def hold(worker: Worker) -> tuple[threading.Event, threading.Thread]:
    """Register the in-memory model, then keep ``worker``'s thread busy in a call until the event returned is set."""
    worker.call(lambda store: store.register("held-model", nn.Linear(2, 2), tokenizer=None))
    started, release = threading.Event(), threading.Event()
    caller = threading.Thread(target=worker.call, args=(lambda store: (started.set(), release.wait(30)),))
    caller.start()
    assert started.wait(30)
    return release, caller


@pytest.fixture
def held_worker():
    """A worker whose thread is busy in a call until the test releases it."""
    worker = Worker()
    release, caller = hold(worker)
    yield worker
    worker.cancel_all()
    release.set()
    caller.join(30)
    assert worker.shutdown(timeout=30)


def submit(worker: Worker, **kw) -> mlx_notebook.Generation:
    return worker.submit(GenerationRequest("hello", model="held-model", **kw))


def test_queued_generations_are_listed_in_order(held_worker: Worker) -> None:
    gens = [submit(held_worker) for _ in range(3)]
    assert held_worker.queued() == gens == held_worker.active()
    assert all(g.state is State.QUEUED and not g.finished for g in gens)
    assert held_worker.history[-3:] == gens


def test_cancel_while_queued_stops_at_once_and_leaves_the_others(held_worker: Worker) -> None:
    first, second, third = (submit(held_worker) for _ in range(3))
    events: list[str] = []
    second.add_listener(lambda e: events.append(f"{e.kind}:{e.state}"))
    second.cancel()
    assert second.finished and second.state == "stopped" and second.stats.finish_reason == "stopped"
    assert second.stats.stop_latency_s is not None and second.stats.stop_latency_s < 1
    assert events == ["state:stopped"]
    assert held_worker.queued() == [first, third]
    assert second.result(timeout=0) == ""


def test_cancel_all_and_drain(held_worker: Worker) -> None:
    gens = [submit(held_worker) for _ in range(4)]
    assert held_worker.cancel_all() == gens
    assert held_worker.drain(timeout=5)
    assert all(g.state is State.STOPPED for g in gens) and held_worker.queued() == []


def test_pause_of_a_queued_generation_is_kept_for_when_it_runs(held_worker: Worker) -> None:
    gen = submit(held_worker)
    gen.pause()
    assert gen.token.pause_requested and gen.state is State.QUEUED
    gen.resume()
    assert not gen.token.pause_requested


def test_bad_requests_are_refused_before_queueing(held_worker: Worker) -> None:
    with pytest.raises(InvalidArgumentError, match="max_tokens must be >= 1"):
        submit(held_worker, max_tokens=0)
    with pytest.raises(InvalidArgumentError, match="stop_budget must be > 0"):
        submit(held_worker, stop_budget=0)
    with pytest.raises(TypeError, match="unknown option 'max_token'"):
        mlx_notebook.generate("hi", model="held-model", max_token=3, worker=held_worker)
    assert held_worker.queued() == []


def test_a_shut_down_worker_refuses_jobs() -> None:
    worker = Worker()
    assert worker.shutdown(timeout=5) and worker.closed
    with pytest.raises(RuntimeError, match="shut down"):
        worker.call(lambda store: None)
    replacement = mlx_notebook.default_worker()
    assert replacement is not None and not replacement.closed


def test_wait_times_out_on_a_queued_generation(held_worker: Worker) -> None:
    gen = submit(held_worker)
    assert not gen.wait(0.01)
    with pytest.raises(TimeoutError, match="still queued"):
        gen.result(timeout=0.01)


def test_a_worker_whose_thread_fails_outside_a_job_fails_its_queue_and_says_so(monkeypatch) -> None:
    # Before, an error outside any job (the idle warm-up's, mx.clear_cache's) ended the thread
    # silently: the worker stayed open and every queued or later generation waited forever.
    worker = Worker()
    release, caller = hold(worker)
    queued = [submit(worker), submit(worker)]
    call_error: list[BaseException] = []

    def queued_call() -> None:
        try:
            worker.call(lambda store: None, timeout=30)
        except BaseException as exc:  # the test reads it
            call_error.append(exc)

    waiter = threading.Thread(target=queued_call)
    waiter.start()
    with worker._cond:  # the call is queued behind the two generations before the loop fails
        assert worker._cond.wait_for(lambda: len(worker._queue) == 3, timeout=30)
    fault = RuntimeError("injected: the worker's loop failed")

    def failing_next_job():
        raise fault

    monkeypatch.setattr(worker, "_next_job", failing_next_job)
    release.set()
    caller.join(30)
    waiter.join(30)
    for gen in queued:
        assert gen.wait(30), "a queued generation was left waiting"
        assert gen.state is State.FAILED and gen.error is fault
    assert call_error == [fault]
    assert worker.closed
    with pytest.raises(RuntimeError, match="thread failed .*injected"):
        submit(worker)
    assert worker.shutdown(timeout=30) and not worker.alive
