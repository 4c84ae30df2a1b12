"""Decode steps longer than the stop budget go in groups of layers: the same tokens, stops between groups.

A real generation on a small random llama (8 layers) with a stop budget far
below one step, so that every step is cut into one-layer groups: its tokens
equal whole steps' tokens, a pause and resume stay exact, and a stop that
lands between two groups ends the generation without the rest of the step,
leaving a cache that a later prompt reuses with the right numbers.
"""

from __future__ import annotations

import pytest

import mlx_notebook
from mlx_notebook.generation import prefix_cache
from mlx_notebook.generation.decode_batch import DecodeBatch
from testkit.tiny_model import make_tiny_model
from testkit.waiting import assert_stays_paused, other_generation, wait_state, wait_tokens

PROMPT = "A long walk along the river, counting the bridges and the boats under them " * 3
TINY_BUDGET = 0.0005  # far below one step of this model on any machine: one layer per group


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("pieces") / "model", layers=8, hidden=128, intermediate=256))


def _run(worker, folder: str, prompt, budget: float, max_tokens: int = 40) -> mlx_notebook.Generation:
    gen = mlx_notebook.generate(prompt, model=folder, worker=worker, max_tokens=max_tokens, stop_budget=budget)
    gen.result(timeout=120)
    assert gen.state == "done", gen.error
    return gen


def _fresh_run(folder: str, prompt) -> mlx_notebook.Generation:
    """``prompt`` on a new worker with no prompt cache: the tokens a model that nothing touched gives."""
    fresh_worker = mlx_notebook.Worker()
    try:
        fresh_worker.prompt_cache_gb = 0
        return _run(fresh_worker, folder, prompt, 0.1, max_tokens=16)
    finally:
        assert fresh_worker.shutdown(timeout=60)


ROW_PROMPTS = [PROMPT, "Counting boats under the bridges " * 4, "The river bends twice before the sea " * 3]
# Greedy runs of 181, 300 and 300 tokens on this model (the second of ROW_PROMPTS ends at 8 by EOS, before
# a stop after up to 9 tokens would land).
LONG_PROMPTS = [PROMPT, "Boats under the bridges, counted one by one " * 3, "Bridges and boats " * 6]


def _spy_group_waits(monkeypatch) -> list[tuple[bool, bool]]:
    """Each group of a step in flight waited on: (during the next step's build, whether a row goes on)."""
    waits: list[tuple[bool, bool]] = []
    building = [False]
    forward, wait_group = DecodeBatch._forward, DecodeBatch._wait_group

    def forward_spy(self, inputs, stoppable=False, beside=None):
        building[0] = True
        try:
            return forward(self, inputs, stoppable, beside)
        finally:
            building[0] = False

    def wait_spy(self, step):
        going_on = wait_group(self, step)
        waits.append((building[0], going_on))
        return going_on

    monkeypatch.setattr(DecodeBatch, "_forward", forward_spy)
    monkeypatch.setattr(DecodeBatch, "_wait_group", wait_spy)
    return waits


def test_steps_in_groups_give_whole_steps_tokens_and_pause_exactly(worker, folder: str) -> None:
    worker.prompt_cache_gb = 0  # every run prefills its own prompt
    try:
        whole = _run(worker, folder, PROMPT, 0.1)
        assert whole.stats.decode_pieces == 1
        grouped = _run(worker, folder, PROMPT, TINY_BUDGET)
        assert grouped.stats.budget_below_step
        assert grouped.stats.decode_pieces == 8  # one layer each
        assert grouped.tokens == whole.tokens

        gen = mlx_notebook.generate(PROMPT, model=folder, worker=worker, max_tokens=40, stop_budget=TINY_BUDGET)
        wait_tokens(gen, 12)
        gen.pause()
        assert_stays_paused(gen, lambda: other_generation(worker, folder))
        gen.resume()
        gen.result(timeout=120)
        assert gen.tokens == whole.tokens
    finally:
        worker.prompt_cache_gb = prefix_cache.DEFAULT_PROMPT_CACHE_GB


def test_a_stop_between_groups_ends_without_the_rest_of_the_step(worker, folder: str, monkeypatch) -> None:
    results: list[bool] = []
    evaluate = DecodeBatch._evaluate

    def spy(self, step):
        whole = evaluate(self, step)
        results.append(whole)
        return whole

    monkeypatch.setattr(DecodeBatch, "_evaluate", spy)
    built: list[bool] = []
    forward = DecodeBatch._forward

    def forward_spy(self, inputs, stoppable=False, beside=None):
        step = forward(self, inputs, stoppable, beside)
        built.append(step is not None)
        return step

    monkeypatch.setattr(DecodeBatch, "_forward", forward_spy)
    reference = _run(worker, folder, PROMPT, TINY_BUDGET, max_tokens=300)
    assert all(results)
    stopped = None
    half_built = False
    # A stop lands between groups nearly always (8 groups a step), sometimes while the next step is being built
    # (then that build ends half way and gives its positions back): try until a stop has done each.
    for _ in range(60):
        results.clear()
        built.clear()
        gen = mlx_notebook.generate(PROMPT, model=folder, worker=worker, max_tokens=300, stop_budget=TINY_BUDGET)
        wait_tokens(gen, 6)
        gen.stop()
        wait_state(gen, "stopped")
        assert gen.tokens == reference.tokens[: len(gen.tokens)]
        if False in results:
            assert results[-1] is False and results.count(False) == 1
            if False in built or stopped is None:
                stopped = gen  # the later checks take the riskier cache: one whose next step was half built
            half_built = half_built or False in built
            if half_built:
                break
    assert stopped is not None, "no stop landed between two groups of a step in 60 tries"
    assert half_built, "no stop came while the next step was being built in 60 tries"
    assert stopped.tokens == reference.tokens[: len(stopped.tokens)]
    assert not stopped.error

    # The abandoned step wrote the last read token's keys and values in part (the rest lazy, in the cache the
    # prefix cache keeps): a prompt that extends the stopped text is served from that cache, with the numbers
    # a fresh prefill gives.
    follow = stopped.prompt_tokens + stopped.tokens + [11, 12, 13]
    reused = _run(worker, folder, follow, 0.1, max_tokens=16)
    assert reused.stats.cached_tokens >= len(stopped.prompt_tokens) + len(stopped.tokens) - 1
    assert reused.tokens == _fresh_run(folder, follow).tokens


