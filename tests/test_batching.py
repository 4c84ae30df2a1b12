"""Continuous batching and prompt-prefix reuse on a small random-weight model (fp32, CPU).

Generations of one model submitted together decode in one batched step; each
row must give exactly its solo run's tokens (greedy and seeded), whatever
joins, stops, pauses or resumes around it, and a prompt that shares a prefix
with an earlier one must start from its cache and still give the cold run's
tokens.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest

import mlx_notebook
from mlx_notebook.generation.session import Session
from testkit.waiting import assert_stays_paused, held, in_prefill, wait_prefill_chunks, wait_state, wait_tokens

# Prompts of different lengths: the batch's rows are left-padded differently.
PROMPTS = [
    "Once upon a time the quick brown fox",
    "A much longer prompt about the weather in the mountains, where the wind blows all day and night",
    "Hi",
    "Tell me about batching sequences of different lengths together",
]


@pytest.fixture(scope="module")
def solo(worker, tiny_model):
    """Tokens of each prompt run alone (max_batch=1, no prompt cache)."""
    worker.prompt_cache_gb = 0
    try:
        out = {}
        for prompt in PROMPTS:
            for seed in (None, 3):
                kw = {"temperature": 0.8, "seed": seed} if seed is not None else {}
                gen = mlx_notebook.generate(prompt, model=tiny_model, worker=worker, max_tokens=24, max_batch=1, **kw)
                gen.result(timeout=120)
                assert gen.stats.batch_size == 1
                out[prompt, seed] = gen.tokens
        return out
    finally:
        worker.prompt_cache_gb = 2


def submit_all(worker, model, seed=None, **kw):
    sampling = {"temperature": 0.8, "seed": seed} if seed is not None else {}
    kw.setdefault("max_tokens", 24)
    return [mlx_notebook.generate(p, model=model, worker=worker, **sampling, **kw) for p in PROMPTS]


def test_rows_of_a_batch_give_their_solo_tokens(worker, tiny_model, solo):
    for seed in (None, 3):
        worker.prompt_cache_gb = 0
        gens = submit_all(worker, tiny_model, seed=seed)
        for gen in gens:
            gen.result(timeout=120)
        worker.prompt_cache_gb = 2
        assert max(g.stats.batch_size for g in gens) > 1, "the generations never decoded together"
        for prompt, gen in zip(PROMPTS, gens):
            assert gen.state == "done"
            assert gen.tokens == solo[prompt, seed], (prompt, seed)


def test_stop_of_one_row_leaves_the_others_unchanged(worker, tiny_model, solo):
    gens = submit_all(worker, tiny_model, max_tokens=24)
    victim = gens[1]
    wait_tokens(victim, 3)
    victim.cancel()
    for gen in gens:
        assert gen.wait(120)
    assert victim.state == "stopped"
    assert victim.tokens == solo[PROMPTS[1], None][: len(victim.tokens)]
    for prompt, gen in zip(PROMPTS, gens):
        if gen is not victim:
            assert gen.state == "done" and gen.tokens == solo[prompt, None]


@pytest.mark.parametrize("seed", [None, 3])
def test_pause_of_one_row_parks_it_and_resume_is_exact(worker, tiny_model, solo, seed):
    gens = submit_all(worker, tiny_model, seed=seed, max_tokens=24)
    paused = gens[0]
    wait_tokens(paused, 4)
    paused.pause()
    # The others go on to their end while it is parked, and it does not move.
    assert_stays_paused(paused, lambda: [gen.result(timeout=120) for gen in gens[1:]])
    paused.resume()
    paused.result(timeout=120)
    for prompt, gen in zip(PROMPTS, gens):
        assert gen.tokens == solo[prompt, seed], prompt


def test_a_generation_joins_a_running_batch(worker, tiny_model, solo):
    first = mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, max_tokens=400)
    wait_tokens(first, 5)
    second = mlx_notebook.generate(PROMPTS[1], model=tiny_model, worker=worker, max_tokens=24)
    second.result(timeout=120)
    assert not first.finished, "the second waited for the first instead of joining"
    first.cancel()
    assert first.wait(60)
    assert second.tokens == solo[PROMPTS[1], None]
    assert first.tokens[:24] == solo[PROMPTS[0], None]
    assert second.stats.batch_size == 2


@pytest.mark.parametrize("seed", [None, 3])
def test_a_prompt_joins_while_the_batchs_step_runs_and_every_row_keeps_its_solo_tokens(
    worker, tiny_model, solo, seed, monkeypatch
):
    """A row joining a batch of two merges while the step in flight runs, the first joined step built then
    (``DecodeBatch._admits_ahead``); the joiner's tokens and the others' are still their solo runs'."""
    from mlx_notebook.generation.decode_batch import DecodeBatch

    ahead: list[int] = []
    admit = DecodeBatch._admit

    def spy(self):
        if self._y is not None and self.ready:
            ahead.append(len(self.rows))
        admit(self)

    monkeypatch.setattr(DecodeBatch, "_admit", spy)
    sampling = {"temperature": 0.8, "seed": seed} if seed is not None else {}
    rows = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=400, **sampling) for p in PROMPTS[:2]]
    for row in rows:
        wait_tokens(row, 3)
    joiner = mlx_notebook.generate(PROMPTS[3], model=tiny_model, worker=worker, max_tokens=24, **sampling)
    joiner.result(timeout=120)
    for row in rows:
        row.cancel()
    for row in rows:
        assert row.wait(60)
    assert ahead == [2], "the joiner did not merge while the batch's step ran"
    assert joiner.tokens == solo[PROMPTS[3], seed]
    for prompt, row in zip(PROMPTS[:2], rows):
        assert row.tokens[:24] == solo[prompt, seed]


