"""Reasoning models: the switch, the reasoning channel, the thinking budget, a chat's history.

Random-weight models whose tokenizers have ``<think>``/``</think>`` as special
tokens and chat templates with the real ones' semantics (testkit.thinking_model):
``r1`` opens the block in the generation prompt, ``qwen3`` honours
``enable_thinking=False`` with an empty block. Random weights neither think
nor stop thinking by themselves: a logit bias keeps the end tag (and EOS) away
and ``thinking_budget`` closes the block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import mlx_notebook
from mlx_notebook import InvalidArgumentError
from mlx_notebook.generation.reasoning import TextChannels, ThinkingBudget, ThinkTags, TokenChannels
from testkit.thinking_model import make_thinking_model, think_ids
from testkit.waiting import assert_stays_paused, held, other_generation, wait_until

PROMPT = "Once upon a time the quick brown fox"
BUDGET = 5
TAGS = ThinkTags("<think>", "</think>", (3,), (4,))


@pytest.fixture(scope="module")
def r1(tmp_path_factory) -> str:
    return str(make_thinking_model(tmp_path_factory.mktemp("r1") / "model", template="r1"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return str(make_thinking_model(tmp_path_factory.mktemp("qwen3") / "model", template="qwen3"))


def no_natural_end(model: str) -> dict[int, float]:
    """A logit bias that keeps the model from closing the block or ending by itself."""
    _, end = think_ids(Path(model))
    return {end: -100.0, 2: -100.0}  # 2: <|im_end|>, the EOS


def run(worker: Any, model: str, **kw: Any) -> mlx_notebook.Generation:
    kw.setdefault("max_tokens", 16)
    kw.setdefault("logit_bias", no_natural_end(model))
    return mlx_notebook.generate(PROMPT, model=model, worker=worker, **kw)


def done(gen: mlx_notebook.Generation) -> mlx_notebook.Generation:
    gen.result(timeout=120)
    return gen


def close_ids(gen: mlx_notebook.Generation) -> list[int]:
    tok = gen.tokenizer
    return [tok.think_end_tokens[0], *tok.encode("\n\n", add_special_tokens=False)]


# -- the channels, token by token -------------------------------------------------------------


def test_text_channels_split_on_tags_split_across_pieces():
    channels = TextChannels(TAGS, reasoning=False)
    pieces = ["Hi <th", "ink>\nLet me", " see.</thi", "nk>\n\nThe answer", " <b>"]
    out = [channels.split(p) for p in pieces] + [channels.flush()]
    assert "".join(r for r, _ in out) == "Let me see."
    assert "".join(a for _, a in out) == "Hi The answer <b>"


def test_token_channels_count_what_is_between_the_tags():
    channels = TokenChannels(TAGS, reasoning=True)  # the prompt opened the block
    assert [channels.feed(t) for t in (10, 11, 4, 12, 3, 13, 4)] == [True, True, False, False, False, True, False]


def test_budget_state_is_a_function_of_the_tokens():
    generated: list[int] = []
    budget = ThinkingBudget(2, TAGS, [4, 9], prompt=[1, 3], generated=generated)
    for token in (20, 21):  # two reasoning tokens: the close is due
        generated.append(token)
    assert budget.state_after(2).mode == "closing"
    generated.extend([4, 9])
    assert budget.state_after(4).mode == "answer"
    # A fresh processor over the same tokens (a resumed row) is in the same state.
    again = ThinkingBudget(2, TAGS, [4, 9], prompt=[1, 3], generated=list(generated))
    assert again.state_after(4) == budget.state_after(4)
    assert again.state_after(1) == ThinkingBudget(2, TAGS, [4, 9], [1, 3], generated[:1]).state_after(1)


# -- generation --------------------------------------------------------------------------------


def test_the_budget_closes_the_block_and_the_answer_is_apart(worker, r1):
    gen = done(run(worker, r1, thinking_budget=BUDGET))
    close = close_ids(gen)
    assert gen.stats.reasoning_tokens == BUDGET
    assert gen.tokens[BUDGET : BUDGET + len(close)] == close
    assert gen.reasoning.strip() and gen.text.strip()
    for tag in ("<think>", "</think>"):
        assert tag not in gen.text
    tok = gen.tokenizer
    answer = tok.decode(gen.tokens[BUDGET + len(close) :])
    assert gen.text == answer.lstrip()
    assert gen.stats.reasoning_s is not None and gen.stats.reasoning_s >= 0


def test_budget_zero_answers_at_once(worker, r1):
    gen = done(run(worker, r1, thinking_budget=0, max_tokens=8))
    assert gen.tokens[: len(close_ids(gen))] == close_ids(gen)
    assert (gen.reasoning, gen.stats.reasoning_tokens) == ("", 0)
    assert gen.text


def test_without_a_budget_everything_after_the_open_block_is_reasoning(worker, r1):
    gen = done(run(worker, r1, max_tokens=10))
    assert (gen.text, gen.stats.reasoning_tokens) == ("", 10)
    assert gen.thinking is False  # ended: no longer thinking


def test_thinking_off_renders_an_empty_block(worker, qwen3):
    default = done(run(worker, qwen3, max_tokens=4))
    off = done(run(worker, qwen3, max_tokens=4, thinking=False))
    via_kwargs = done(run(worker, qwen3, max_tokens=4, chat_template_kwargs={"enable_thinking": False}))
    # The prompt closes the block itself; nothing is reasoning.
    block = off.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert off.stats.prompt_tokens == default.stats.prompt_tokens + len(block)
    assert via_kwargs.tokens == off.tokens
    assert (off.reasoning, off.stats.reasoning_tokens) == ("", 0)


def test_stop_strings_read_the_answer_only(worker, r1):
    ref = done(run(worker, r1, thinking_budget=BUDGET))
    in_reasoning = next(ref.reasoning[i : i + 3] for i in range(len(ref.reasoning)) if ref.reasoning[i : i + 3].strip())
    assert in_reasoning not in ref.text, "pick a stop string found in the reasoning only"
    passed = done(run(worker, r1, thinking_budget=BUDGET, stop=[in_reasoning]))
    assert passed.tokens == ref.tokens and passed.stats.finish_reason != "stop_string"
    cut_at = ref.text[2:5]
    cut = done(run(worker, r1, thinking_budget=BUDGET, stop=[cut_at]))
    assert cut.stats.finish_reason == "stop_string"
    assert cut.reasoning == ref.reasoning and cut.text == ref.text[: ref.text.index(cut_at)]


def test_logprobs_are_marked_reasoning_or_answer(worker, r1):
    gen = done(run(worker, r1, thinking_budget=BUDGET, logprobs=2))
    marks = [entry.reasoning for entry in gen.logprobs]
    assert marks[:BUDGET] == [True] * BUDGET and not any(marks[BUDGET:])
    assert all(entry.logprob == 0.0 for entry in gen.logprobs[BUDGET : BUDGET + len(close_ids(gen))])  # forced


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 3}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("at", [2, BUDGET - 1, BUDGET, BUDGET + 1, BUDGET + 2])
def test_pause_and_resume_are_exact_across_the_boundary(worker, r1, sampling, at):
    ref = done(run(worker, r1, thinking_budget=BUDGET, **sampling))

    def pause_at(event: Any) -> None:
        if event.kind == "tokens" and len(gen.tokens) == at:
            gen.pause()

    with held(worker):  # the listener is on before the first token
        gen = run(worker, r1, thinking_budget=BUDGET, **sampling)
        gen.add_listener(pause_at)
    wait_until(lambda: gen.state == "paused" or gen.finished, what=f"a pause near token {at}")
    assert gen.state == "paused", gen
    assert_stays_paused(gen, lambda: other_generation(worker, r1))
    gen.resume()
    done(gen)
    assert gen.tokens == ref.tokens
    assert (gen.reasoning, gen.text) == (ref.reasoning, ref.text)


def test_rows_of_a_batch_keep_their_own_budgets(worker, r1):
    solo = {b: done(run(worker, r1, thinking_budget=b)).tokens for b in (2, 6)}
    plain = done(run(worker, r1)).tokens
    gens = [run(worker, r1, thinking_budget=2), run(worker, r1), run(worker, r1, thinking_budget=6)]
    for gen in gens:
        done(gen)
    assert max(g.stats.batch_size for g in gens) > 1
    assert [g.tokens for g in gens] == [solo[2], plain, solo[6]]


def test_bad_reasoning_options_are_one_line_errors(worker, r1):
    for options, message in (
        ({"thinking": "maybe"}, "thinking must be True, False or None"),
        ({"thinking_budget": -1}, "thinking_budget must be >= 0"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "cannot set 'add_generation_prompt'"),
    ):
        with pytest.raises(InvalidArgumentError, match=message) as err:
            run(worker, r1, **options)
        assert "\n" not in str(err.value)


# -- conversations -------------------------------------------------------------------------------


def test_a_chat_keeps_the_reasoning_apart_and_does_not_send_it_back(worker, r1):
    chat = mlx_notebook.Chat(r1, worker=worker, max_tokens=12, thinking_budget=3, logit_bias=no_natural_end(r1))
    first = done(chat.send("Name a river."))
    answer = chat.messages[-1]
    assert answer == {"role": "assistant", "content": first.text, "reasoning": first.reasoning}
    second = done(chat.send("How long is it?"))
    # The r1 template does not read reasoning_content: the prompt holds the answer only.
    sent = second.request.prompt[1]
    assert sent["reasoning"] == first.reasoning  # the history keeps it...
    tok = second.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in second.request.prompt],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert second.stats.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))  # ...not the prompt
    assert second.stats.cached_tokens > 0


def test_a_template_that_reads_reasoning_content_gets_it(worker, qwen3, tmp_path):
    chat = mlx_notebook.Chat(qwen3, worker=worker, max_tokens=2)
    chat.messages = [
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": "The Loire.", "reasoning": "France has several rivers."},
    ]
    with_reasoning = done(chat.send("How long is it?"))
    chat.undo()
    chat.messages[-1].pop("reasoning")
    without = done(chat.send("How long is it?"))
    tok = with_reasoning.tokenizer
    extra = tok.encode("<think>\nFrance has several rivers.\n</think>\n\n", add_special_tokens=False)
    assert with_reasoning.stats.prompt_tokens == without.stats.prompt_tokens + len(extra)
    path = tmp_path / "chat.json"
    chat.messages[-1]["reasoning"] = "kept"
    chat.save(path)
    assert mlx_notebook.Chat.load(path, worker=worker).messages == chat.messages


def test_the_logprobs_view_dims_reasoning_rows_and_hovers_the_answer(worker, r1):
    import html as html_lib
    import re

    from mlx_notebook.notebook.logprobs_view import LogprobsTable

    gen = done(run(worker, r1, thinking_budget=BUDGET, logprobs=2))
    table = LogprobsTable(gen)
    assert table.html(final=True).count("mlxgen-reasoning-row") == BUDGET
    assert table.answer_entries() == gen.logprobs[BUDGET + len(close_ids(gen)) :]
    hover = table.hover(gen.text)
    assert 'class="mlxgen-token"' in hover  # spans from the answer's first token on
    assert html_lib.unescape(re.sub(r"<[^>]+>", "", hover)) == gen.text
