"""Structured output (issue 22): schema=, choices=, regex= on real (random-weight) models.

Random weights follow the grammar because the mask forces them to: every test
asserts that the value parses and validates, and the batch's invariants hold
for constrained rows (solo tokens when mixed with unconstrained rows, exact
resume after a pause inside the value, greedy and seeded).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

import mlx_notebook
from mlx_notebook.errors import InvalidArgumentError
from mlx_notebook.generation.constraints import IncompleteOutputError
from mlx_notebook.generation.request import GenerationRequest
from testkit.waiting import assert_stays_paused, other_generation, wait_tokens


class Place(BaseModel):
    city: Literal["Paris", "Lisbon", "Rome"]
    year: int = Field(ge=1000, le=2100)


# Long enough that a pause lands inside the value; bounded, so random weights close it.
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 3, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["tags", "score"],
}
PROMPTS = ["Once upon a time the quick brown fox", "Hi", "Tell me about the sea and the mountains"]
SAMPLED = {"temperature": 0.8, "seed": 5}


def run(worker, model, prompt, **options):
    gen = mlx_notebook.generate(prompt, model=model, worker=worker, **options)
    gen.result(timeout=120)
    return gen


# -- bad inputs: one line, before anything is queued --------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"schema": {"type": "bogus"}}, "invalid schema: Invalid type: bogus"),
        ({"schema": {"type": "array", "uniqueItems": True}}, 'invalid schema: Unimplemented keys: ["uniqueItems"]'),
        ({"schema": "Place"}, "schema must be a JSON Schema dict or a Pydantic model class, got str"),
        ({"choices": []}, "choices is empty"),
        ({"choices": "yes,no"}, "choices must be a list of strings"),
        ({"choices": ["yes", ""]}, "choices must be non-empty strings"),
        ({"regex": "(a|b"}, "invalid regex"),
        ({"regex": "[0-9]+", "choices": ["1"]}, "give one of schema=, choices=, regex=, not choices and regex"),
    ],
)
def test_bad_constraints_are_one_line_errors(options, expected):
    with pytest.raises(InvalidArgumentError) as info:
        GenerationRequest("Hi", **options).validate()
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.unit
def test_a_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(InvalidArgumentError, match=r"pip install 'mlx-notebook\[structured\]'"):
        GenerationRequest("Hi", choices=["a", "b"]).validate()


@pytest.mark.unit
def test_parsed_needs_a_constraint_and_a_finished_value():
    gen = mlx_notebook.Generation(GenerationRequest("Hi"), on_cancel=lambda g: None)
    with pytest.raises(InvalidArgumentError, match="needs schema=, choices= or regex="):
        _ = gen.parsed
    gen = mlx_notebook.Generation(GenerationRequest("Hi", schema=Place), on_cancel=lambda g: None)
    with pytest.raises(IncompleteOutputError, match="has not finished"):
        _ = gen.parsed


# -- one generation -------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_a_pydantic_schema_gives_a_valid_instance(worker, tiny_model, sampling):
    gen = run(worker, tiny_model, "Where and when?", schema=Place, max_tokens=80, **sampling)
    assert gen.stats.finish_reason == "grammar", gen.text
    place = gen.parsed
    assert isinstance(place, Place)
    assert json.loads(gen.text) == place.model_dump()


def test_a_dict_schema_gives_a_dict_that_validates(worker, tiny_model):
    gen = run(worker, tiny_model, "Tags?", schema=TAGS, max_tokens=120, **SAMPLED)
    assert gen.stats.finish_reason == "grammar", gen.text
    jsonschema.validate(gen.parsed, TAGS)
    assert set(gen.parsed) == {"tags", "score"}  # objects are closed: no extra keys


def test_choices_and_regex(worker, tiny_model):
    choices = ["positive", "negative", "not sure"]
    gen = run(worker, tiny_model, "Mood?", choices=choices, max_tokens=40, **SAMPLED)
    assert gen.parsed in choices and gen.text == gen.parsed
    assert gen.stats.finish_reason == "grammar"
    gen = run(worker, tiny_model, "Code?", regex=r"[A-Z]{3}-[0-9]{2}", max_tokens=40)
    assert gen.stats.finish_reason == "grammar"
    assert len(gen.parsed) == 6 and gen.parsed[3] == "-" and gen.parsed[4:].isdigit()


def test_length_and_stop_before_the_value_closes_are_one_line_errors(worker, tiny_model):
    gen = run(worker, tiny_model, "Tags?", schema=TAGS, max_tokens=6)
    assert gen.stats.finish_reason == "length" and gen.text
    with pytest.raises(IncompleteOutputError, match=r"max_tokens \(6\) ran out before the value closed") as info:
        _ = gen.parsed
    assert "\n" not in str(info.value)
    assert gen.text == '{"tags'  # the text stays readable (6 tokens of a char-level vocabulary)
    gen = mlx_notebook.generate("Tags?", model=tiny_model, worker=worker, schema=TAGS, max_tokens=400)
    wait_tokens(gen, 3)
    gen.cancel()
    assert gen.wait(60) and gen.state == "stopped"
    with pytest.raises(IncompleteOutputError, match="was stopped before the value closed"):
        _ = gen.parsed
    assert gen.text


# -- in a batch, paused, resumed ------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_pause_inside_the_value_resumes_exactly(worker, tiny_model, sampling):
    solo = run(worker, tiny_model, PROMPTS[0], schema=TAGS, max_tokens=120, **sampling)
    assert solo.stats.finish_reason == "grammar"
    gen = mlx_notebook.generate(PROMPTS[0], model=tiny_model, worker=worker, schema=TAGS, max_tokens=120, **sampling)
    wait_tokens(gen, 5)
    gen.pause()
    # Another (unconstrained) generation runs on the same worker while it is parked.
    at = assert_stays_paused(gen, lambda: other_generation(worker, tiny_model))
    assert 0 < at < len(solo.tokens), "the pause did not land inside the value"
    gen.resume()
    gen.result(timeout=120)
    assert gen.tokens == solo.tokens
    assert gen.parsed == solo.parsed


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_constrained_and_unconstrained_rows_of_one_batch_give_their_solo_tokens(worker, tiny_model, sampling):
    options = [{"schema": TAGS}, {}, {"choices": ["yes", "no", "maybe later"]}]
    solos = [
        run(worker, tiny_model, p, max_tokens=60, max_batch=1, **o, **sampling).tokens for p, o in zip(PROMPTS, options)
    ]
    worker.prompt_cache_gb = 0  # each row prefills its whole prompt, as its solo run did
    try:
        gens = [
            mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=60, **o, **sampling)
            for p, o in zip(PROMPTS, options)
        ]
        for gen in gens:
            gen.result(timeout=120)
    finally:
        worker.prompt_cache_gb = 2
    assert max(g.stats.batch_size for g in gens) > 1, "the generations never decoded together"
    assert [g.tokens for g in gens] == solos
    jsonschema.validate(gens[0].parsed, TAGS)
    assert gens[2].parsed in ("yes", "no", "maybe later")


def _tokens_or_end(gen, n: int, timeout: float = 60.0) -> None:
    """Until ``gen`` holds ``n`` tokens or ends (the other rows go on while one is paused)."""
    deadline = time.monotonic() + timeout
    while len(gen.tokens) < n and not gen.finished:
        assert time.monotonic() < deadline, f"generation #{gen.id} neither moved nor ended"
        gen.wait(timeout=0.05)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_pause_of_one_constrained_row_in_a_batch_resumes_exactly(worker, tiny_model, sampling):
    """Beside other rows, a constrained row's next forward is built ahead of its mask: a pause gives it back."""
    options = [{"schema": TAGS}, {"choices": ["yes", "no", "maybe later"]}, {}]
    solos = [
        run(worker, tiny_model, p, max_tokens=60, max_batch=1, **o, **sampling).tokens for p, o in zip(PROMPTS, options)
    ]
    worker.prompt_cache_gb = 0
    try:
        gens = [
            mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=60, **o, **sampling)
            for p, o in zip(PROMPTS, options)
        ]
        wait_tokens(gens[0], 4)
        gens[0].pause()
        at = assert_stays_paused(gens[0], lambda: _tokens_or_end(gens[2], len(gens[2].tokens) + 2))
        assert 0 < at < len(solos[0]), "the pause did not land inside the value"
        gens[0].resume()
        for gen in gens:
            gen.result(timeout=120)
    finally:
        worker.prompt_cache_gb = 2
    assert max(g.stats.batch_size for g in gens) > 1, "the generations never decoded together"
    assert [g.tokens for g in gens] == solos


