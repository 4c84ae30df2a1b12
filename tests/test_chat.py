"""Chats on a small random-weight model (fp32, CPU): history, cache reuse, stop, undo, edit, files.

Turn N's prompt is the chat template over the whole history; its tokens must
start with turn N-1's prompt, so the prompt cache serves at least that much,
and the answer must be the one a cold full-history prompt gives.
"""

from __future__ import annotations

import json

import pytest

import mlx_notebook
from mlx_notebook import Chat, ChatBusyError, GenerationRequest, InvalidArgumentError
from mlx_notebook.generation.prompt import prepare_prompt
from testkit.waiting import assert_stays_paused, other_generation, wait_tokens

QUESTIONS = ["Once upon a time", "Tell me about the quick brown fox", "And the lazy dog?"]


def loaded_model(worker, tiny_model):
    return next(m for m in worker.store.loaded() if str(m.source.path) == tiny_model)


def test_three_turns_reuse_the_previous_turns_cache(worker, tiny_model):
    chat = Chat(tiny_model, system="You are terse.", worker=worker, max_tokens=12)
    prompts: list[list[int]] = []
    for turn, question in enumerate(QUESTIONS):
        gen = chat.send(question)
        gen.result(timeout=120)
        assert gen.state == "done"
        assert len(chat.messages) == 2 * (turn + 1)
        assert chat.messages[-2:] == [
            {"role": "user", "content": question},
            {"role": "assistant", "content": gen.text},
        ]
        ids = prepare_prompt(loaded_model(worker, tiny_model), gen.request)  # what the worker fed
        assert gen.stats.prompt_tokens == len(ids)
        if prompts:
            assert ids[: len(prompts[-1])] == prompts[-1], "turn N's prompt must extend turn N-1's"
            # The previous turn's prompt at least (and usually its answer) comes from the cache.
            assert gen.stats.cached_tokens >= len(prompts[-1]) > 0
        prompts.append(ids)
    assert not chat.busy and chat.generation is gen

    # The last answer is the one a cold prompt of the whole history gives.
    worker.prompt_cache_gb = 0
    try:
        cold = mlx_notebook.generate(
            gen.request.prompt, model=tiny_model, system="You are terse.", worker=worker, max_tokens=12
        )
        cold.result(timeout=120)
    finally:
        worker.prompt_cache_gb = 2
    assert cold.stats.cached_tokens == 0
    assert cold.tokens == gen.tokens


def test_undo_and_edit(worker, tiny_model):
    chat = Chat(tiny_model, worker=worker, max_tokens=6)
    for question in QUESTIONS[:2]:
        chat.send(question).result(timeout=120)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2

    dropped = chat.undo()
    assert [m["content"] for m in dropped][0] == QUESTIONS[1]
    assert len(chat.messages) == 2

    chat.edit_last("Steered answer.")  # the assistant's
    chat.edit_last("Edited question", role="user")
    assert chat.messages == [
        {"role": "user", "content": "Edited question"},
        {"role": "assistant", "content": "Steered answer."},
    ]
    gen = chat.send("Next")
    gen.result(timeout=120)
    assert gen.request.prompt[:2] == chat.messages[:2]  # the next turn sees the edits

    chat.messages.clear()  # the history is a plain list
    with pytest.raises(InvalidArgumentError, match="nothing to undo"):
        chat.undo()
    with pytest.raises(InvalidArgumentError, match="no user message to edit"):
        chat.edit_last("x", role="user")


@pytest.mark.parametrize("keep_stopped", [True, False])
def test_stop_mid_turn_keeps_it_marked_or_drops_it(worker, tiny_model, keep_stopped):
    chat = Chat(tiny_model, worker=worker, max_tokens=6, keep_stopped=keep_stopped)
    chat.send(QUESTIONS[0]).result(timeout=120)
    before = [dict(m) for m in chat.messages]

    gen = chat.send(QUESTIONS[1], max_tokens=2000)
    wait_tokens(gen, 3)
    assert chat.busy
    for action in (lambda: chat.send("again"), chat.undo, lambda: chat.edit_last("x"), lambda: chat.save("/tmp/x")):
        with pytest.raises(ChatBusyError, match=f"#{gen.id} is still"):
            action()
    gen.cancel()
    assert gen.wait(60)
    assert gen.state == "stopped" and 0 < len(gen.tokens) < 2000
    if keep_stopped:
        assert chat.messages[:-2] == before
        assert chat.messages[-2:] == [
            {"role": "user", "content": QUESTIONS[1]},
            {"role": "assistant", "content": gen.text, "stopped": True},
        ]
    else:
        assert chat.messages == before

    # The chat goes on; a kept partial answer is part of the next prompt.
    nxt = chat.send(QUESTIONS[2])
    nxt.result(timeout=120)
    assert nxt.state == "done"
    assert ({"role": "assistant", "content": gen.text} in nxt.request.prompt) is keep_stopped


