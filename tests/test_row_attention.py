"""A padded batch's decode attention in groups of rows gives what the masked call gives (mlx-lm's model, real caches).

The path is switched on only where MLX's fused attention refuses masks (the
CUDA backend); here it is forced on the CPU to check its numbers.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_notebook.generation import batch_cache, row_attention
from testkit.tiny_model import make_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm.utils import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("rows") / "model", layers=2)
    loaded, _ = load_model(Path(folder))
    return loaded


def _batch(model, lengths: list[int]):
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        ids = mx.array([[(7 * i + j) % 300 + 10 for j in range(n)]], dtype=mx.uint32)
        model(ids, cache=cache)
        caches.append(cache)
    return batch_cache.merge(caches)


@pytest.mark.parametrize("lengths", [[5, 40, 17], [12, 12, 12], [1, 64]])
def test_row_by_row_equals_the_masked_step(model, lengths: list[int]) -> None:
    assert row_attention.install(model) and row_attention.install(model)  # idempotent
    _same_as_masked(model, lengths, lambda pads: [row_attention.Group((i,), p, (p,)) for i, p in enumerate(pads)])


def test_groups_of_rows_equal_the_masked_step(model) -> None:
    """Equal paddings together, a gathered pair, a masked group: every kind of call the plan makes."""
    row_attention.install(model)
    lengths = [5, 40, 17, 40, 5]
    G = row_attention.Group

    def plans(pads):
        return [
            # rows 1 and 3 (same length, not neighbours: gathered), then 0 and 4, then 2 alone
            [G((1, 3), pads[1], (pads[1],) * 2), G((0, 4), pads[0], (pads[0],) * 2), G((2,), pads[2], (pads[2],))],
            # a masked group of three lengths beside an unmasked pair
            [G((0, 2, 4), pads[2], (pads[0], pads[2], pads[4])), G((1, 3), pads[1], (pads[1],) * 2)],
            # every row in one group read from the first position
            [G((0, 1, 2, 3, 4), 0, tuple(pads))],
        ]

    for k in range(3):
        _same_as_masked(model, lengths, lambda pads, k=k: plans(pads)[k])


def test_the_plan_makes_one_call_per_length_where_the_mask_costs_more(monkeypatch) -> None:
    G = row_attention.Group
    CUDA = row_attention.CUDA_COSTS
    # Seven rows of one length and a joined 8k prompt: two fused calls (session 12: the masked call
    # 0.57 ms a layer, one call per row 0.36-0.45).
    assert row_attention.plan([7000] * 7 + [0], 8300, CUDA) == [G(tuple(range(7)), 7000, (7000,) * 7), G((7,), 0, (0,))]
    # ... in the rows' order, so the step's outputs need no reordering (no gather after the calls).
    monkeypatch.setattr(row_attention, "costs", lambda: CUDA)
    cache = [SimpleNamespace(_idx=8299) for _ in range(2)]
    row_attention.mark(cache, [7000] * 7 + [0])
    assert all(layer.row_plan[1] is None for layer in cache)
    row_attention.mark(cache, [0] + [7000] * 7)  # the long row first: the same
    assert cache[0].row_plan[1] is None and [g.rows for g in cache[0].row_plan[0]] == [(0,), tuple(range(1, 8))]
    # Eight lengths within 1k positions: one masked call, mlx-lm's (None); beyond ~4k, a call per row
    # or per close lengths (session 12's crossover: masked 0.30 against 0.26 ms per row at 4k).
    spread = [10, 20, 30, 40, 50, 60, 70, 0]
    assert row_attention.plan(spread, 1000, CUDA) is None
    far = [0, 1000, 2000, 3000, 4000, 5000, 6000, 7000]
    assert len(row_attention.plan(far, 8200, CUDA)) >= 4
    # No padding: one fused call for all.
    assert row_attention.plan([0, 0, 0], 300, CUDA) == [G((0, 1, 2), 0, (0, 0, 0))]
    # Every row exactly once.
    for pads, positions in [(far, 8200), ([5, 0, 5, 0], 6000), ([300, 800, 1200, 0] * 4, 4300)]:
        groups = row_attention.plan(pads, positions, CUDA)
        assert sorted(i for g in groups for i in g.rows) == list(range(len(pads)))
        assert all(g.start == min(pads[i] for i in g.rows) for g in groups)


def test_on_the_cpu_the_plan_splits_a_joined_long_prompt_from_short_rows_and_keeps_close_lengths_together() -> None:
    # MLX's CPU attention reads every position a call is given, masked or not: a joined 3,000-token prompt
    # and three rows of 64 stepped in 158-164 ms split, 249-262 ms as one masked call (the default model).
    G = row_attention.Group
    CPU = row_attention.CPU_COSTS
    assert row_attention.plan([2950] * 3 + [0], 3100, CPU) == [G((0, 1, 2), 2950, (2950,) * 3), G((3,), 0, (0,))]
    # Four chat prompts of 20-60 tokens: one masked call (a call costs more than the padding it would skip).
    assert row_attention.plan([40, 0, 25, 10], 120, CPU) is None
    # Rows that are not neighbours are not gathered for a small saving.
    groups = row_attention.plan([0, 900, 0, 900], 1200, CPU)
    assert groups is None or all(max(g.rows) - min(g.rows) + 1 == len(g.rows) for g in groups)


def _same_as_masked(model, lengths: list[int], plan_for) -> None:
    inputs = mx.array([[3]] * len(lengths), dtype=mx.uint32)
    masked_cache, pads = _batch(model, lengths)
    rows_cache, _ = _batch(model, lengths)
    row_attention.mark(masked_cache, None)
    for _ in range(3):  # the cache grows step by step; each step compared
        row_attention.apply(rows_cache, plan_for(pads))
        masked = model(inputs, cache=masked_cache)
        rows = model(inputs, cache=rows_cache)
        assert mx.allclose(masked, rows, atol=1e-4).item(), float(mx.abs(masked - rows).max())
        inputs = mx.argmax(masked[:, -1:, :], axis=-1).astype(mx.uint32)


def test_a_cache_without_row_pads_and_a_prefill_take_mlx_lms_call(model) -> None:
    row_attention.install(model)
    cache, pads = _batch(model, [4, 9])
    row_attention.mark(cache, pads)
    # Several query positions (a prefill chunk): the wrapper leaves it to mlx-lm's masked call.
    out = model(mx.array([[3, 4], [5, 6]], dtype=mx.uint32), cache=cache)
    assert out.shape[:2] == (2, 2)


def test_the_warm_up_runs_every_kind_of_split_call_once(monkeypatch) -> None:
    # The first split step of a process paid ~9 ms of first uses on an H100 (session 40), inside the
    # others' gap when a prompt joins: the warm-up must meet each kind of call a split step makes.
    seen, reads = [], []
    real = row_attention._attend_group

    def spy(g, queries, keys, values, scale):
        seen.append((len(g.rows) > 1, g.rows[-1] - g.rows[0] + 1 != len(g.rows), g.masked))
        reads.append(keys.shape[2] - g.start)
        out = real(g, queries, keys, values, scale)
        assert out.shape == (len(g.rows), queries.shape[1], 1, queries.shape[3])
        return out

    monkeypatch.setattr(row_attention, "_attend_group", spy)
    row_attention.warm(heads=4, kv_heads=2, dim=16, dtype=mx.float16)
    # (several rows, gathered, masked): neighbours, a single row, a gathered pair, a masked pair.
    assert {(True, False, False), (False, False, False), (True, True, False), (True, False, True)} <= set(seen)
    # A joined long prompt's row reads past the one-pass kernel's reach, short rows within it.
    assert max(reads) > row_attention.VECTOR_TWO_PASS_ABOVE >= min(reads)


def test_the_model_warm_up_warms_the_split_calls_with_the_models_heads(model, monkeypatch) -> None:
    from mlx_notebook.generation import warm_up

    calls = []
    monkeypatch.setattr(row_attention, "wanted", lambda: True)
    monkeypatch.setattr(row_attention, "warm", lambda *args: calls.append(args))
    monkeypatch.setattr(warm_up.small_attention, "wanted", lambda: False)
    config = {"num_attention_heads": model.args.num_attention_heads}
    warm_up.warm(SimpleNamespace(model=model, config=config, source=SimpleNamespace(key="tiny")))
    kv_heads = model.args.num_key_value_heads
    dim = model.args.hidden_size // model.args.num_attention_heads
    assert calls == [(model.args.num_attention_heads, kv_heads, dim, mx.float32)], calls
