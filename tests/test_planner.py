"""The chunk planner's fit on simulated devices: CPU load, context growth, a cold start, noise.

Each device is a cost model (deterministic, seeded noise): what a chunk of ``n``
tokens from position ``start`` truly costs, and what the planner is told.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mlx_notebook.generation.chunks import MAX_PREFILL_CHUNK, ChunkPlanner

GROWTH = 4  # the planner's most growth from one chunk to the next


@dataclass(frozen=True)
class CostModel:
    """A chunk of ``n`` tokens from ``start`` costs ``fixed_s + n * (per_token_s + per_context_s * (start + n / 2))``."""

    fixed_s: float
    per_token_s: float
    per_context_s: float = 0.0

    def seconds(self, n: float, start: float) -> float:
        return self.fixed_s + n * (self.per_token_s + self.per_context_s * (start + n / 2))

    def _root(self, start: float, rhs: float) -> float:
        a, b = self.per_context_s / 2, self.per_token_s + self.per_context_s * start
        if rhs <= 0:
            return 0.0
        return rhs / b if a == 0 else (-b + (b * b + 4 * a * rhs) ** 0.5) / (2 * a)

    def size_within(self, seconds: float, start: float) -> float:
        return self._root(start, seconds - self.fixed_s)

    def balance_size(self, start: float) -> float:
        return self._root(start, self.fixed_s)


pytestmark = pytest.mark.unit

BUDGET = 0.1
SHARE = 0.7  # the engine's BUDGET_SHARE


@dataclass
class Run:
    start: int
    n: int
    true_s: float
    measured_s: float


Device = Callable[[int, int, random.Random], tuple[float, float]]


def device(
    fixed: float,
    per_token: float,
    per_context: float = 0.0,
    *,
    noise: float = 0.0,
    spikes: float = 0.0,
    spike_s: float = 0.0,
    first_extra_s: float = 0.0,
) -> Device:
    """A chunk costs ``fixed + n * (per_token + per_context * (start + n / 2))``.

    ``noise``: multiplicative log-normal sigma on the measurement; ``spikes``:
    the share of chunks that also lose ``spike_s`` (a preemption);
    ``first_extra_s``: a one-time cost of the process's first chunk.
    """
    model = CostModel(fixed, per_token, per_context)
    first = [True]

    def run(start: int, n: int, rng: random.Random) -> tuple[float, float]:
        true = model.seconds(n, start)
        measured = true * (rng.lognormvariate(0.0, noise) if noise else 1.0)
        if spikes and rng.random() < spikes:
            measured += spike_s
        if first[0]:
            first[0] = False
            measured += first_extra_s
        return true, measured

    return run


def simulate(planner: ChunkPlanner, tokens: int, target_s: float, dev: Device, *, seed: int = 0) -> list[Run]:
    rng = random.Random(seed)
    runs, done = [], 0
    while done < tokens:
        n = planner.next_chunk(target_s, done, tokens - done)
        assert 1 <= n <= tokens - done
        true, measured = dev(done, n, rng)
        planner.observe(n, measured, start=done)
        runs.append(Run(done, n, true, measured))
        done += n
    return runs


def total(runs: list[Run]) -> float:
    return sum(r.true_s for r in runs)


def oracle_plan(model: CostModel, tokens: int, target_s: float) -> list[tuple[int, int]]:
    """``(start, size)`` of the chunks a planner that knew the true cost would run: each fills the target."""
    plan, done = [], 0
    while done < tokens:
        n = min(tokens - done, max(1, int(model.size_within(target_s, done))))
        plan.append((done, n))
        done += n
    return plan


def ideal_chunks(model: CostModel, tokens: int, target_s: float) -> int:
    """Chunks a planner that knew the true cost would need."""
    return len(oracle_plan(model, tokens, target_s))


def cost_model(params: dict) -> CostModel:
    """The true cost of a :func:`device`'s keyword arguments (its noise left out)."""
    return CostModel(params["fixed"], params["per_token"], params.get("per_context", 0.0))