def test_pause_and_resume_a_turn_gives_the_same_answer(worker, tiny_model):
    chats = [Chat(tiny_model, worker=worker, max_tokens=40) for _ in range(2)]
    for chat in chats:
        chat.send(QUESTIONS[0]).result(timeout=120)
    plain = chats[0].send(QUESTIONS[1])
    plain.result(timeout=120)
    assert len(plain.tokens) == 40, "the answer meets EOS early: the pause below needs room"
    paused = chats[1].send(QUESTIONS[1])
    wait_tokens(paused, 3)
    paused.pause()
    assert chats[1].busy
    assert_stays_paused(paused, lambda: other_generation(worker, tiny_model))
    paused.resume()
    paused.result(timeout=120)
    assert paused.tokens == plain.tokens
    assert chats[0].messages == chats[1].messages


def test_save_and_load_give_the_same_next_turn(worker, tiny_model, tmp_path):
    chat = Chat(tiny_model, system="Be brief.", worker=worker, max_tokens=8, temperature=0.0, keep_stopped=False)
    for question in QUESTIONS[:2]:
        chat.send(question).result(timeout=120)
    chat.messages[-1]["stopped"] = True  # metadata survives the round trip
    path = tmp_path / "chat.json"
    chat.save(path)

    again = Chat.load(path, worker=worker)
    assert again.messages == chat.messages
    assert (again.model, again.system, again.keep_stopped, again.options) == (
        tiny_model,
        "Be brief.",
        False,
        {"max_tokens": 8, "temperature": 0.0},
    )
    assert json.loads(path.read_text())["messages"] == chat.messages
    turns = [c.send(QUESTIONS[2]) for c in (chat, again)]
    for gen in turns:
        gen.result(timeout=120)
    assert turns[0].tokens == turns[1].tokens
    assert again.messages == chat.messages


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("not json", "is not a saved chat"),
        ('{"messages": []}', "is not a saved chat"),
        ('{"mlx_notebook_chat": 1, "messages": [{"role": "user"}]}', "message 0 must be an object"),
        ('{"mlx_notebook_chat": 1, "options": {"bogus": 1}, "messages": []}', "unknown chat option 'bogus'"),
        ('{"mlx_notebook_chat": 1, "options": {"max_tokens": 0}, "messages": []}', "max_tokens must be >= 1"),
    ],
)
def test_load_rejects_bad_files_in_one_line(tmp_path, content, fragment):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match=fragment) as info:
        Chat.load(path)
    assert "\n" not in str(info.value)


def test_a_failed_turn_loses_nothing(worker, tiny_model):
    chat = Chat(tiny_model, worker=worker, max_tokens=6)
    chat.send(QUESTIONS[0]).result(timeout=120)
    before = [dict(m) for m in chat.messages]

    # Fails on the worker: longer than the model's context (4096 tokens).
    gen = chat.send(" ".join(f"w{i}" for i in range(3000)))
    gen.wait(120)
    assert gen.state == "failed" and "context" in str(gen.error)
    assert chat.messages == before and not chat.busy

    # Refused before queueing: nothing changes either.
    with pytest.raises(InvalidArgumentError, match="max_tokens must be >= 1"):
        chat.send("hi", max_tokens=0)
    with pytest.raises(InvalidArgumentError, match="the message is empty"):
        chat.send("   ")
    chat.messages.append({"role": "user", "content": 3})  # a bad edit of the history
    with pytest.raises(InvalidArgumentError, match=r"message 2 \(user\) needs a 'content' string"):
        chat.send("hi")
    chat.messages.pop()
    with pytest.raises(mlx_notebook.ModelNotFoundError):
        Chat("/no/such/model.gguf", worker=worker).send("hi")
    assert chat.messages == before

    assert chat.send(QUESTIONS[1]).result(timeout=120) == chat.messages[-1]["content"]


def test_bad_options_and_messages_are_one_line_errors():
    with pytest.raises(TypeError, match="unknown chat option 'bogus'"):
        Chat(bogus=1)
    with pytest.raises(TypeError, match="model and system are set when it is made"):
        Chat().send("hi", system="x")
    with pytest.raises(InvalidArgumentError, match="temperature must be"):
        Chat(temperature=-1)
    bad = [
        ([{"role": "", "content": "x"}], "message 0 needs a 'role' string"),
        ([{"role": "user", "content": "  "}], "every message is empty"),
        ([{"role": "user", "content": "a\udcff"}], "lone surrogate"),
    ]
    for prompt, fragment in bad:
        with pytest.raises(InvalidArgumentError, match=fragment):
            GenerationRequest(prompt).validate()
    with pytest.raises(InvalidArgumentError, match="needs the chat template"):
        GenerationRequest([{"role": "user", "content": "x"}], chat=False).validate()
