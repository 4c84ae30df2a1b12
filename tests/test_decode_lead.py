"""A lone row's next step starts before its token is read: the same tokens, exact pauses, clean stops.

With one step in flight (two do not fit the stop budget) the next step's
first layers are queued behind the running one before its token is read
(on by default on CUDA, ``MLX_NOTEBOOK_DECODE_LEAD=1`` anywhere; see
``DecodeBatch._lead_layers``). Here a small random llama (9 layers: a lead
of one) runs with the step count kept at one in flight, as on a GPU whose
two steps overrun the budget; what is checked is that the lead changes no
token and no stop or pause, and where it is on by default.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_notebook
from mlx_notebook.generation import decode_batch
from mlx_notebook.generation.decode_batch import DecodeBatch
from testkit.tiny_model import make_tiny_model
from testkit.waiting import assert_stays_paused, other_generation, wait_state, wait_tokens, wait_until

PROMPT = "A long walk along the river, counting the bridges and the boats under them " * 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("lead") / "model", layers=9, hidden=128, intermediate=256))


@pytest.fixture
def one_in_flight(monkeypatch) -> list[int]:
    """One step in flight whatever the step time; the leads queued before a read (their layer counts)."""
    measure = DecodeBatch._measure

    def measure_one(self, seconds):
        measure(self, seconds)
        self.in_flight = 1
        for row in self.rows:
            row.sink.stats.decode_in_flight = 1

    monkeypatch.setattr(DecodeBatch, "_measure", measure_one)
    queued: list[int] = []
    leads: dict[int, tuple[mx.array, int]] = {}  # the array kept: its id is not reused meanwhile
    forward, async_eval = DecodeBatch._forward, mx.async_eval

    def forward_spy(self, inputs, stoppable=False, beside=None):
        step = forward(self, inputs, stoppable, beside)
        if step is not None and step.lead is not None:
            leads[id(step.lead)] = (step.lead, self.rows[0].sink.stats.decode_lead_layers)
        return step

    def async_eval_spy(*arrays):
        for a in arrays:
            if id(a) in leads:
                queued.append(leads.pop(id(a))[1])
        return async_eval(*arrays)

    monkeypatch.setattr(DecodeBatch, "_forward", forward_spy)
    monkeypatch.setattr(mx, "async_eval", async_eval_spy)
    return queued


# A stop budget no hiccup of a busy CI machine overruns: whether a lead fits the budget is
# tests/test_decode_pacing.py's; here a step that overran it would be built without one.
ROOMY_BUDGET = 5.0


def _run(worker, folder: str, max_tokens: int = 40) -> mlx_notebook.Generation:
    gen = mlx_notebook.generate(PROMPT, model=folder, worker=worker, max_tokens=max_tokens, stop_budget=ROOMY_BUDGET)
    gen.result(timeout=120)
    assert gen.state == "done", gen.error
    return gen


def test_a_lead_changes_no_token_and_a_pause_stays_exact(worker, folder: str, one_in_flight, monkeypatch) -> None:
    worker.prompt_cache_gb = 0  # every run prefills its own prompt
    reference = _run(worker, folder)
    assert reference.stats.decode_in_flight == 1 and reference.stats.decode_lead_layers == 0
    assert not one_in_flight

    monkeypatch.setenv("MLX_NOTEBOOK_DECODE_LEAD", "1")
    led = _run(worker, folder)
    assert set(one_in_flight) == {1}  # round(9 / 9)
    # Every step after the first two (the step time is known from the second read) was led.
    assert len(one_in_flight) >= len(led.tokens) - 4, (len(one_in_flight), len(led.tokens))
    assert led.tokens == reference.tokens

    gen = mlx_notebook.generate(PROMPT, model=folder, worker=worker, max_tokens=40)
    wait_tokens(gen, 12)
    gen.pause()
    assert_stays_paused(gen, lambda: other_generation(worker, folder))
    gen.resume()
    gen.result(timeout=120)
    assert gen.tokens == reference.tokens


def test_a_stop_with_a_lead_queued_ends_clean_and_the_model_stays_correct(
    worker, folder: str, one_in_flight, monkeypatch
) -> None:
    worker.prompt_cache_gb = 0
    reference = _run(worker, folder, max_tokens=200)
    monkeypatch.setenv("MLX_NOTEBOOK_DECODE_LEAD", "1")
    for _ in range(5):
        gen = mlx_notebook.generate(PROMPT, model=folder, worker=worker, max_tokens=200)
        wait_tokens(gen, 8)
        gen.stop()
        wait_state(gen, "stopped")
        assert not gen.error
        assert gen.tokens == reference.tokens[: len(gen.tokens)]
    assert one_in_flight
    # The stopped steps' leads left nothing behind: the next generation gives the reference's tokens.
    assert _run(worker, folder, max_tokens=200).tokens == reference.tokens


def test_the_lead_is_on_by_default_where_kernels_are_built_per_shape(worker, folder: str, one_in_flight, monkeypatch):
    """The default: on CUDA's side of the switch (forced here), off on the CPU's and with ``0``."""
    worker.prompt_cache_gb = 0
    monkeypatch.delenv("MLX_NOTEBOOK_DECODE_LEAD", raising=False)
    assert _run(worker, folder).stats.decode_lead_layers == 0  # the CPU: off
    assert not one_in_flight

    monkeypatch.setattr(decode_batch, "builds_kernels_per_shape", lambda: True)
    # A batch reads the backend once, when made: the next run must open a new session, not join the last
    # one while it winds down (on a busy machine it often did, and ran on the CPU's batch).
    wait_until(lambda: worker.session is None, what="the last run's session to end")
    _run(worker, folder)
    # The leads queued, not the stats' last step: a step built after the rows changed (the
    # first, or one after other work on the worker) is built whole and reports 0.
    assert set(one_in_flight) == {1}
    monkeypatch.setenv("MLX_NOTEBOOK_DECODE_LEAD", "0")
    queued = len(one_in_flight)
    assert _run(worker, folder).stats.decode_lead_layers == 0
    assert len(one_in_flight) == queued
