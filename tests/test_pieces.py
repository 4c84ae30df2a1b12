"""Prefill pieces on a small in-memory llama (no model file): layer groups pause, stop and restore cleanly."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from mlx_notebook.control import Cancelled, CancelToken, Pace
from mlx_notebook.generation.pieces import ChunkRunner, LayerRunner
from mlx_notebook.generation.stats import PrefillPieces

pytestmark = pytest.mark.unit


def tiny_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 32,
            "num_hidden_layers": 6,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": 97,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    )
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def cache_of(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def states(cache) -> list:
    return [mx.array(s) for c in cache for s in c.state]


PROMPT = mx.array([[5, 9, 2, 44, 17, 3, 8, 61, 12, 7, 30, 1]])


def test_layer_groups_fill_the_same_cache_as_one_chunk() -> None:
    model = tiny_llama()
    whole, grouped = cache_of(model), cache_of(model)
    ChunkRunner(model, whole).run(PROMPT)
    pace = Pace(CancelToken(), 1e-6)  # a tiny budget: one layer per group
    runner = LayerRunner(model.model, model, grouped, pace)
    runner.run(PROMPT)
    assert runner.pieces is PrefillPieces.LAYERS and runner.group == 1
    for a, b in zip(states(whole), states(grouped)):
        assert mx.allclose(a, b, atol=1e-5).item()


def test_on_the_cpu_no_group_stays_queued_so_a_chunk_may_take_every_layers_budget() -> None:
    # The CPU's build and compute share the cores: a queued group overlaps little and halved the chunks (a
    # 3,000-token prefill beside two busy loops 0.90x as long with none queued; session 60). A stop then waits
    # for the group it lands in, nothing behind it.
    at_checkpoint: list[int] = []
    runner: LayerRunner

    def between() -> None:
        at_checkpoint.append(len(runner._in_flight))

    model = tiny_llama()
    runner = LayerRunner(model.model, model, cache_of(model), Pace(CancelToken(), 1e-6, between=between))
    assert runner.queued == 0 and runner.chunk_budget_factor == runner.n_layers
    runner.run(PROMPT)
    assert len(at_checkpoint) == runner.n_layers - 1 and set(at_checkpoint) == {0}, at_checkpoint


def test_stop_between_groups_restores_the_layers() -> None:
    model = tiny_llama()
    layers = list(model.model.layers)
    token = CancelToken()
    seen = []

    def on_group() -> None:
        seen.append(1)
        if len(seen) == 2:
            token.cancel()

    pace = Pace(token, 1e-6, on_pause=None)
    runner = LayerRunner(model.model, model, cache_of(model), pace)
    real = runner._hook

    def counting(index, hidden):
        real(index, hidden)
        on_group()

    runner._hook = counting  # type: ignore[method-assign]
    with pytest.raises(Cancelled):
        runner.run(PROMPT)
    assert model.model.layers == layers, "the real layer list must be back after a stop"
    # The model still works and gives what a fresh cache gives.
    again, fresh = cache_of(model), cache_of(model)
    ChunkRunner(model, again).run(PROMPT)
    ChunkRunner(model, fresh).run(PROMPT)
    assert all(mx.array_equal(a, b).item() for a, b in zip(states(again), states(fresh)))


def test_pause_inside_a_chunk_blocks_then_finishes_the_same() -> None:
    model = tiny_llama()
    reference = cache_of(model)
    ChunkRunner(model, reference).run(PROMPT)
    token = CancelToken()
    paused = threading.Event()
    pace = Pace(token, 1e-6, on_pause=paused.set)
    cache = cache_of(model)
    runner = LayerRunner(model.model, model, cache, pace)
    token.pause()
    thread = threading.Thread(target=runner.run, args=(PROMPT,))
    thread.start()
    assert paused.wait(10)
    time.sleep(0.02)
    assert thread.is_alive(), "a pause must hold the forward pass"
    token.resume()
    thread.join(10)
    for a, b in zip(states(reference), states(cache)):
        assert mx.allclose(a, b, atol=1e-5).item()


def test_layers_wrapped_on_one_thread_are_not_seen_on_another() -> None:
    # The prefill thread feeds a joining prompt in layer groups while the worker
    # thread builds decode steps (in marked pieces too): each must see only its own wrappers.
    import mlx.nn as nn

    from mlx_notebook.generation.pieces import MarkedLayers

    owner = nn.Module()
    owner.layers = [nn.Linear(2, 2) for _ in range(4)]
    seen: dict[str, list[str]] = {}
    inside, looked = threading.Event(), threading.Event()

    def other() -> None:
        assert inside.wait(10)
        seen["other"] = [type(layer).__name__ for layer in owner.layers]
        looked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with MarkedLayers(owner, 2):
        seen["this"] = [type(layer).__name__ for layer in owner.layers]
        inside.set()
        assert looked.wait(10)
    thread.join(10)
    assert seen == {"this": ["_CheckpointedLayer"] * 4, "other": ["Linear"] * 4}
    assert [type(layer).__name__ for layer in owner.layers] == ["Linear"] * 4
    assert len(owner.layers) == 4 and isinstance(owner.layers, list)


def test_a_turn_that_comes_while_a_group_finishes_drains_the_next_before_the_checkpoint(monkeypatch) -> None:
    # On the prefill thread the checkpoint may hand the device to the others' step. Whether it does may change
    # while the hook waits for a group to finish: then the group queued behind it is finished too, and the
    # checkpoint hands over with nothing queued (the hook asked once, before the wait, until session 38: the
    # device went over one group later, or with a group still queued).
    from mlx_notebook.generation import pieces

    model = tiny_llama()
    waits = [0]
    real_eval = pieces.mx.eval

    def counting_eval(*args):
        waits[0] += 1
        return real_eval(*args)

    monkeypatch.setattr(pieces.mx, "eval", counting_eval)
    at_checkpoint: list[tuple[bool, int]] = []
    runner: LayerRunner

    def shared() -> bool:
        return waits[0] > 0  # due once a group was waited for since the last checkpoint

    def between() -> None:
        at_checkpoint.append((shared(), len(runner._in_flight)))
        waits[0] = 0

    pace = Pace(CancelToken(), 1e-6, between=between, shared=shared)  # one layer per group
    runner = LayerRunner(model.model, model, cache_of(model), pace)
    runner.queued = 1  # a group queued behind the one waited on, as on a GPU (where the prefill thread runs)
    runner.run(PROMPT)
    assert len(at_checkpoint) >= 3, at_checkpoint
    # A group with one queued before it waits for that one, which makes the turn due: it is drained too. After a
    # drain the next group has nothing to wait for and stays queued (not due).
    assert at_checkpoint[0] == (False, 1)
    assert all(c == ((True, 0) if i % 2 else (False, 1)) for i, c in enumerate(at_checkpoint)), at_checkpoint