def test_generate_many_with_a_schema_parses_every_row_and_makes_a_table(worker, tiny_model):
    batch = mlx_notebook.generate_many(PROMPTS, model=tiny_model, worker=worker, schema=Place, max_tokens=80, **SAMPLED)
    assert batch.wait(180)
    values = batch.parsed
    assert all(isinstance(v, Place) for v in values)
    table = batch.to_pandas()
    assert list(table.columns) == ["city", "year", "state", "error"]
    assert table["city"].tolist() == [v.city for v in values]
    assert table["state"].tolist() == ["done"] * 3 and table["error"].isna().all()
    short = mlx_notebook.generate_many(PROMPTS[:2], model=tiny_model, worker=worker, schema=Place, max_tokens=3)
    assert short.wait(60)
    with pytest.raises(IncompleteOutputError, match=r"prompts\[0\]: generation #\d+: no value to parse: max_tokens"):
        _ = short.parsed
    rows = short.records()
    assert [r["state"] for r in rows] == ["done", "done"] and all("max_tokens (3)" in r["error"] for r in rows)
    assert list(short.to_pandas().columns) == ["city", "year", "state", "error"]


# -- a real-size vocabulary ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> str:
    from testkit.real_tokenizer import make_real_model

    folder = tmp_path_factory.mktemp("qwen3-structured") / "qwen3"
    return str(make_real_model(folder, arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2))