@pytest.mark.parametrize("action", ["pause", "cancel"])
def test_a_row_paused_or_stopped_right_after_it_joined_ahead_leaves_every_row_exact(
    worker, tiny_model, solo, action, monkeypatch
):
    """The request lands after the joiner merged beside the step in flight and before that step is read: the
    first joined step, built ahead, is cut back for it (pause: parked as if it never joined; stop: reported)."""
    from mlx_notebook.generation.decode_batch import DecodeBatch

    hit: list = []
    admit = DecodeBatch._admit

    def spy(self):
        ahead, joining = self._y is not None and bool(self.ready), list(self.ready)
        admit(self)
        if ahead and not hit:
            for row in joining:
                if row in self.rows:
                    hit.append(row)
                    getattr(row.pace.token, action)()

    monkeypatch.setattr(DecodeBatch, "_admit", spy)
    sampling = {"temperature": 0.8, "seed": 3}
    rows = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=400, **sampling) for p in PROMPTS[:2]]
    for row in rows:
        wait_tokens(row, 3)
    joiner = mlx_notebook.generate(PROMPTS[3], model=tiny_model, worker=worker, max_tokens=24, **sampling)
    try:
        if action == "pause":
            wait_state(joiner, "paused")
            assert joiner.tokens == []
            joiner.resume()
            joiner.result(timeout=120)
            assert joiner.tokens == solo[PROMPTS[3], 3]
        else:
            assert joiner.wait(60) and joiner.state == "stopped"
            assert joiner.tokens == []
        for row in rows:
            wait_tokens(row, 24)
    finally:  # the worker is the module's: nothing of this test may run on into the next
        for gen in [*rows, joiner]:
            gen.cancel()
        for gen in [*rows, joiner]:
            assert gen.wait(60)
    assert len(hit) == 1, "the request did not land in the window"
    for prompt, row in zip(PROMPTS[:2], rows):
        assert row.tokens[:24] == solo[prompt, 3]


@pytest.mark.parametrize("action", ["pause", "cancel"])
def test_every_row_leaving_while_the_next_step_is_built_ahead_is_cut_out_without_computing_it(
    worker, tiny_model, solo, action, monkeypatch
):
    """Every row is paused or stopped after the step that follows the one in flight was built (lazily, not
    queued): each row's copy is cut from the cache as the step read left it, so it holds none of the built
    step's layers (cut after them, its evaluation computed that whole step: 60 of the last row's 81 ms in a
    CPU stop of 4 rows), and a pause resumes to exactly the solo tokens (no position of that step kept)."""
    import io

    import mlx.core as mx

    from mlx_notebook.generation import batch_cache
    from mlx_notebook.generation.decode_batch import DecodeBatch

    hit: list = []
    copies: list[str] = []
    forward, extract = DecodeBatch._forward, batch_cache.extract

    def spy_forward(self, inputs, *args, **kwargs):
        step = forward(self, inputs, *args, **kwargs)
        built_ahead = isinstance(inputs, mx.array)  # the read tokens are a list; a step in flight's, an array
        if built_ahead and not hit and len(self.rows) == 3 and all(len(r.tokens) >= 3 for r in self.rows):
            hit.append(len(self.rows))
            for row in self.rows:
                getattr(row.pace.token, action)()
        return step

    def spy_extract(*args, **kwargs):
        single = extract(*args, **kwargs)
        if hit:
            out = io.StringIO()
            mx.export_to_dot(out, *batch_cache.state_arrays(single))
            copies.append(out.getvalue())
        return single

    monkeypatch.setattr(DecodeBatch, "_forward", spy_forward)
    monkeypatch.setattr(batch_cache, "extract", spy_extract)
    sampling = {"temperature": 0.8, "seed": 3}
    prompts = PROMPTS[:3]
    rows = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=24, **sampling) for p in prompts]
    try:
        if action == "pause":
            for row in rows:
                wait_state(row, "paused")
            for row in rows:
                row.resume()
            for row in rows:
                row.result(timeout=120)
        else:
            for row in rows:
                assert row.wait(60) and row.state == "stopped"
    finally:  # the worker is the module's: nothing of this test may run on into the next
        for row in rows:
            row.cancel()
        for row in rows:
            assert row.wait(60)
    assert hit == [3], "the requests did not land while a step was built ahead"
    assert len(copies) >= 3, copies  # the three rows' copies as they left, then (pause) as they ended
    for graph in copies[:3]:
        assert "Matmul" not in graph, "a leaving row's copy computes the step built ahead"
    if action == "pause":
        for prompt, row in zip(prompts, rows):
            assert row.tokens == solo[prompt, 3]


def test_every_row_stopped_is_reported_after_its_copy_out_of_the_batch_is_synchronized(worker, tiny_model, monkeypatch):
    """Invariant 2 for a batch that empties: the rows' copies out of its arrays (kept for prefix reuse) are
    queued before the stream is synchronized, so nothing is queued between that synchronize and the last
    row's report (they were queued after it, and ran after the report)."""
    import io

    import mlx.core as mx

    events: list[str] = []
    recording = [False]
    async_eval, synchronize = mx.async_eval, mx.synchronize

    def aev(*args, **kwargs):
        if recording[0]:
            arrays = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
            graph = io.StringIO()
            mx.export_to_dot(graph, *arrays)
            # An evaluated array's graph has no operation left: queueing it again queues nothing.
            events.append("queue" if "label" in graph.getvalue() else "again")
        return async_eval(*args, **kwargs)

    def sync(*args, **kwargs):
        result = synchronize(*args, **kwargs)
        if recording[0]:
            events.append("sync")
        return result

    monkeypatch.setattr(mx, "async_eval", aev)
    monkeypatch.setattr(mx, "synchronize", sync)
    for _ in range(3):
        rows = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=400) for p in PROMPTS[:3]]
        for row in rows:
            row.add_listener(lambda e: events.append("report") if e.kind == "state" and e.state.final else None)
        for row in rows:
            wait_tokens(row, 3)
        events.clear()
        recording[0] = True
        for row in rows:
            row.cancel()
        for row in rows:
            assert row.wait(60) and row.state == "stopped"
        recording[0] = False
        assert max(r.stats.batch_size for r in rows) == 3
        last = len(events) - 1 - events[::-1].index("report")
        assert "sync" in events[:last], events
        synced = last - 1 - events[last - 1 :: -1].index("sync")
        assert "queue" not in events[synced:last], events


@pytest.fixture
def reserves(monkeypatch):
    """What the session reserved for joins: ``made`` (each reservation's arguments) and ``taken``
    (at each join: the layers' keys and values reserved, and how many buffers came back, ``None``: unfit)."""
    from mlx_notebook.generation import batch_cache

    made: list = []
    taken: list = []
    init, take = batch_cache.Reserve.__init__, batch_cache.Reserve.take

    def spy_init(self, *args):
        made.append(args)
        init(self, *args)

    def spy_take(self, rows, capacity):
        buffers = take(self, rows, capacity)
        taken.append((len(self._shapes), None if buffers is None else len(buffers)))
        return buffers

    monkeypatch.setattr(batch_cache.Reserve, "__init__", spy_init)
    monkeypatch.setattr(batch_cache.Reserve, "take", spy_take)
    return made, taken


def _alone(worker, model, prompt, max_tokens):
    """Tokens of ``prompt`` run alone (max_batch=1)."""
    gen = mlx_notebook.generate(prompt, model=model, worker=worker, max_tokens=max_tokens, max_batch=1)
    gen.result(timeout=120)
    return gen.tokens


