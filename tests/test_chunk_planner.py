"""Prefill chunk planning (``generation.chunks.ChunkPlanner``): sizes that fit the budget, on repeatable boundaries."""

from __future__ import annotations

import pytest

from mlx_notebook.generation.chunks import MAX_PREFILL_CHUNK, ChunkPlanner

pytestmark = pytest.mark.unit


def simulate(planner: ChunkPlanner, tokens: int, target_s: float, device):
    """The chunks ``(start, size)`` planned for a device whose chunk from ``start`` costs ``device(start, n)``."""
    chunks, done = [], 0
    while done < tokens:
        n = planner.next_chunk(target_s, done, tokens - done)
        planner.observe(n, device(done, n), start=done)
        chunks.append((done, n))
        done += n
    return chunks


def plan(planner: ChunkPlanner, tokens: int, target_s: float, fixed_s: float, per_token_s: float):
    """The chunks for a device whose chunk costs ``fixed + n * per_token``."""
    return simulate(planner, tokens, target_s, lambda start, n: fixed_s + n * per_token_s)


def test_a_known_cost_and_a_fresh_start_share_their_chunk_boundaries() -> None:
    # An accelerator that builds kernels per shape: a second run of a prompt
    # must reuse the first run's (start, size) pairs after its first chunk.
    cost = dict(fixed_s=0.002, per_token_s=1e-5)
    shapes: set = set()
    fresh = plan(ChunkPlanner(None, shapes), 32767, 0.4, **cost)
    warm = plan(ChunkPlanner((cost["fixed_s"], cost["per_token_s"]), shapes), 32767, 0.4, **cost)
    assert fresh[0][1] < warm[0][1] == MAX_PREFILL_CHUNK, "a fresh planner starts small to measure"
    assert [c for c in fresh if c[0] >= MAX_PREFILL_CHUNK] == warm[1:]
    # Without the per-shape rules (a CPU) the same plans do not line up.
    fresh_cpu = plan(ChunkPlanner(), 32767, 0.4, **cost)
    assert not set(fresh_cpu) & set(warm[1:])


def test_sizes_are_powers_of_two_on_their_own_boundaries() -> None:
    chunks = plan(ChunkPlanner((0.001, 3e-5), set()), 20000, 0.03, fixed_s=0.001, per_token_s=3e-5)
    assert chunks[-1][0] + chunks[-1][1] == 20000
    for start, n in chunks[:-1]:
        size = 1 << (n.bit_length() - 1)
        # Either a whole aligned power of two, or the part that reaches the next boundary.
        assert (start + n) % size == 0 and (n == size or start % size != 0), (start, n)
        assert n <= MAX_PREFILL_CHUNK
    # The budget still sets the size: 0.03 s fits ~970 tokens, so 512-token chunks.
    assert max(n for _, n in chunks) == 512


def test_without_per_shape_builds_sizes_follow_the_budget_and_big_chunks_the_kv_step() -> None:
    chunks = plan(ChunkPlanner((0.001, 3e-5)), 20000, 0.03, fixed_s=0.001, per_token_s=3e-5)
    assert sum(n for _, n in chunks) == 20000
    sizes = [n for _, n in chunks[:-1]]
    assert max(sizes) == 768 and all((s + n) % 256 == 0 for s, n in chunks[:-1]), chunks[:4]


def test_a_slow_device_gets_small_chunks_and_no_token_is_skipped() -> None:
    chunks = plan(ChunkPlanner(), 300, 0.07, fixed_s=0.0, per_token_s=0.006)
    assert sum(n for _, n in chunks) == 300
    assert [s for s, _ in chunks] == sorted(s for s, _ in chunks)
    assert max(n for _, n in chunks) == 11  # 0.07 s / 6 ms


def run_prompt(cost, shapes, tokens: int, target_s: float, device):
    """One generation's prefill: the planner's cost to carry to the next one, and its chunks."""
    planner = ChunkPlanner(cost, shapes)
    chunks = simulate(planner, tokens, target_s, device)
    return planner.cost, chunks


def building_device():
    """Like the CUDA backend: a chunk of a new (start, size) pair first builds a graph (0.3 s here)."""
    built = set()

    def device(start: int, n: int) -> float:
        new = (start, n) not in built
        built.add((start, n))
        return 0.004 + n * 2e-6 + (0.3 if new else 0.0)

    return device


def test_first_use_builds_do_not_shrink_the_chunks_into_more_builds() -> None:
    device = building_device()
    shapes, cost, runs = set(), None, []
    for _ in range(4):
        cost, chunks = run_prompt(cost, shapes, 511, 0.112, device)
        runs.append(chunks)
    assert all(len(chunks) <= 6 for chunks in runs), runs
    # From the second run on, every chunk is a shape built before: no build inside a piece.
    builds_after_first = {c for chunks in runs[1:] for c in chunks} - set(runs[0])
    assert len(builds_after_first) <= 1, builds_after_first
    assert runs[-1] == runs[-2]


def test_without_the_per_shape_rules_every_run_builds_new_shapes() -> None:
    # The same device planned as on a CPU: the rules above are what stop the builds.
    device = building_device()
    cost, runs = None, []
    for _ in range(4):
        cost, chunks = run_prompt(cost, None, 511, 0.112, device)
        runs.append(chunks)
    builds_after_first = {c for chunks in runs[1:] for c in chunks} - set(runs[0])
    assert len(builds_after_first) > 3, runs


def test_a_plan_that_wobbles_up_reuses_the_shapes_already_built() -> None:
    # A run planned 1024-token chunks; the next run's carried cost allows 2048
    # (e.g. measured on a shorter prompt). On CUDA each new (start, size) pair
    # builds a graph inside a piece, so the known smaller shapes are reused.
    shapes: set = set()
    # 0.112 s fits ~1100 tokens: 1024-token chunks.
    _, first = run_prompt((0.002, 1e-4), shapes, 8191, 0.112, lambda s, n: 0.002 + n * 1e-4)
    assert max(n for _, n in first) == 1024
    fast = (0.002, 4e-5)  # fits ~2750 tokens -> 2048 planned
    _, second = run_prompt(fast, shapes, 8191, 0.112, lambda s, n: 0.002 + n * 4e-5)
    assert set(second) <= set(first), set(second) - set(first)
    # Without the seen shapes the same cost plans 2048-token chunks: all new shapes.
    _, fresh = run_prompt(fast, set(), 8191, 0.112, lambda s, n: 0.002 + n * 4e-5)
    assert max(n for _, n in fresh) == 2048


def test_a_prompts_rest_is_padded_to_a_chunk_built_before_and_no_further() -> None:
    from mlx_notebook.generation.chunks import padded_to_seen

    built = {(7680, 512), (4096, 1024), (4096, 512)}
    # An 8k prompt's rest (7680..8191): the aligned 512 a longer prompt ran there.
    assert padded_to_seen(511, 7680, 511, built) == 512
    # The smallest chunk built that holds it.
    assert padded_to_seen(300, 4096, 300, built) == 512
    assert padded_to_seen(903, 4096, 903, built) == 1024
    # Not the rest, nothing built there, a pad over the chunk's own size, no per-shape builds: as planned.
    assert padded_to_seen(511, 7680, 900, built) == 511
    assert padded_to_seen(511, 7168, 511, built) == 511
    assert padded_to_seen(200, 4096, 200, built) == 200
    assert padded_to_seen(511, 7680, 511, None) == 511