# The default model (SmolLM2-135M, 30 layers) on this 2-core CPU, layer pieces:
# a chunk may take 0.1 s * 0.7 * 30 / 2. Quiet: ~80 ms fixed (every weight
# read once, 30 layer evaluations), ~10 ms a token, attention +3 ms a token
# per 1,000 of context. Beside two busy loops (measured with forced chunk
# sizes): the fixed part 15-25x (every evaluation waits for the scheduler),
# the per-token part ~2.5x (the lost CPU share), and times scattered 0.2-5 s
# for the same 4-token chunk.
LAYER_TARGET = BUDGET * SHARE * 15
QUIET = dict(fixed=0.08, per_token=0.010, per_context=3e-6)
LOADED = dict(fixed=1.5, per_token=0.025, per_context=8e-6, noise=0.5, spikes=0.1, spike_s=3.0)


# What the planner is told a chunk costs in the engine (layer pieces, budget
# 0.1), measured in session 18 with forced chunk sizes over 1,500 positions
# (`benchmarks/results/cpu_engine_chunk_cost_session18.log`; three parts
# fitted with relative errors; noise: the standard deviation of the log
# ratios around that fit). Eight busy loops (load ~10) swell the fixed part
# 3.7x and the per-token part 8x, not the fixed part 19x as LOADED's.
ENGINE = {
    "quiet": dict(fixed=0.07, per_token=0.0012, per_context=5.8e-6, noise=0.16),
    "2 busy loops": dict(fixed=0.13, per_token=0.0043, per_context=8e-6, noise=0.13),
    "8 busy loops": dict(fixed=0.26, per_token=0.01, per_context=2.65e-5, noise=0.19),
}


def oracle_total(model: CostModel, tokens: int, target_s: float) -> float:
    """Seconds a planner that knew the true cost would spend (:func:`oracle_plan`)."""
    return sum(model.seconds(n, start) for start, n in oracle_plan(model, tokens, target_s))


def per_token_only(runs: list[Run], fixed: float) -> float:
    """What the same chunks would cost without their fixed parts."""
    return total(runs) - fixed * len(runs)


def test_load_swelling_never_locks_the_chunks_at_one_token() -> None:
    # A 1-token chunk over the target taught an all-per-token fit (alike sizes
    # cannot tell a fixed part) that nothing fits, and every later chunk was
    # 1 token paying the whole fixed part: one seed of 40 ran 885 chunks and
    # 13x its tokens' cost (1,439 s; with the way out the 40 take 185 s
    # median, 283 s at most).
    for seed in range(40):
        runs = simulate(ChunkPlanner(), 3000, LAYER_TARGET, device(**LOADED), seed=seed)
        assert total(runs) <= 3 * per_token_only(runs, LOADED["fixed"]), (seed, round(total(runs)), len(runs))


@pytest.mark.xfail(
    strict=True,
    reason="open: with 0.5 log-noise and 10% 3-s preemptions a fit over 8 chunks cannot split the fixed from the "
    "per-token cost (its balance-size estimate spans 0 to >100x the true one), so the median chunk lands anywhere "
    "from 0.14x to 2.1x the balance size over 40 seeds (0.81x the median seed; 4 of these 5 seeds under 0.7x); "
    "windows, a noise-aware shift rule, dither and a ramp did not close it (docs/benchmarks.md, session 33; issue 20)",
)
def test_load_swelling_the_fixed_cost_does_not_collapse_the_chunks() -> None:
    true = cost_model(LOADED)
    for seed in range(5):
        loaded = simulate(ChunkPlanner(), 3000, LAYER_TARGET, device(**LOADED), seed=seed)
        # At least half of the time goes to tokens, not to fixed costs: no
        # planner can beat the per-token part, and this one pays at most as
        # much again (a collapse to 6-21-token chunks paid 10x).
        assert total(loaded) <= 2.3 * per_token_only(loaded, LOADED["fixed"]), (seed, total(loaded))
        # Chunks stay near the size whose per-token part equals the fixed part.
        sizes = [r.n for r in loaded[4:-1]]
        floor = statistics.median(true.balance_size(r.start) for r in loaded)
        assert statistics.median(sizes) >= 0.7 * floor, (seed, floor, sizes)
        # So a chunk takes about twice its fixed part, not more: a stop waits about that.
        assert statistics.median(r.true_s for r in loaded[4:]) <= 3 * LOADED["fixed"]