def test_a_long_joiner_lands_in_buffers_allocated_during_its_prefill(worker, tiny_model, reserves):
    """The batch's joined cache is allocated a layer per checkpoint of the long prompt's prefill, and used."""
    _, taken = reserves
    long_prompt = [(37 * i) % 250 + 20 for i in range(1500)]
    worker.prompt_cache_gb = 0
    try:
        alone = _alone(worker, tiny_model, long_prompt, 12)
        first_alone = _alone(worker, tiny_model, PROMPTS[0], 600)
        taken.clear()
        first = mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, max_tokens=600)
        wait_tokens(first, 5)
        joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=worker, max_tokens=12)
        joiner.result(timeout=120)
        first.result(timeout=120)
    finally:
        worker.prompt_cache_gb = 2
    assert joiner.stats.batch_size == 2, "the long prompt never joined the decoding row"
    # Every layer's keys and values were allocated ahead (the prefill had more checkpoints than layers).
    assert taken and taken[0][1] == taken[0][0] > 0, taken
    assert joiner.tokens == alone
    assert first.tokens == first_alone  # its rows were copied into the reserved buffers


def _long_prompt_joins(worker, model, prompts: list[str]):
    """A 1,500-token prompt (no prompt-cache hit) joins ``prompts`` decoding; they are stopped after it; return it."""
    long_prompt = [(37 * i) % 250 + 20 for i in range(1500)]
    worker.prompt_cache_gb = 0
    try:
        others = [mlx_notebook.generate(p, model=model, worker=worker, max_tokens=600) for p in prompts]
        for gen in others:
            wait_tokens(gen, 5)
        joiner = mlx_notebook.generate(long_prompt, model=model, worker=worker, max_tokens=4)
        joiner.result(timeout=120)
        for gen in others:
            gen.cancel()
        for gen in others:
            assert gen.wait(timeout=60), "a decoding row did not end within 60 s of its cancel"
    finally:
        worker.prompt_cache_gb = 2
    return joiner


def test_a_layer_of_the_joins_buffers_is_queued_after_the_others_step_not_inside_their_gap(
    worker, tiny_model, reserves, monkeypatch
):
    """At a boundary of a prompt fed in turn, the others' step comes first, then a layer of the reserve.

    Queued before their step, the layer's zeroed buffers ran inside their gap:
    on a process's first join, new memory, ~70 ms a boundary (session 55, the
    default model on 2 cores). After it, they run before the prompt's next
    piece and are timed as the prompt's.
    """
    from mlx_notebook.generation import batch_cache, decode_batch, prompt_turn, session

    events: list[str] = []
    between, advance, step = session.Session.between, batch_cache.Reserve.advance, decode_batch.DecodeBatch.step

    def spy_between(self):
        events.append("boundary")
        between(self)

    def spy_advance(self, layers=1):
        events.append("advance")
        advance(self, layers)

    def spy_step(self, hold=False):
        events.append("step" if hold else "loop step")
        step(self, hold)

    monkeypatch.setattr(session.Session, "between", spy_between)
    monkeypatch.setattr(batch_cache.Reserve, "advance", spy_advance)
    monkeypatch.setattr(decode_batch.DecodeBatch, "step", spy_step)
    # Their step at every boundary: the tiny model's four layers are reserved at the prompt's first four.
    monkeypatch.setattr(prompt_turn.PromptTurn, "due", lambda self, *args: True)
    _, taken = reserves
    joiner = _long_prompt_joins(worker, tiny_model, PROMPTS[:1])
    assert joiner.stats.batch_size == 2, "the long prompt never joined the decoding row"
    assert taken and taken[0][1] == taken[0][0] > 0, taken  # every layer reserved, then used
    boundaries = " ".join(events).split("boundary")[1:]
    both = [b.split() for b in boundaries if "step" in b.split() and "advance" in b.split()]
    assert both, boundaries  # boundaries where the others stepped and a layer was reserved
    assert all(b.index("step") < b.index("advance") for b in both), both


def test_the_others_step_at_a_boundary_runs_on_openblass_count_for_their_rows_and_the_piece_on_its_own(
    worker, tiny_model, monkeypatch
):
    """At a boundary of a prompt fed in turn: the others' step fitted to their rows, the next piece to one.

    Fitted for one row, their step ran on a prefill piece's thread count: on
    a CPU where one thread wins for a step of several rows (a Zen 4: 4 rows
    of the default model 74 ms on one thread, 88 on two) every step of theirs
    during a join paid it.
    """
    from mlx_notebook.generation import decode_batch, pieces, prompt_turn, session

    events: list[str] = []
    fit, step, run = session.fit_to_load, decode_batch.DecodeBatch.step, pieces.LayerRunner.run

    def spy_fit(rows=1):
        events.append(f"fit{rows}")
        return fit(rows)

    def spy_step(self, hold=False):
        events.append("step" if hold else "loop step")
        step(self, hold)

    def spy_run(self, *args, **kwargs):
        events.append("piece")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(session, "fit_to_load", spy_fit)
    monkeypatch.setattr(decode_batch.DecodeBatch, "step", spy_step)
    monkeypatch.setattr(pieces.LayerRunner, "run", spy_run)
    monkeypatch.setattr(prompt_turn.PromptTurn, "due", lambda self, *args: True)  # their step at every boundary
    joiner = _long_prompt_joins(worker, tiny_model, PROMPTS[:2])
    assert joiner.stats.batch_size == 3, "the long prompt never joined the two decoding rows"
    held_steps = [i for i, e in enumerate(events) if e == "step"]
    assert held_steps, "the others never stepped at a boundary of the prompt"
    for i in held_steps:
        fits = [e for e in events[:i] if e.startswith("fit")]
        assert fits[-1] == "fit2", events[max(0, i - 6) : i + 1]  # their step on the count for two rows
    pieces_after = [i for i, e in enumerate(events) if e == "piece" and i > held_steps[0]]
    assert pieces_after, "no piece of the prompt came after the others' first boundary step"
    for i in pieces_after:
        fits = [e for e in events[:i] if e.startswith("fit")]
        assert fits[-1] == "fit1", events[max(0, i - 6) : i + 1]  # the piece on a prefill's count


