"""``generate_many`` and its ``Batch``: the Python API of a map over inputs.

On the tiny random-weight model (greedy, exact on the CPU), through the
public handles only, so the tests hold whether the worker runs the members
one after another or decodes them together.
"""

from __future__ import annotations

import pytest

import mlx_notebook
from mlx_notebook import Batch, Generation, InvalidArgumentError, ModelNotFoundError, State
from testkit.waiting import other_generation, wait_tokens, wait_until

PROMPTS = ["Tell me about Peru.", "Tell me about Chile.", "Tell me about Spain."]
N = 16
LONG = 400  # these prompts meet no EOS before it on the tiny model


@pytest.fixture(scope="module")
def solo(worker: mlx_notebook.Worker, tiny_model: str) -> list[list[int]]:
    """Each prompt's greedy tokens from a run of its own (one at a time)."""
    tokens = []
    for prompt in PROMPTS:
        gen = mlx_notebook.generate(prompt, model=tiny_model, worker=worker, max_tokens=LONG)
        gen.result(timeout=120)
        tokens.append(gen.tokens)
    assert [len(t) for t in tokens] == [LONG] * len(PROMPTS), "a prompt meets EOS early: pick others"
    return tokens


def many(worker: mlx_notebook.Worker, model: str, prompts: list = PROMPTS, **options) -> Batch:
    options.setdefault("max_tokens", N)
    return mlx_notebook.generate_many(prompts, model=model, worker=worker, **options)


def test_results_equal_the_solo_runs(worker, tiny_model: str, solo: list[list[int]]) -> None:
    batch = many(worker, tiny_model)
    texts = batch.results(timeout=120)
    assert [g.tokens for g in batch] == [t[:N] for t in solo]
    assert texts == batch.texts == [g.text for g in batch]
    assert batch.states == [State.DONE] * 3 and batch.finished
    assert [g.request.prompt for g in batch] == PROMPTS
    assert all(g.request.max_tokens == N and g.request.model == tiny_model for g in batch)


def test_batch_is_a_sequence_of_generations(worker, tiny_model: str) -> None:
    batch = many(worker, tiny_model, max_tokens=2)
    assert batch.wait(timeout=120)
    assert len(batch) == 3 and all(isinstance(g, Generation) for g in batch)
    assert batch[0] is batch.generations[0] and batch[-1] is batch.generations[2]
    assert list(batch[1:]) == batch.generations[1:] and batch[2] in batch
    assert [g.id for g in batch] == sorted(g.id for g in batch)  # prompt order
    assert batch.summary() == "3 generations: 3 done · 6 tokens"
    assert repr(batch) == "<Batch 3 generations: 3 done · 6 tokens>"


def test_cancel_one_member_leaves_the_others(worker, tiny_model: str, solo: list[list[int]]) -> None:
    batch = many(worker, tiny_model, max_tokens=LONG)
    batch[1].cancel()
    assert batch.wait(timeout=120)
    assert batch.states == [State.STOPPED if i == 1 else State.DONE for i in range(3)]
    assert len(batch[1].tokens) < LONG
    assert [batch[0].tokens, batch[2].tokens] == [solo[0], solo[2]]
    assert batch.summary().startswith("3 generations: 1 stopped, 2 done · ")


def test_cancel_all(worker, tiny_model: str) -> None:
    batch = many(worker, tiny_model, max_tokens=LONG)
    wait_tokens(batch[0], 2)
    batch.cancel()
    assert batch.wait(timeout=30)
    assert batch.states == [State.STOPPED] * 3
    assert all(len(g.tokens) < LONG for g in batch)
    assert batch.results(timeout=0) == batch.texts  # partial texts, no error


def test_pause_and_resume_all_give_the_solo_tokens(worker, tiny_model: str, solo: list[list[int]]) -> None:
    batch = many(worker, tiny_model, max_tokens=LONG)
    wait_tokens(batch[0], 2)
    batch.pause()
    wait_until(
        lambda: State.PAUSED in batch.states and not any(s.running for s in batch.states) or batch.finished,
        60,
        "every input paused or queued",
    )
    assert not batch.finished
    # Nothing moves while another generation runs to its end on the same worker.
    held = [g.tokens for g in batch]
    other_generation(worker, tiny_model)
    assert [g.tokens for g in batch] == held and not any(s.running for s in batch.states), batch.states
    batch.resume()
    assert batch.results(timeout=120) == batch.texts
    assert [g.tokens for g in batch] == solo


def test_wait_and_results_time_out(worker, tiny_model: str) -> None:
    batch = many(worker, tiny_model, max_tokens=LONG)
    try:
        assert batch.wait(timeout=0) is False
        with pytest.raises(TimeoutError, match=r"after 0 s: 3 generations: "):
            batch.results(timeout=0)
    finally:
        batch.cancel()
        assert batch.wait(timeout=30)


def test_a_failed_member_fails_alone(worker, tiny_model: str) -> None:
    batch = many(worker, tiny_model, prompts=[[1, 10**9], "Tell me about Peru."], max_tokens=4)
    with pytest.raises(InvalidArgumentError, match="outside the model's vocabulary"):
        batch.results(timeout=120)
    assert batch.states == [State.FAILED, State.DONE]
    assert batch.texts[0] == "" and batch.texts[1]


# -- bad inputs: one line, and nothing queued -----------------------------------------------------


@pytest.mark.parametrize(
    "prompts, options, error, message",
    [
        (
            ["fine", "", "fine"],
            {},
            InvalidArgumentError,
            "prompts[1]: prompt is empty: give some text to generate from",
        ),
        (
            ["fine", b"bytes"],
            {},
            InvalidArgumentError,
            "prompts[1]: prompt must be a string, a list of token ids or a list of messages, got bytes",
        ),
        (["fine", [1, -2]], {}, InvalidArgumentError, "prompts[1]: a token prompt must be a non-empty list"),
        ([], {}, InvalidArgumentError, "prompts is empty: give at least one prompt"),
        ("one prompt", {}, InvalidArgumentError, "prompts must be a list of prompts, got one str; use generate()"),
        (42, {}, InvalidArgumentError, "prompts must be a list of prompts, got int"),
        (["fine"], {"max_tokens": 0}, InvalidArgumentError, "max_tokens must be >= 1, got 0"),
        (["fine"], {"temprature": 1.0}, TypeError, "generate_many() got unknown option 'temprature'"),
        (["fine"], {"model": "no-such-model"}, ModelNotFoundError, "model 'no-such-model' not found"),
    ],
    ids=["empty", "bytes", "negative_token", "no_prompts", "a_string", "not_iterable", "bad_option", "typo", "model"],
)
def test_bad_input_queues_nothing(worker, tiny_model: str, prompts, options, error, message: str) -> None:
    before = len(worker.history)
    options = {"model": tiny_model, **options}
    with pytest.raises(error) as caught:
        mlx_notebook.generate_many(prompts, worker=worker, **options)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    assert len(worker.history) == before


def test_a_shut_down_worker_queues_nothing(tiny_model: str) -> None:
    closed = mlx_notebook.Worker()
    closed.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        mlx_notebook.generate_many(PROMPTS, model=tiny_model, worker=closed)
    assert closed.history == []


def test_prompts_may_be_any_iterable(worker, tiny_model: str) -> None:
    batch = mlx_notebook.generate_many((p for p in PROMPTS[:2]), model=tiny_model, worker=worker, max_tokens=2)
    assert batch.wait(timeout=120) and len(batch) == 2
    assert [g.request.prompt for g in batch] == PROMPTS[:2]