def test_rows_in_groups_build_the_next_step_between_the_groups_of_the_one_in_flight(
    worker, folder: str, monkeypatch
) -> None:
    """Three rows decode in one-layer groups: the next step's build waits for the step in flight group by group.

    Without it the groups queued before the build are all the device has
    while the host builds, and the rest of the step runs after it (on a
    host-bound device the two add up). The rows' tokens are their solo runs'.
    """
    worker.prompt_cache_gb = 0
    try:
        solo = [_run(worker, folder, p, 0.1, max_tokens=24).tokens for p in ROW_PROMPTS]
        waits = _spy_group_waits(monkeypatch)
        gens = [
            mlx_notebook.generate(p, model=folder, worker=worker, max_tokens=24, stop_budget=TINY_BUDGET)
            for p in ROW_PROMPTS
        ]
        for gen in gens:
            gen.result(timeout=120)
            assert gen.state == "done", gen.error
    finally:
        worker.prompt_cache_gb = prefix_cache.DEFAULT_PROMPT_CACHE_GB
    assert max(g.stats.batch_size for g in gens) == 3
    assert all(g.stats.decode_pieces == 8 for g in gens)
    assert [g.tokens for g in gens] == solo
    # 7 marks a step: nearly every group is waited during the next build, the rest after it.
    fed = sum(in_build for in_build, _ in waits)
    assert fed > 5 * (len(waits) - fed), {"fed": fed, "waited": len(waits) - fed}


def _stop_three_rows_together(worker, folder: str, tokens_first: int) -> None:
    """Three rows in one-layer groups, each stopped after ``tokens_first`` tokens: all end stopped, batched."""
    gens = [
        mlx_notebook.generate(p, model=folder, worker=worker, max_tokens=300, stop_budget=TINY_BUDGET)
        for p in LONG_PROMPTS
    ]
    for gen in gens:
        wait_tokens(gen, tokens_first)
    for gen in gens:
        gen.stop()
    for gen in gens:
        wait_state(gen, "stopped")
        assert not gen.error
    assert max(g.stats.batch_size for g in gens) == 3


def test_every_row_in_groups_stopped_at_once_ends_and_the_model_stays_correct(worker, folder: str, monkeypatch) -> None:
    """Three rows in one-layer groups stopped together (a kernel interrupt's cancel), until a stop has landed
    while the next step's build waited for a group of the one in flight: every row ends stopped, nothing is
    left in flight, and the next generation's tokens are a fresh worker's."""
    waits = _spy_group_waits(monkeypatch)
    worker.prompt_cache_gb = 0
    try:
        for round_ in range(60):
            if (True, False) in waits and round_ >= 3:
                break
            _stop_three_rows_together(worker, folder, 3 + round_ % 7)
        assert (True, False) in waits, "no stop landed while a build waited for a group, in 60 rounds"
        after = _run(worker, folder, PROMPT, 0.1, max_tokens=16)
    finally:
        worker.prompt_cache_gb = prefix_cache.DEFAULT_PROMPT_CACHE_GB
    assert after.tokens == _fresh_run(folder, PROMPT).tokens


def test_every_row_stopped_between_groups_leaves_without_computing_the_rest_of_the_step(
    worker, folder: str, monkeypatch
) -> None:
    """Three rows in one-layer groups stopped together: when the stops land between two groups of a step, the
    rest of it never runs. No row's cache is copied out of the batch then, since a copy would compute that rest
    before the last row may be reported, over the stop's budget; so the prefix cache keeps none. The rows end
    stopped and the next generation's tokens are a fresh worker's."""
    from mlx_notebook.generation import batch_cache

    events: list[str] = []
    evaluate, extract = DecodeBatch._evaluate, batch_cache.extract

    def evaluate_spy(self, step):
        whole = evaluate(self, step)
        events.append("read" if whole else "abandoned")
        return whole

    def extract_spy(*args, **kwargs):
        events.append("copy")
        return extract(*args, **kwargs)

    monkeypatch.setattr(DecodeBatch, "_evaluate", evaluate_spy)
    monkeypatch.setattr(batch_cache, "extract", extract_spy)
    abandoned = 0
    for round_ in range(60):
        events.clear()
        _stop_three_rows_together(worker, folder, 3 + round_ % 5)
        if "abandoned" in events:
            abandoned += 1
            assert "copy" not in events[events.index("abandoned") :], events[-8:]
            if abandoned >= 2:
                break
    assert abandoned >= 2, "the stops did not land between two groups twice in 60 rounds"
    after = _run(worker, folder, PROMPT, 0.1, max_tokens=16)
    assert after.tokens == _fresh_run(folder, PROMPT).tokens