def test_the_others_steps_read_after_a_prefill_piece_are_not_timed(worker, tiny_model, monkeypatch):
    """A prompt fed in turn between the others' steps: their step time leaves its pieces out, and theirs stay out of its.

    Their step time is the user's ``decode_step_s`` and decides how many
    steps are kept in flight and whether a step goes in layer groups;
    measured with the pieces in it, 32-68 of ~140 steps of the default model
    went in groups during a join on 2 cores, for a budget they fitted whole.
    And their next step, queued before the prompt's next piece, was timed as
    part of it: the planner cut the pieces, and the join's prefill took
    14.5 s against 10 s with the step held to the next boundary.
    """
    from mlx_notebook.generation import decode_batch, session

    monkeypatch.setenv("MLX_NOTEBOOK_PREFILL_THREAD", "0")  # in turn on the worker, as on the CPU by default
    decoding: list[mlx_notebook.Generation] = []
    boundaries: list[tuple[float, int]] = []  # at each piece boundary of the joining prompt: when, the row's tokens
    held: list[bool] = []  # after each step of the row at a boundary: whether its next step waited unqueued
    timed: list[tuple[float, float]] = []  # (previous read, this read) of each step timed
    between, measure = session.Session.between, decode_batch.DecodeBatch._measure

    def spy_between(self) -> None:
        boundaries.append((time.perf_counter(), len(decoding[0].tokens)))
        steps = {id(b): b.steps for b in self.batches.values()}
        between(self)
        for b in self.batches.values():
            if b.steps != steps.get(id(b), b.steps) and b.rows:
                # Stepped here: the next step waits unqueued, or it runs ahead of the next piece and is timed in it.
                held.append(b._held)

    def spy_measure(self, seconds: float) -> None:
        now = time.perf_counter()
        timed.append((now - seconds, now))
        measure(self, seconds)

    monkeypatch.setattr(session.Session, "between", spy_between)
    monkeypatch.setattr(decode_batch.DecodeBatch, "_measure", spy_measure)
    long_prompt = [(43 * i) % 250 + 20 for i in range(1500)]
    worker.prompt_cache_gb = 0
    try:
        decoding.append(mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, max_tokens=100_000))
        wait_tokens(decoding[0], 5)
        joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=worker, max_tokens=4, stop_budget=0.02)
        joiner.result(timeout=120)
        decoding[0].cancel()
        assert decoding[0].wait(60)
    finally:
        worker.prompt_cache_gb = 2
    assert len(boundaries) >= 3, "the prompt was not fed in pieces"
    assert boundaries[-1][1] > boundaries[0][1], "the decoding row did not step between the pieces"
    assert len(timed) > 5, "the decoding row's steps were not timed at all"
    holding = [(a, b) for a, b in timed if any(a < t < b for t, _ in boundaries)]
    assert not holding, f"{len(holding)} of {len(timed)} steps timed across a prefill piece"
    assert held and all(held), held


def test_a_prompt_fed_in_turn_beside_long_steps_keeps_the_worker_longer_than_half_a_budget(
    worker, tiny_model, monkeypatch
):
    """Where the others' steps are long, a prompt's turn grows to what their gap's bound leaves (prompt_turn).

    With half a budget a turn, a prompt joining rows whose step costs more
    than the budget (a CPU) got a small share of the machine: 58-67 s to
    the first token of a 1,000-token prompt of a Qwen3-0.6B shape beside
    three rows of 300-ms steps, against 13 s alone. Here the others' steps
    are timed as 200 ms (their budget 40 ms: half of it 20 ms, their bound
    440 ms); the prompt's pieces take a few ms.
    """
    from mlx_notebook.generation import decode_batch, session

    monkeypatch.setenv("MLX_NOTEBOOK_PREFILL_THREAD", "0")  # in turn on the worker, as on the CPU by default
    step_s, budget = 0.2, 0.04
    turns: list[float] = []  # at each boundary where the others stepped: the time since their last token
    between, measure = session.Session.between, decode_batch.DecodeBatch._measure

    def spy_between(self) -> None:
        batches = [b for b in self.batches.values() if b.rows]
        before = {id(b): b.steps for b in batches}
        last = min((b.last_step_at for b in batches), default=0.0)
        now = time.perf_counter()
        between(self)
        if batches and any(b.steps != before[id(b)] for b in batches):
            turns.append(now - last)

    monkeypatch.setattr(session.Session, "between", spy_between)
    monkeypatch.setattr(decode_batch.DecodeBatch, "_measure", lambda self, seconds: measure(self, step_s))
    long_prompt = [(37 * i) % 250 + 20 for i in range(3000)]
    worker.prompt_cache_gb = 0
    loaded_step = worker.call(lambda store: [m.step_s for m in store.loaded()])
    try:
        other = mlx_notebook.generate(
            PROMPTS[0], model=tiny_model, worker=worker, max_tokens=100_000, stop_budget=budget
        )
        wait_tokens(other, 10)  # 8 steps timed as 200 ms by now
        joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=worker, max_tokens=2, stop_budget=0.01)
        joiner.result(timeout=120)
        other.cancel()
        assert other.wait(60)
    finally:
        worker.prompt_cache_gb = 2

        def restore(store) -> None:
            for m, s in zip(store.loaded(), loaded_step):
                m.step_s = s

        worker.call(restore)
    assert len(turns) >= 2, f"the others stepped at {len(turns)} of the prompt's boundaries"
    # Half a budget is 20 ms; the bound leaves ~370 ms less what a step here takes after a boundary.
    assert max(turns) > 3 * budget, f"no turn grew past half a budget (ms): {[round(t * 1000) for t in turns]}"


def test_a_paused_row_resumes_and_stops_while_a_prompt_is_fed_in_turn(worker, tiny_model, monkeypatch):
    """A resume or a stop of a paused row acts at the joining prompt's next piece, not after its prefill.

    Before, the parked rows were looked at only by the session's loop, which
    a prompt fed in turn holds for its whole prefill: a 1,000-token prompt of
    the default model on 2 cores kept a resumed row waiting 4.1 s for its
    next token, and a stop of a paused row 3.8 s.
    """
    monkeypatch.setenv("MLX_NOTEBOOK_PREFILL_THREAD", "0")  # in turn on the worker, as on the CPU by default
    # The prompt's prefill is held at one piece boundary (its checkpoint, looked at again and again) until the
    # checks below are done: they pass only if the boundary itself acts on the parked row. Without the hold they
    # raced the prefill's end on a busy machine.
    at_boundary, checked = threading.Event(), threading.Event()
    between = Session.between

    def held_between(session: Session) -> None:
        between(session)
        if joiner is not None and joiner.stats.prefill_chunks >= 2 and not checked.is_set():
            at_boundary.set()
            deadline = time.monotonic() + 60
            while not checked.is_set() and time.monotonic() < deadline:
                between(session)
                checked.wait(0.005)

    monkeypatch.setattr(Session, "between", held_between)
    long_prompt = [(47 * i) % 250 + 20 for i in range(4000)]
    worker.prompt_cache_gb = 0
    joiner = None
    try:
        other = mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, max_tokens=100_000)
        wait_tokens(other, 3)
        other.pause()
        wait_state(other, "paused")
        joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=worker, max_tokens=2, stop_budget=0.005)
        assert at_boundary.wait(60), "the joining prompt never reached its second piece's boundary"
        chunks = joiner.stats.prefill_chunks
        read = len(other.tokens)
        other.resume()
        # Within the hold's 60 s; a TimeoutError here: the resumed row waited for the prompt's prefill.
        wait_tokens(other, read + 3, timeout=20)
        other.pause()
        wait_state(other, "paused", timeout=20)
        other.cancel()
        assert other.wait(15), "the stop of the paused row waited for the prompt's prefill"
        assert joiner.state == "prefilling" and joiner.stats.prefill_chunks == chunks, "the hold did not hold"
    finally:
        checked.set()
        if joiner is not None:
            joiner.cancel()
            joiner.wait(60)
        worker.prompt_cache_gb = 2


