"""mlx-lm's sampling controls, stop strings and log-probs, on a small random-weight model.

Every option must keep seeded sampling and pause/resume token-exact, alone
and in a batch with other rows, and do what mlx-lm does with it.
"""

from __future__ import annotations

import math

import pytest

import mlx_notebook
from mlx_notebook import InvalidArgumentError
from testkit.waiting import assert_stays_paused, other_generation, wait_tokens

PROMPT = "Once upon a time the quick brown fox"
SAMPLING = {"temperature": 0.9, "seed": 5}
OPTIONS = {
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.05},
    "repetition": {"repetition_penalty": 1.5, "repetition_context": 8},
    "logit_bias": {"logit_bias": {7: 3.0, 11: -5.0}},
    "all": {"top_k": 20, "min_p": 0.02, "top_p": 0.9, "repetition_penalty": 1.2, "logit_bias": {7: 1.0}},
}


def run(worker, model, **kw):
    kw.setdefault("max_tokens", 24)
    return mlx_notebook.generate(PROMPT, model=model, worker=worker, **kw)


def tokens_of(worker, model, **kw):
    gen = run(worker, model, **kw)
    gen.result(timeout=120)
    return gen.tokens


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_seeded_sampling_with_each_option_is_reproducible_and_pause_exact(worker, tiny_model, name):
    options = dict(SAMPLING, **OPTIONS[name])
    ref = tokens_of(worker, tiny_model, **options)
    assert ref == tokens_of(worker, tiny_model, **options)
    assert len(ref) == 24, "the reference meets EOS early: the pause below needs room"
    gen = run(worker, tiny_model, **options)
    wait_tokens(gen, 5)
    gen.pause()
    assert_stays_paused(gen, lambda: other_generation(worker, tiny_model))
    gen.resume()
    gen.result(timeout=120)
    assert gen.tokens == ref
    # In a batch beside other rows (other options, greedy), the same tokens.
    gens = [run(worker, tiny_model, **options), run(worker, tiny_model), run(worker, tiny_model, **SAMPLING)]
    for g in gens:
        g.result(timeout=120)
    assert max(g.stats.batch_size for g in gens) > 1
    assert gens[0].tokens == ref


def test_options_change_the_tokens(worker, tiny_model):
    plain = tokens_of(worker, tiny_model, **SAMPLING)
    assert tokens_of(worker, tiny_model, **SAMPLING, top_k=1) == tokens_of(worker, tiny_model)  # top-1 is greedy
    assert tokens_of(worker, tiny_model, **SAMPLING, repetition_penalty=3.0) != plain


def test_logit_bias_forces_a_token_even_greedy(worker, tiny_model):
    assert set(tokens_of(worker, tiny_model, logit_bias={42: 1e4})) == {42}


def test_repetition_penalty_matches_mlx_lm(worker, tiny_model):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    ours = tokens_of(worker, tiny_model, repetition_penalty=1.8, repetition_context=6, max_tokens=30)
    model, tokenizer = mlx_notebook.load_model(tiny_model, worker=worker)

    def job(store):
        processors = make_logits_processors(repetition_penalty=1.8, repetition_context_size=6)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=30, logits_processors=processors)]

    theirs = worker.call(job)
    eos = set(tokenizer.eos_token_ids)
    assert ours == [t for t in theirs if t not in eos][: len(ours)]


def test_stop_string_ends_the_text_before_it(worker, tiny_model):
    ref = run(worker, tiny_model, max_tokens=40)
    text = ref.result(timeout=120)
    assert len(text) > 20, "the tiny model's reference text is too short to cut"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    gen = run(worker, tiny_model, max_tokens=40, stop=["never-there", stop])
    assert gen.result(timeout=120) == cut
    assert gen.stats.finish_reason == "stop_string"
    # A stop string that never comes: the whole text, nothing held back.
    assert run(worker, tiny_model, max_tokens=40, stop=["\x00\x01"]).result(timeout=120) == text


def test_logprobs_of_each_token_and_the_alternatives(worker, tiny_model):
    gen = run(worker, tiny_model, logprobs=3, max_tokens=12)
    gen.result(timeout=120)
    entries = gen.logprobs
    assert [e.token for e in entries] == gen.tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top) == 3
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        assert e.top[0][0] == e.token  # greedy: the chosen token is the most likely
        assert math.isclose(e.top[0][1], e.logprob, rel_tol=1e-5)
    assert run(worker, tiny_model, max_tokens=4).result(timeout=60) is not None
    plain = run(worker, tiny_model, max_tokens=12)
    plain.result(timeout=60)
    assert plain.logprobs == [] and plain.tokens == gen.tokens


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"min_p": 1.5}, "min_p must be > 0.0 and <= 1.0"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": "###"}, "stop must be a list of strings"),
        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {3: float("nan")}}, "must be a finite number"),
        ({"repetition_penalty": -1}, "repetition_penalty must be > 0.0"),
        ({"logprobs": -2}, "logprobs must be >= 0"),
    ],
)
def test_bad_options_are_one_line_errors(worker, tiny_model, options, message):
    with pytest.raises(InvalidArgumentError, match=message) as err:
        run(worker, tiny_model, **options)
    assert "\n" not in str(err.value)


def test_logit_bias_outside_the_vocabulary_fails_that_generation_only(worker, tiny_model):
    gen = run(worker, tiny_model, logit_bias={10**9: 1.0})
    gen.wait(60)
    assert gen.state == "failed" and "not in the model's vocabulary" in str(gen.error)
    assert run(worker, tiny_model, max_tokens=4).result(timeout=60) is not None