@pytest.mark.parametrize("load", list(ENGINE))
def test_the_engines_measured_costs_take_about_what_an_oracle_would(load: str) -> None:
    # A 3,000-token prefill of the default model at budget 0.1: the chunks'
    # fixed parts are the planner's only cost beyond the tokens'. At 8 busy
    # loops the real prefill took 240 s against plain mlx-lm's 205 s: at 33-90
    # ms a token, chunks that fit the budget are 10-30 tokens, each paying its
    # fixed part; the oracle pays that too.
    params = ENGINE[load]
    true = cost_model(params)
    best = oracle_total(true, 3000, LAYER_TARGET)
    for seed in range(6):
        runs = simulate(ChunkPlanner(), 3000, LAYER_TARGET, device(**params), seed=seed)
        # Chunks of a fixed 32 tokens would take 1.09-1.14x the oracle quiet and at 2 loops.
        assert total(runs) <= 1.1 * best, (seed, round(total(runs), 1), round(best, 1), len(runs))
        assert statistics.median(r.true_s for r in runs) >= 0.6 * LAYER_TARGET


@pytest.mark.parametrize(
    "load",
    ["quiet", "2 busy loops", "8 busy loops"],
)
def test_the_engines_measured_costs_keep_nine_chunks_in_ten_within_the_target(load: str) -> None:
    params = ENGINE[load]
    for seed in range(6):
        times = sorted(r.true_s for r in simulate(ChunkPlanner(), 3000, LAYER_TARGET, device(**params), seed=seed))
        assert times[int(0.9 * len(times))] <= 1.5 * LAYER_TARGET, (seed, times[int(0.9 * len(times)) :])


@pytest.mark.parametrize("load", [*ENGINE, "QUIET"])
def test_the_next_prompts_first_chunk_from_the_carried_cost_fits_the_target(load: str) -> None:
    # The engine hands a prompt's last fit, (fixed, per_token), to the next prompt of the model
    # (LoadedModel.prefill_cost until session 38); its context part stayed behind. A fit that put the cost of late
    # chunks into that part carries a per-token cost near 0, and the next prompt opened with a
    # 2,048-token chunk: tried in session 29 (the context part fitted from 256 positions, not
    # 512), 14x the target here in most quiet seeds, and on the CPU beside two busy loops stops
    # of 1.4-2.5 s against 38-65 ms (`cpu_prefill_load_ctx256_tried_session29.json`). The other
    # tests here run one prompt at a time and did not see it.
    params = ENGINE.get(load, QUIET)
    true = cost_model(params)
    for seed in range(30):
        first = ChunkPlanner()
        simulate(first, 3000, LAYER_TARGET, device(**params), seed=seed)
        n = ChunkPlanner(first.cost, history=first.history).next_chunk(LAYER_TARGET, 0, 3000)
        assert true.seconds(n, 0) <= 1.5 * LAYER_TARGET, (seed, n, first.cost, first.per_context)


def test_a_fit_with_no_per_token_part_does_not_open_the_next_prompt_with_the_largest_chunk() -> None:
    # Measured (session 38): the last chunks of a 2,716-token prompt of the tiny test model, budget 0.05, this
    # CPU. The fit puts their cost in the context part; carried as (fixed, per_token) alone, the next prompt
    # planned 2,048 tokens at position 0 (stops of 0.4-0.8 s); from the chunks, it grows from what they measured.
    history = [
        (143, 1840, 0.0703), (132, 1983, 0.0692), (125, 2115, 0.0654), (121, 2240, 0.0672),
        (117, 2361, 0.0799), (108, 2478, 0.0835), (100, 2586, 0.0630), (30, 2686, 0.0222),
    ]  # fmt: skip
    carried = ChunkPlanner(history=history)
    assert carried.cost is not None and carried.cost[1] == 0.0 and carried.per_context > 0
    assert ChunkPlanner(carried.cost).next_chunk(0.07, 0, 2716) == MAX_PREFILL_CHUNK  # the trap, from the fit alone
    n = carried.next_chunk(0.07, 0, 2716)
    assert 8 < n <= max(x for x, _, _ in history), n
    assert carried.history == tuple(history)


def test_the_same_planner_keeps_quiet_chunks_within_the_target() -> None:
    runs = simulate(ChunkPlanner(), 3000, LAYER_TARGET, device(**QUIET))
    assert max(r.true_s for r in runs) <= LAYER_TARGET / SHARE
    assert statistics.median(r.true_s for r in runs[4:]) >= 0.6 * LAYER_TARGET