def test_a_long_joiner_paused_in_its_prefill_lets_its_reserved_buffers_go(worker, tiny_model, reserves):
    """A pause may last and the batch change meanwhile: the reservation is dropped, the join still exact."""
    made, taken = reserves
    long_prompt = [(41 * i) % 250 + 20 for i in range(3500)]
    worker.prompt_cache_gb = 0
    try:
        alone = _alone(worker, tiny_model, long_prompt, 8)
        first = mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, max_tokens=100_000)
        wait_tokens(first, 5)
        joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=worker, max_tokens=8, stop_budget=0.01)
        in_prefill(joiner, joiner.pause, chunks=2)
        wait_state(joiner, "paused")
        assert not joiner.tokens and joiner.stats.prefill_chunks < 3500, "the pause did not land in the prefill"
        joiner.resume()
        joiner.result(timeout=120)
        first.cancel()
        assert first.wait(60)
    finally:
        worker.prompt_cache_gb = 2
    assert made, "no reservation was made for the long prompt"
    assert not taken, "the paused prefill kept its reservation to the join"
    assert joiner.stats.batch_size == 2 and joiner.tokens == alone


def test_max_batch_one_runs_alone(worker, tiny_model, solo):
    spans: dict[int, list[float]] = {}

    def track(event):
        # When each generation started and ended (listeners run on the worker thread, in order).
        if event.kind == "state" and event.state in ("loading", "prefilling", "done"):
            spans.setdefault(event.generation.id, []).append(time.perf_counter())

    with held(worker):  # every listener is on before the first generation starts
        gens = submit_all(worker, tiny_model, max_batch=1)
        for gen in gens:
            gen.add_listener(track)
    for gen in gens:
        gen.result(timeout=120)
    assert [g.stats.batch_size for g in gens] == [1, 1, 1, 1]
    assert [g.tokens for g in gens] == [solo[p, None] for p in PROMPTS]
    # One at a time, in order: each began after the one before it ended.
    for before, after in zip(gens, gens[1:]):
        assert spans[before.id][-1] <= spans[after.id][0], (spans[before.id], spans[after.id])


def test_stop_all_ends_every_row_and_the_worker_goes_on(worker, tiny_model, solo):
    gens = submit_all(worker, tiny_model, max_tokens=10_000)
    for gen in gens[:2]:
        wait_tokens(gen, 2)
    gens[3].pause()
    stopped = worker.cancel_all()
    assert set(map(id, gens)) <= set(map(id, stopped))
    for gen in gens:
        assert gen.wait(60) and gen.state == "stopped"
    after = mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, max_tokens=24)
    assert after.result(timeout=60) is not None and after.tokens == solo[PROMPTS[0], None]


def test_every_row_stopped_in_the_first_steps_after_a_join_ends_and_the_batch_goes_on(worker, tiny_model, solo):
    # Right after a join the batch is least settled: the joiner's cache just merged, the step after the change
    # of rows not timed (benchmarks/batching.py's join_stop part measures these stops' latency).
    long_prompt = " ".join(PROMPTS * 6)
    for others_tokens_after in (0, 1, 2):
        rows = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=10_000) for p in PROMPTS[:3]]
        for row in rows:
            wait_tokens(row, 3)
        joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=worker, max_tokens=10_000)
        wait_tokens(joiner, 1)
        seen = len(rows[0].tokens)
        wait_tokens(rows[0], seen + others_tokens_after)
        for gen in [*rows, joiner]:
            gen.cancel()
        for gen in [*rows, joiner]:
            assert gen.wait(60) and gen.state == "stopped", (others_tokens_after, gen.state)
        assert joiner.stats.batch_size == 4, "the long prompt did not join the rows"
    after = mlx_notebook.generate(PROMPTS[1], model=tiny_model, worker=worker, max_tokens=24)
    after.result(timeout=60)
    assert after.tokens == solo[PROMPTS[1], None]


def test_random_controls_on_random_rows_keep_every_row_exact(worker, tiny_model, solo):
    rng = random.Random(11)
    for _ in range(3):
        gens = submit_all(worker, tiny_model, seed=3, max_tokens=24)
        for _ in range(12):
            gen = rng.choice(gens)
            action = rng.choice(["pause", "resume", "resume", "cancel", "wait"])
            if action == "cancel" and rng.random() < 0.5:
                continue
            getattr(gen, action)() if action != "wait" else time.sleep(0.003)
        for gen in gens:
            gen.resume()
            assert gen.wait(120)
        for prompt, gen in zip(PROMPTS, gens):
            assert gen.state in ("done", "stopped")
            expected = solo[prompt, 3]
            assert gen.tokens == (expected if gen.state == "done" else expected[: len(gen.tokens)])


