"""Prefill chunk planning (``engine.ChunkPlanner``): sizes that fit the budget, on repeatable boundaries."""

from __future__ import annotations

import pytest

from mlx_notebook.engine import MAX_PREFILL_CHUNK, ChunkPlanner


def plan(planner: ChunkPlanner, tokens: int, target_s: float, fixed_s: float, per_token_s: float):
    """The chunks ``(start, size)`` for a device whose chunk costs ``fixed + n * per_token``."""
    chunks, done = [], 0
    while done < tokens:
        n = planner.next_chunk(target_s, done, tokens - done)
        chunks.append((done, n))
        planner.observe(n, fixed_s + n * per_token_s)
        done += n
    return chunks


@pytest.mark.parametrize("target_s", [0.007, 0.05, 0.4])
def test_a_known_cost_and_a_fresh_start_share_their_chunk_boundaries(target_s: float) -> None:
    # An accelerator: a fixed cost per chunk and a small one per token. The
    # CUDA backend builds an attention graph per (chunk, context) pair, so a
    # second run of a prompt must reuse the first run's pairs.
    cost = dict(fixed_s=0.002, per_token_s=1e-5)
    tokens = 32767
    fresh = plan(ChunkPlanner(), tokens, target_s, **cost)
    warm = plan(ChunkPlanner((cost["fixed_s"], cost["per_token_s"])), tokens, target_s, **cost)
    assert fresh[0][1] < warm[0][1], "a fresh planner starts small to measure"
    largest = max(n for _, n in warm)
    fresh_after = [c for c in fresh if c[0] >= largest]
    warm_after = [c for c in warm if c[0] >= largest]
    assert fresh_after == warm_after and len(warm_after) > 3


def test_sizes_are_powers_of_two_on_their_own_boundaries() -> None:
    chunks = plan(ChunkPlanner(), 20000, 0.03, fixed_s=0.001, per_token_s=3e-5)
    assert chunks[-1][0] + chunks[-1][1] == 20000
    for start, n in chunks[:-1]:
        size = 1 << (n.bit_length() - 1)
        # Either a whole aligned power of two, or the part that reaches the next boundary.
        assert (start + n) % size == 0 and (n == size or start % size != 0), (start, n)
        assert n <= MAX_PREFILL_CHUNK
        if n >= 256:
            assert (start + n) % 256 == 0, (start, n)
    # The budget still sets the size: 0.03 s fits ~970 tokens, so 512-token chunks.
    assert max(n for _, n in chunks) == 512


def test_a_slow_device_gets_small_chunks_and_no_token_is_skipped() -> None:
    chunks = plan(ChunkPlanner(), 300, 0.07, fixed_s=0.0, per_token_s=0.006)
    assert sum(n for _, n in chunks) == 300
    assert [s for s, _ in chunks] == sorted(s for s, _ in chunks)
    assert max(n for _, n in chunks) == 8  # 0.07 s / 6 ms = 11 tokens -> 8


def run_prompt(cost, shapes, tokens: int, target_s: float, device):
    planner = ChunkPlanner(cost, shapes)
    chunks, done = [], 0
    while done < tokens:
        n = planner.next_chunk(target_s, done, tokens - done)
        planner.observe(n, device(done, n), start=done)
        chunks.append((done, n))
        done += n
    return planner.cost, chunks


def test_first_use_builds_do_not_shrink_the_chunks_into_more_builds() -> None:
    # Like the CUDA backend: a new (start, size) pair first builds a graph (0.3 s here).
    built = set()

    def device(start: int, n: int) -> float:
        new = (start, n) not in built
        built.add((start, n))
        return 0.004 + n * 2e-6 + (0.3 if new else 0.0)

    shapes, cost, runs = set(), None, []
    for _ in range(4):
        cost, chunks = run_prompt(cost, shapes, 511, 0.112, device)
        runs.append(chunks)
    assert all(len(chunks) <= 6 for chunks in runs), runs
    # From the second run on, every chunk is a shape built before: no build inside a piece.
    builds_after_first = {c for chunks in runs[1:] for c in chunks} - set(runs[0])
    assert len(builds_after_first) <= 1, builds_after_first
    assert runs[-1] == runs[-2]


def test_without_the_first_use_rule_builds_feed_the_cost_model() -> None:
    # The same device without shapes_seen: the rule above is what keeps chunks large.
    built = set()

    def device(start: int, n: int) -> float:
        new = (start, n) not in built
        built.add((start, n))
        return 0.004 + n * 2e-6 + (0.3 if new else 0.0)

    _, chunks = run_prompt(None, None, 511, 0.112, device)
    assert len(chunks) > 10, chunks


def test_a_plan_that_wobbles_up_reuses_the_shapes_already_built() -> None:
    # A run planned 1024-token chunks; the next run's carried cost allows 2048
    # (e.g. measured on a shorter prompt). On CUDA each new (start, size) pair
    # builds a graph inside a piece, so the known smaller shapes are reused.
    shapes: set = set()
    # 0.112 s fits ~1100 tokens: 1024-token chunks.
    _, first = run_prompt((0.002, 1e-4), shapes, 8191, 0.112, lambda s, n: 0.002 + n * 1e-4)
    assert max(n for _, n in first) == 1024
    fast = (0.002, 4e-5)                           # fits ~2750 tokens -> 2048 planned
    _, second = run_prompt(fast, shapes, 8191, 0.112, lambda s, n: 0.002 + n * 4e-5)
    assert set(second) <= set(first), set(second) - set(first)
    # Without the seen shapes the same cost plans 2048-token chunks: all new shapes.
    _, fresh = run_prompt(fast, set(), 8191, 0.112, lambda s, n: 0.002 + n * 4e-5)
    assert max(n for _, n in fresh) == 2048