def test_load_arriving_mid_prefill_is_followed_within_a_few_chunks() -> None:
    quiet, loaded = device(**QUIET), device(**{**LOADED, "noise": 0.0, "spikes": 0.0})
    switch = 1500

    def dev(start: int, n: int, rng: random.Random) -> tuple[float, float]:
        return (loaded if start >= switch else quiet)(start, n, rng)

    runs = simulate(ChunkPlanner(), 4000, LAYER_TARGET, dev)
    after = [r for r in runs if r.start >= switch]
    # Planned from quiet costs, the first chunk after the switch runs long; two later they fit the floor.
    assert all(r.true_s <= 2.5 * LOADED["fixed"] for r in after[2:]), [(r.n, round(r.true_s, 2)) for r in after]
    # And they do not collapse: they stay near the size whose tokens cost as
    # much as the swollen fixed part. (This asked for chunks no smaller than
    # the quiet ones until session 18; that contradicts the bound above: at
    # the quiet median of ~97 tokens a loaded chunk from 1,500 costs 5.1 s,
    # past 2.5 x 1.5 s.)
    true = cost_model(LOADED)
    floor = statistics.median(true.balance_size(r.start) for r in after)
    assert statistics.median(r.n for r in after[2:-1]) >= 0.7 * floor


def test_context_growth_is_tracked_chunk_by_chunk() -> None:
    # An accelerator at long context: attention makes a token at 16k cost 17x one at 0.
    true = CostModel(0.002, 2e-5, 2e-8)
    target = BUDGET * SHARE
    runs = simulate(ChunkPlanner(), 16384, target, device(0.002, 2e-5, 2e-8))
    assert max(r.true_s for r in runs) <= BUDGET, max(r.true_s for r in runs)
    assert max(r.true_s for r in runs[6:]) <= 1.1 * target
    # Sizes follow the cost down as the context grows (big chunks end on the
    # KV step, so sizes come in multiples of 256), without wasting chunks.
    assert runs[-2].n <= max(r.n for r in runs) / 2
    assert len(runs) <= 1.3 * ideal_chunks(true, 16384, target) + 6, len(runs)


def test_a_cold_start_grows_from_the_probe_no_faster_than_measurements_allow() -> None:
    # The random qwen3 (hidden 256, 6 layers) on this CPU: small chunks are
    # nearly all fixed cost, so their slope says nothing about big ones.
    target = BUDGET * SHARE * 3
    for seed in range(20):
        dev = device(0.012, 4e-4, noise=0.2, first_extra_s=0.05)
        runs = simulate(ChunkPlanner(), 3500, target, dev, seed=seed)
        assert runs[0].n <= 8
        for i, r in enumerate(runs[1:], 1):
            assert r.n <= GROWTH * max(x.n for x in runs[:i]), runs[: i + 1]
        assert max(r.true_s for r in runs) <= target / SHARE, (seed, [(r.n, round(r.true_s, 3)) for r in runs[:8]])


def test_a_cold_start_on_a_steep_device_never_extrapolates_the_probes_slope() -> None:
    # Chunks of 8 and 32 cost the same (a flat fixed part hides the per-token
    # cost): a fitted line through them is flat, yet 2,000 tokens take 2 s.
    for seed in range(20):
        dev = device(0.03, 1e-3, noise=0.1)
        runs = simulate(ChunkPlanner(), 2000, BUDGET * SHARE, dev, seed=seed)
        assert max(r.true_s for r in runs) <= BUDGET, (seed, [(r.n, round(r.true_s, 3)) for r in runs[:8]])


def test_noise_and_preemptions_cost_neither_the_budget_nor_much_speed() -> None:
    target = BUDGET * SHARE
    true = CostModel(0.01, 5e-4)
    for seed in range(10):
        dev = device(0.01, 5e-4, noise=0.25, spikes=0.05, spike_s=0.5)
        runs = simulate(ChunkPlanner(), 6000, target, dev, seed=seed)
        assert max(r.true_s for r in runs) <= BUDGET
        # A preemption shrinks at most the chunk after it: chunks stay near the target size.
        assert statistics.median(r.true_s for r in runs) >= 0.7 * target
        assert len(runs) <= 1.5 * ideal_chunks(true, 6000, target)