def test_prefix_reuse_gives_the_cold_tokens_and_counts_cached(worker, tiny_model):
    doc = " ".join(f"word{i}" for i in range(300))
    first, second = doc + " What is the first word?", doc + " What is the last word?"
    # Seeded, with log-probabilities: a fully cached prompt's first token is sampled from its prefill's logits.
    seeded = {"max_tokens": 16, "temperature": 0.9, "seed": 5, "logprobs": 3}
    worker.prompt_cache_gb = 0
    cold = mlx_notebook.generate(second, model=tiny_model, worker=worker, max_tokens=16)
    cold.result(timeout=120)
    seeded_cold = mlx_notebook.generate(second, model=tiny_model, worker=worker, **seeded)
    seeded_cold.result(timeout=120)
    assert cold.stats.cached_tokens == 0
    worker.prompt_cache_gb = 2
    mlx_notebook.generate(first, model=tiny_model, worker=worker, max_tokens=16).result(timeout=120)
    warm = mlx_notebook.generate(second, model=tiny_model, worker=worker, max_tokens=16)
    warm.result(timeout=120)
    assert warm.stats.cached_tokens > 0.8 * warm.stats.prompt_tokens
    assert warm.tokens == cold.tokens
    # The same prompt again: everything but its last token comes from the cache, and
    # the last token's forward runs in the prefill (in layer groups), not as a step.
    again = mlx_notebook.generate(second, model=tiny_model, worker=worker, max_tokens=16)
    again.result(timeout=120)
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert again.tokens == cold.tokens
    seeded_again = mlx_notebook.generate(second, model=tiny_model, worker=worker, **seeded)
    seeded_again.result(timeout=120)
    assert seeded_again.stats.cached_tokens == seeded_again.stats.prompt_tokens - 1
    assert seeded_again.tokens == seeded_cold.tokens
    assert [lp.token for lp in seeded_again.logprobs] == seeded_again.tokens
    for a, b in zip(seeded_again.logprobs, seeded_cold.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_fully_cached_prompts_submitted_together_give_their_solo_tokens(worker, tiny_model, solo):
    """Each prompt's last token was fed by its prefill (it started alone); joining together, a step feeds it."""
    worker.prompt_cache_gb = 2
    for seed in (None, 3):
        for prompt in PROMPTS:  # into the prefix cache
            mlx_notebook.generate(prompt, model=tiny_model, worker=worker, max_tokens=2).result(timeout=120)
        gens = submit_all(worker, tiny_model, seed=seed)
        for gen in gens:
            gen.result(timeout=120)
        assert max(g.stats.batch_size for g in gens) > 1, "the generations never decoded together"
        for prompt, gen in zip(PROMPTS, gens):
            assert gen.stats.cached_tokens == gen.stats.prompt_tokens - 1, prompt
            assert gen.tokens == solo[prompt, seed], (prompt, seed)


def test_a_lone_cached_tokens_forward_runs_in_layer_groups_and_stops_between_them(tiny_model):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_notebook.control import Cancelled, CancelToken, Pace
    from mlx_notebook.generation.prefill import prefill
    from mlx_notebook.generation.stats import GenerationStats
    from mlx_notebook.loading.store import ModelStore

    class Sink:
        stats = GenerationStats()

        def set_state(self, state): ...
        def progress(self, phase, done, total): ...
        def emit(self, token_ids, text): ...

    loaded = ModelStore().get(tiny_model)
    layers = len(loaded.model.layers)
    prompt = list(range(20, 220))
    reference = make_prompt_cache(loaded.model)
    expected = loaded.model(mx.array(prompt)[None], cache=reference)[:, -1, :]

    def cached() -> list:
        cache = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array(prompt[:-1])[None], cache=cache))
        return cache

    # A decode step as slow as the budget: a layer per group, a checkpoint between each two.
    loaded.step_s = 1.0
    checkpoints: list[int] = []
    cache = cached()
    pace = Pace(CancelToken(), 0.1, between=lambda: checkpoints.append(cache[0].offset))
    logits = prefill(loaded, cache, prompt, pace=pace, sink=Sink(), start=len(prompt) - 1, last=True)
    # 1e-4: OpenBLAS's thread count follows the machine's load (loading.blas_threads), and one and two threads
    # give matmuls ~4e-5 apart at this prompt's 200 rows (a failure in a full run); a wrong layer is off by >0.1.
    assert logits is not None and mx.allclose(logits, expected, atol=1e-4).item()
    assert all(layer.offset == len(prompt) for layer in cache)
    assert len(checkpoints) >= layers  # before it, inside it (layers - 1) and after it
    # Without last=, or with tokens still to read, the first decode step feeds it (as before).
    assert prefill(loaded, cached(), prompt, pace=Pace(CancelToken(), 0.1), sink=Sink(), start=len(prompt) - 1) is None
    # A stop at the checkpoint after the first layer: raised out of the forward, the model unchanged.
    token = CancelToken()
    cache = cached()
    calls: list[int] = []

    def stop_in_the_forward() -> None:
        calls.append(1)
        if len(calls) == 3:  # the first checkpoint is the prefill's own, then the one after that
            token.cancel()

    with pytest.raises(Cancelled):
        prefill(
            loaded,
            cache,
            prompt,
            pace=Pace(token, 0.1, between=stop_in_the_forward),
            sink=Sink(),
            start=len(prompt) - 1,
            last=True,
        )
    assert isinstance(loaded.model.layers, list) and len(loaded.model.layers) == layers
    assert type(loaded.model.layers[0]).__name__ != "_CheckpointedLayer"
    again = prefill(
        loaded, cached(), prompt, pace=Pace(CancelToken(), 0.1), sink=Sink(), start=len(prompt) - 1, last=True
    )
    assert again is not None and mx.allclose(again, expected, atol=1e-4).item()


def test_prompt_cache_is_bounded_and_dropped_on_unload(worker, tiny_model):
    worker.prompt_cache_gb = 2
    mlx_notebook.generate(PROMPTS[1], model=tiny_model, worker=worker, max_tokens=8).result(timeout=60)
    loaded = next(m for m in worker.store.loaded() if str(m.source.path) == tiny_model)
    assert loaded.prompt_cache is not None and loaded.prompt_cache.nbytes > 0
    worker.prompt_cache_gb = 1e-9
    assert loaded.prompt_cache.nbytes == 0
    worker.prompt_cache_gb = 2


def test_stopped_prefill_frees_its_cache_without_a_garbage_collection(tiny_model):
    """The layer-group runner once kept a cycle (wrappers -> runner -> KV cache)."""
    import gc

    import mlx.core as mx

    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    long = " ".join(f"w{i}" for i in range(600))
    try:
        mlx_notebook.generate("hello", model=tiny_model, worker=worker, max_tokens=4).result(timeout=60)
        base = worker.call(lambda store: mx.get_active_memory())
        gc.disable()
        for i in range(4):
            gen = mlx_notebook.generate(long, model=tiny_model, worker=worker, max_tokens=4, stop_budget=0.005)
            # Stops at different points of the prefill: after 0, 1, 2, 3 chunks.
            wait_prefill_chunks(gen, i)
            gen.cancel()
            assert gen.wait(60)
            worker.call(lambda store: None)  # the session has ended
            assert worker.call(lambda store: mx.get_active_memory()) == base
    finally:
        gc.enable()
        worker.shutdown()


def test_the_default_batches_on_the_cpu_too(tiny_model, monkeypatch):
    """Batched decode is on by default on every device (loading/policy.batch_decode: measured)."""
    monkeypatch.delenv("MLX_NOTEBOOK_BATCH", raising=False)
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        gens = submit_all(worker, tiny_model, max_tokens=8)
        for gen in gens:
            gen.result(timeout=120)
        assert max(g.stats.batch_size for g in gens) > 1
    finally:
        worker.shutdown()