def test_a_real_size_vocabulary_is_masked_and_resumes_exactly(worker, qwen3_model):
    solo = run(worker, qwen3_model, PROMPTS[0], schema=Place, max_tokens=60, **SAMPLED)
    assert isinstance(solo.parsed, Place), solo.text
    gen = mlx_notebook.generate(PROMPTS[0], model=qwen3_model, worker=worker, schema=Place, max_tokens=60, **SAMPLED)
    wait_tokens(gen, 2)
    gen.pause()
    assert_stays_paused(gen, lambda: other_generation(worker, qwen3_model))
    gen.resume()
    gen.result(timeout=120)
    assert gen.tokens == solo.tokens and gen.parsed == solo.parsed


# -- a reasoning model: the grammar holds the answer, after the reasoning --------------------------


@pytest.fixture(scope="module")
def r1(tmp_path_factory) -> str:
    from testkit.thinking_model import make_thinking_model

    return str(make_thinking_model(tmp_path_factory.mktemp("r1") / "model", template="r1"))


def test_a_reasoning_model_thinks_freely_then_answers_in_the_grammar(worker, r1):
    # r1's template opens the block in the prompt; the budget closes it after 5 tokens.
    options = dict(choices=["yes", "no"], thinking_budget=5, max_tokens=30, **SAMPLED)
    solo = run(worker, r1, PROMPTS[0], **options)
    assert solo.stats.reasoning_tokens == 5 and solo.reasoning.strip()
    assert solo.parsed in ("yes", "no") and solo.text == solo.parsed
    assert solo.stats.finish_reason == "grammar"
    gen = mlx_notebook.generate(PROMPTS[0], model=r1, worker=worker, **options)
    wait_tokens(gen, 3)  # inside the reasoning
    gen.pause()
    assert_stays_paused(gen, lambda: other_generation(worker, r1))
    gen.resume()
    gen.result(timeout=120)
    assert gen.tokens == solo.tokens and gen.parsed == solo.parsed


# -- the notebook's side, without a kernel ---------------------------------------------------------


@pytest.mark.unit
def test_map_over_a_dataframe_reads_its_rows_and_flags_resolve():
    import pandas as pd

    from mlx_notebook.notebook.map_inputs import map_prompts
    from mlx_notebook.notebook.structured import choices_from, schema_from

    df = pd.DataFrame({"a": ["x", "y"], "n": [1, 2]})
    assert map_prompts("{item.a}-{item[n]}", "df", {"df": df}) == ["x-1", "y-2"]
    with pytest.raises(InvalidArgumentError, match="empty DataFrame"):
        map_prompts("{item.a}", "df", {"df": df.iloc[:0]})
    assert schema_from("Place", {"Place": Place}) is Place
    assert schema_from('{"type": "integer"}', {}) == {"type": "integer"}
    with pytest.raises(InvalidArgumentError, match="no variable 'Nope'"):
        schema_from("Nope", {})
    assert choices_from(" yes, no ,maybe", {}) == ["yes", "no", "maybe"]
    assert choices_from("labels", {"labels": ["a", "b"]}) == ["a", "b"]