def test_rows_attended_in_groups_of_one_padding_give_their_solo_tokens(tiny_model, solo, monkeypatch):
    """The decode step's attention in groups of rows (the CPU's and CUDA's path) leaves every row's tokens as they were.

    The mask made dear, so every plan splits the rows by padding: two rows of
    each prompt make groups of two, the four lengths four calls.
    """
    import mlx_lm.models.llama as llama  # the tiny model's module

    from mlx_notebook.generation import attention_patch, row_attention

    # The route is installed module-wide: put mlx-lm's function back after the test.
    monkeypatch.setattr(llama, attention_patch.NAME, getattr(llama, attention_patch.NAME))
    monkeypatch.setattr(row_attention, "wanted", lambda: True)
    monkeypatch.setattr(
        row_attention, "costs", lambda: row_attention.Costs(call=0.03, masked=1.0, unmasked=0.0006, gather=0.0025)
    )
    row_attention._plan.cache_clear()
    plans: list = []
    apply = row_attention.apply
    monkeypatch.setattr(row_attention, "apply", lambda cache, groups: (plans.append(groups), apply(cache, groups)))
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        gens = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=24) for p in PROMPTS + PROMPTS]
        for gen in gens:
            gen.result(timeout=120)
        assert any(g is not None and len(g) == 4 and all(len(x.rows) == 2 for x in g) for g in plans), plans[:3]
        for prompt, gen in zip(PROMPTS + PROMPTS, gens):
            assert gen.tokens == solo[prompt, None], prompt
    finally:
        worker.shutdown()
        row_attention._plan.cache_clear()


def test_decode_buffers_laid_out_for_cuda_attention_give_the_solo_tokens(tiny_model, solo, monkeypatch):
    """Buffers off the grid, then on it past the (lowered) vector kernel's share, leave every row's tokens as they were.

    CUDA's layout (kv_capacity) forced on the CPU: rows join, leave and cross
    the vector kernel's share while decoding, so buffers are laid out again mid-batch.
    """
    from mlx_notebook.generation import kv_capacity

    monkeypatch.setattr(kv_capacity, "_per_shape", lambda per_shape: True)
    # The longest prompt is 81 tokens in the tiny model's template: 8 rows padded to it start at 8 x 82
    # row-positions, below this share, and cross it 6 tokens later.
    monkeypatch.setattr(kv_capacity, "VECTOR_BELOW", 700)
    sizes: list[int] = []
    capacity = kv_capacity.capacity
    monkeypatch.setattr(kv_capacity, "capacity", lambda *a, **kw: sizes.append(capacity(*a, **kw)) or sizes[-1])
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        gens = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=24) for p in PROMPTS + PROMPTS]
        for gen in gens:
            gen.result(timeout=120)
        assert {n % 256 != 0 for n in sizes} == {True, False}, sizes
        for prompt, gen in zip(PROMPTS + PROMPTS, gens):
            assert gen.tokens == solo[prompt, None], prompt
        assert max(g.stats.batch_size for g in gens) > 1
    finally:
        worker.shutdown()


def test_batch_off_by_override(tiny_model, monkeypatch):
    monkeypatch.setenv("MLX_NOTEBOOK_BATCH", "0")
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        gens = submit_all(worker, tiny_model, max_tokens=8)
        for gen in gens:
            gen.result(timeout=120)
        assert [g.stats.batch_size for g in gens] == [1, 1, 1, 1]
    finally:
        worker.shutdown()


class _Rows:
    """Rows of a DecodeBatch driven by hand on this thread (it owns the stream): events in order."""

    def __init__(self, model_path: str, prompts: list[str]) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from mlx_notebook.control import Pace
        from mlx_notebook.generation.decode_batch import DecodeBatch, Row
        from mlx_notebook.generation.handle import Generation, Reporter
        from mlx_notebook.generation.prefill import prefill
        from mlx_notebook.generation.prompt import prepare_prompt
        from mlx_notebook.generation.request import GenerationRequest
        from mlx_notebook.loading.store import ModelStore

        self.stream = mx.new_stream(mx.default_device())
        self.events: list[tuple[str, int]] = []
        self.left: list[tuple[int, object]] = []
        self.kept: list[tuple[list[int], object]] = []
        with mx.stream(self.stream):
            loaded = ModelStore().get(model_path)
            self.batch = DecodeBatch(
                loaded,
                self.stream,
                self._left,
                keep=lambda tokens, cache, kv: self.kept.append((tokens, cache)),
            )
            self.gens = []
            for text in prompts:
                request = GenerationRequest(text, model=model_path, max_tokens=24)
                gen = Generation(request, on_cancel=lambda g: None)
                gen.add_listener(
                    lambda e: self.events.append((e.kind if e.kind != "state" else str(e.state), e.generation.id))
                )
                sink = Reporter(gen)
                pace = Pace(gen.token, 0.1)
                prompt = prepare_prompt(loaded, request)
                cache = make_prompt_cache(loaded.model)
                prefill(loaded, cache, prompt, pace=pace, sink=sink)
                self.batch.add(
                    Row(sink, pace, request, prompt, cache, prompt[-1], time.perf_counter(), time.perf_counter())
                )
                self.gens.append(gen)

    def _left(self, row, cache, error) -> None:
        """What the session does with a row that left: report it (here, without a prompt cache)."""
        from mlx_notebook.generation.states import State
        from mlx_notebook.generation.stats import FinishReason

        self.left.append((row.sink.generation.id, cache))
        row.sink.finish(State.STOPPED if row.finish is FinishReason.STOPPED else State.DONE)

    def step(self) -> None:
        import mlx.core as mx

        with mx.stream(self.stream):
            self.batch.step()


def test_a_stop_is_reported_before_the_step_in_flight_ends(tiny_model, solo):
    """The stopped row leaves at once: reported before the others get the token of the step it was in."""
    rows = _Rows(tiny_model, PROMPTS[:3])
    try:
        for _ in range(4):
            rows.step()  # after each, the next step is built and queued: one is in flight now
        victim = rows.gens[1]
        held = len(victim.tokens)
        rows.events.clear()
        victim.token.cancel()
        # Reported by the cancel itself (no cache handed over yet), before the step in flight is read.
        assert victim.state == "stopped" and len(victim.tokens) == held
        assert rows.events == [("stopped", victim.id)], rows.events
        assert rows.left == [(victim.id, None)]
        rows.step()
        assert len(victim.tokens) == held and all(e[1] != victim.id for e in rows.events[1:]), rows.events
        # Its cache is cut out when that step ends: its prompt and read tokens, for prefix reuse.
        ((tokens, cache),) = rows.kept
        assert tokens[len(tokens) - held :] == victim.tokens and cache[0].offset >= len(tokens)
        while not all(g.finished for g in rows.gens):
            rows.step()
        assert victim.tokens == solo[PROMPTS[1], None][:held]
        for prompt, gen in zip(PROMPTS, rows.gens):
            if gen is not victim:
                assert gen.state == "done" and gen.tokens == solo[prompt, None], prompt
    finally:
        rows.batch.close()


def test_a_stop_from_another_thread_is_reported_while_the_worker_reads_the_step(tiny_model, monkeypatch):
    """The worker lets go of the batch while it waits for the device: a stop asked then is reported at once."""
    import threading

    from mlx_notebook.generation.decode_batch import DecodeBatch

    rows = _Rows(tiny_model, PROMPTS[:3])
    victim = rows.gens[2]
    seen: list[str] = []
    released = DecodeBatch._released

    def while_released(batch):
        """In the worker's first released stretch of a step: stop the victim from a thread, wait for it."""
        with released(batch):
            if not seen and len(victim.tokens) >= 2:
                asker = threading.Thread(target=victim.token.cancel)
                asker.start()
                asker.join(timeout=30)
                assert not asker.is_alive(), "the stop waited for the worker"
                seen.append(str(victim.state))
            yield

    try:
        for _ in range(3):
            rows.step()
        monkeypatch.setattr(DecodeBatch, "_released", contextlib.contextmanager(while_released))
        deadline = time.monotonic() + 60
        while not seen:
            assert time.monotonic() < deadline, "no step released the batch"
            rows.step()
        assert seen == ["stopped"], seen
        while not all(g.finished for g in rows.gens):
            assert time.monotonic() < deadline, "the other rows did not finish"
            rows.step()
        assert [g.state for g in rows.gens] == ["done", "done", "stopped"]
    finally:
        rows.batch.close()


def test_a_stop_of_every_row_waits_for_the_step(tiny_model):
    """A row is reported early only while another goes on: the last one waits for the step and the synchronize."""
    rows = _Rows(tiny_model, PROMPTS[:2])
    try:
        for _ in range(3):
            rows.step()
        first, last = rows.gens
        first.token.cancel()  # the other row goes on: reported at once
        assert first.state == "stopped" and rows.left == [(first.id, None)]
        last.token.cancel()  # no row goes on: left to the worker
        assert not last.finished
        rows.step()
        assert last.state == "stopped"
        # The last row hands its cache over with its report; the first one's was kept at the step's end.
        assert rows.left[1][0] == last.id and rows.left[1][1] is not None
        assert [tokens[-len(first.tokens) :] for tokens, _ in rows.kept] == [first.tokens]
    finally:
        rows.batch.close()


def test_a_prefix_hit_is_restored_in_pieces_with_checkpoints(tiny_model):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_notebook.control import CancelToken, Pace
    from mlx_notebook.generation.chunks import KV_STEP
    from mlx_notebook.generation.prefix_cache import PromptCache, restore
    from mlx_notebook.loading.store import ModelStore

    loaded = ModelStore().get(tiny_model)
    prompt = list(range(20, 320))
    cache = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(mx.array(prompt)[None], cache=cache))
    store = PromptCache(1 << 30)
    store.store(prompt, cache)
    view, n = store.fetch(prompt + [5, 6])
    assert n == len(prompt)
    checkpoints = []
    restore(view, 2 + KV_STEP, Pace(CancelToken(), 0.1, between=lambda: checkpoints.append(1)), piece_s=0.0)
    assert len(checkpoints) == len(view) - 1  # one layer per piece at a zero piece time
    for old, new in zip(cache, view):
        assert new.offset == n and new.keys.shape[2] >= n + 2 + KV_STEP
        assert mx.array_equal(new.keys[..., :n, :], old.keys[..., :n, :]).item()
        assert mx.array_equal(new.values[..., :n, :], old.values[..., :n, :]).item()


def test_a_stored_cache_is_found_at_once_and_the_entries_it_serves_go_at_prune(tiny_model):
    """The worker stores before it reports a generation ended and prunes after (freeing is slow)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_notebook.generation.prefix_cache import PromptCache
    from mlx_notebook.loading.store import ModelStore

    loaded = ModelStore().get(tiny_model)
    prompt = list(range(20, 120))

    def prefilled(tokens):
        cache = make_prompt_cache(loaded.model)
        mx.eval(loaded.model(mx.array(tokens)[None], cache=cache))
        return cache

    store = PromptCache(1 << 30)
    short = prefilled(prompt[:60])
    store.store(prompt[:60], short)
    longer = prefilled(prompt)  # holds 100 positions; stored for its first 90 tokens only
    store.store(prompt[:90], longer, prune=False)
    assert len(store) == 2  # the older entry waits for prune()
    view, n = store.fetch(prompt[:90] + [7])
    assert n == 90 and all(layer.offset == 90 for layer in view)
    assert mx.array_equal(view[0].keys[..., :90, :], longer[0].keys[..., :90, :]).item()
    store.prune()
    assert len(store) == 1
    assert sum(a.nbytes for a in store.arrays()) == store.nbytes  # the arrays memory accounting reads
    assert len(store.arrays()) == 2 * len(longer)
    _, n = store.fetch(prompt[:60] + [7])
    assert n == 60  # served by the newer entry
    store.set_limit(store.nbytes - 1)
    assert len(store) == 0


def test_decode_steps_run_on_the_stream_the_worker_synchronizes(tiny_model, monkeypatch):
    """Regression: the batch's steps ran on the worker thread's default stream, not its own.

    The worker synchronizes its own stream before it reports a generation ended
    (nothing in flight); steps queued on another stream escaped that, and every
    join crossed streams (a fence MLX's CUDA backend waits for on the host).
    """
    import mlx.core as mx

    from mlx_notebook.generation import decode_batch

    streams: set[tuple[str, str]] = set()
    forward = decode_batch.DecodeBatch._logits

    def spy(self, inputs):
        streams.add((str(mx.default_stream(mx.default_device())), str(self.stream)))
        return forward(self, inputs)

    monkeypatch.setattr(decode_batch.DecodeBatch, "_logits", spy)
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        gens = [mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=6) for p in PROMPTS[:2]]
        for gen in gens:
            gen.result(timeout=120)
    finally:
        assert worker.shutdown(timeout=60)
    assert streams and all(current == own for current, own in streams), streams
