"""Reasoning models in a real ipykernel: the flags, the Thinking pane's states, Stop and Pause, a chat.

A ``python3`` kernel started by jupyter_client runs ``%%mlxgen`` and
``%%mlxchat`` on random-weight thinking models (testkit.thinking_model); the
widgets are read from their comm messages and driven with the messages
ipywidgets' frontend sends (button clicks, the accordion's ``selected_index``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from testkit.kernel_helpers import (
    KernelSession,
    Reply,
    displays,
    one_line_usage_error,
    start_kernel,
    view,
    wait_state,
)
from testkit.thinking_model import make_thinking_model, think_ids

FINAL = ("stopped", "done", "failed")
BUDGET = 20

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("thinking")
    return {t: str(make_thinking_model(root / t, template=t)) for t in ("r1", "qwen3")}


@pytest.fixture(scope="module")
def kernel(models: dict[str, str]):
    _, end = think_ids(Path(models["r1"]))
    setup = [
        f"R1, QWEN3 = {models['r1']!r}, {models['qwen3']!r}",
        # Random weights neither close the block nor end by themselves: the budget closes it.
        f"bias = {{{end}: -100.0, 2: -100.0}}",
    ]
    with start_kernel(models["r1"], text=True, setup=setup) as session:
        yield session


def run(kernel: KernelSession, flags: str, prompt: str = "Once upon a time") -> Reply:
    reply = kernel.execute(f"%%mlxgen --logit-bias bias {flags}\n{prompt}", timeout=300)
    assert reply.ok, reply.content
    return reply


def pane(kernel: KernelSession, cell: str) -> dict[str, Any]:
    """The Thinking pane of cell ``cell``: its accordion's comm id, title, fold state, and the reasoning shown."""
    # The pane's widgets are made when the reasoning starts, under whatever request the kernel runs
    # then (comm messages carry the kernel's parent, not the thread's): found from the cell's box.
    mine = kernel.widgets(cell)
    ((box, _),) = [(cid, s) for cid, s in mine.items() if "mlxgen-thinking-box" in s.get("_dom_classes", ())]
    states = kernel.widgets()
    children = mine[box].get("children", ())
    if not children:
        return {}
    comm_id = children[0].removeprefix("IPY_MODEL_")
    state = states[comm_id]
    (child,) = state["children"]
    outputs = states[child.removeprefix("IPY_MODEL_")].get("outputs", ())
    return {
        "comm_id": comm_id,
        "title": (state.get("titles") or ("",))[0],
        "open": state.get("selected_index") == 0,
        "text": "".join(o["data"]["text/plain"] for o in outputs),
    }


def test_flags_reach_the_request_and_the_pane_folds_when_the_answer_starts(kernel: KernelSession) -> None:
    reply = run(kernel, "--thinking-budget 3 -n 10 --wait -o g --template-arg style=terse")
    assert kernel.eval("(g.stats.reasoning_tokens, g.request.thinking_budget, g.request.chat_template_kwargs)") == (
        3,
        3,
        {"style": "terse"},
    )
    shown, answer, reasoning = pane(kernel, reply.msg_id), kernel.eval("g.text"), kernel.eval("g.reasoning")
    assert shown["text"] == reasoning.strip() and not shown["open"]
    assert re.fullmatch(r"Thought for 3 tokens, \d+\.\d s", shown["title"]), shown["title"]
    assert view(kernel, reply.msg_id)["text"] == answer
    assert "3 thinking" in view(kernel, reply.msg_id)["status"]

    off = run(kernel, "-m {QWEN3} --thinking off -n 4 --wait -o q_off")
    default = run(kernel, "-m {QWEN3} -n 4 --wait -o q_default")
    assert off.ok and default.ok
    assert kernel.eval("(q_off.request.thinking, q_default.request.thinking)") == (False, None)
    assert kernel.eval("q_off.stats.prompt_tokens > q_default.stats.prompt_tokens")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ("--thinking maybe", "give on or off, got 'maybe'"),
        ("--thinking-budget -1", "thinking_budget must be >= 0"),
        ("--template-arg enable_thinking", "give KEY=VALUE"),
        ("--template-arg tokenize=1", "cannot set 'tokenize'"),
    ],
)
def test_bad_reasoning_flags_are_one_line_errors(kernel: KernelSession, flags: str, fragment: str) -> None:
    before = kernel.eval("len(__import__('mlx_notebook').default_worker().history)")
    err = one_line_usage_error(kernel.execute(f"%%mlxgen {flags}\nHi"))
    assert fragment in err, err
    assert kernel.eval("len(__import__('mlx_notebook').default_worker().history)") == before  # nothing queued


def test_the_pane_streams_pauses_and_stops_inside_the_reasoning(kernel: KernelSession) -> None:
    reply = run(kernel, "-n 400 -o t --format markdown")
    kernel.wait_until(lambda: len(pane(kernel, reply.msg_id).get("text", "")) > 10, 120, "reasoning in the pane")
    live = pane(kernel, reply.msg_id)
    assert live["open"] and live["title"].startswith("Thinking…"), live
    assert view(kernel, reply.msg_id).get("text", "") == ""  # nothing in the answer yet
    kernel.click(view(kernel, reply.msg_id)["pause"][0])
    assert wait_state(kernel, reply.msg_id, ("paused",), timeout=30) == "paused"
    assert kernel.eval("(t.state, t.thinking)") == ("paused", True)
    kernel.click(view(kernel, reply.msg_id)["pause"][0])  # Resume
    tokens = kernel.eval("len(t.tokens)")
    kernel.wait_until(lambda: kernel.eval("len(t.tokens)") > tokens + 2, 60, "tokens after resume")
    kernel.click(view(kernel, reply.msg_id)["stop"][0])
    assert wait_state(kernel, reply.msg_id, FINAL, timeout=30) == "stopped"
    kernel.wait_until(lambda: "text/markdown" in displays(kernel, reply.msg_id)[-1]["data"], 10, "the saved output")
    saved = displays(kernel, reply.msg_id)[-1]["data"]
    # Saved: the reasoning folded in <details>, said to have stopped; no answer came.
    assert saved["text/markdown"].startswith('<details class="mlxgen-thinking"><summary>Stopped while thinking · ')
    assert "*(stopped while thinking)*" in saved["text/markdown"]
    assert saved["text/plain"].startswith("[thought for ")


def test_pause_at_the_boundary_resumes_exactly(kernel: KernelSession) -> None:
    run(kernel, f"--thinking-budget {BUDGET} -n 600 --wait -o ref")
    reply = run(kernel, f"--thinking-budget {BUDGET} -n 600 -o b")
    kernel.wait_until(lambda: kernel.eval("len(b.tokens)") >= BUDGET - 1, 120, "the boundary")
    kernel.click(view(kernel, reply.msg_id)["pause"][0])
    assert wait_state(kernel, reply.msg_id, ("paused",), timeout=30) == "paused"
    paused_at = kernel.eval("len(b.tokens)")
    kernel.click(view(kernel, reply.msg_id)["pause"][0])
    assert wait_state(kernel, reply.msg_id, FINAL, timeout=120) == "done"
    assert kernel.eval("(b.tokens == ref.tokens, b.reasoning == ref.reasoning, b.text == ref.text)") == (
        True,
        True,
        True,
    ), f"paused at token {paused_at}"


def test_stop_at_the_boundary_keeps_both_channels(kernel: KernelSession) -> None:
    reply = run(kernel, f"--thinking-budget {BUDGET} -n 400 -o s")
    kernel.wait_until(lambda: kernel.eval("len(s.tokens)") >= BUDGET, 120, "the boundary")
    kernel.click(view(kernel, reply.msg_id)["stop"][0])
    assert wait_state(kernel, reply.msg_id, FINAL, timeout=30) == "stopped"
    reasoning_tokens, reasoning = kernel.eval("(s.stats.reasoning_tokens, s.reasoning)")
    assert reasoning_tokens == BUDGET and reasoning
    assert pane(kernel, reply.msg_id)["text"] == reasoning.strip()


def test_a_click_unfolds_the_pane_and_it_stays_open(kernel: KernelSession) -> None:
    reply = run(kernel, "--thinking-budget 3 -n 300 -o u")
    kernel.wait_until(lambda: kernel.eval("len(u.text)") > 0, 120, "the answer starts")
    kernel.wait_until(lambda: not pane(kernel, reply.msg_id).get("open", True), 30, "the pane folds")
    comm_id = pane(kernel, reply.msg_id)["comm_id"]
    clicked_at = len(kernel.messages)
    kernel.send_comm(comm_id, {"method": "update", "state": {"selected_index": 0}, "buffer_paths": []})
    kernel.wait_until(lambda: kernel.eval("u.state") in FINAL, 300, "the end")
    # The frontend holds the unfolded state; the kernel never sent a fold again (nor anything else on it).
    refolds = [
        m
        for m in kernel.messages[clicked_at:]
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and m["content"]["data"].get("method") == "update"  # not ipywidgets' echo of the click
        and "selected_index" in m["content"]["data"].get("state", {})
    ]
    assert refolds == []
    assert pane(kernel, reply.msg_id)["title"].startswith("Thought for 3 tokens")


def test_headless_text_prints_one_line_unless_asked(kernel: KernelSession) -> None:
    plain = run(kernel, "--thinking-budget 3 -n 8 --wait --plain -o h")
    text = displays(kernel, plain.msg_id)[-1]["data"]["text/plain"]
    assert re.match(r"\[thought for 3 tokens, \d+\.\d s\]\n\n", text), text
    assert kernel.eval("h.reasoning.strip()") not in text
    full = run(kernel, "--thinking-budget 3 -n 8 --wait --plain --show-thinking -o h2")
    text = displays(kernel, full.msg_id)[-1]["data"]["text/plain"]
    assert kernel.eval("h2.reasoning.strip()") in text


def test_a_chat_keeps_each_turns_reasoning_and_the_cache_serves_the_next(kernel: KernelSession) -> None:
    for text in ("Name a river.", "How long is it?"):
        reply = kernel.execute(f"%%mlxchat c --thinking-budget 3 --logit-bias bias -n 8 --wait\n{text}", timeout=300)
        assert reply.ok, reply.content
        assert kernel.eval(
            "c.messages[-1] == dict(role='assistant', content=c.generation.text, reasoning=c.generation.reasoning)"
        )
    assert kernel.eval("(len(c.messages), c.generation.stats.cached_tokens > 0)") == (4, True)
    assert kernel.eval("c.generation.request.thinking_budget") == 3  # the cell's flag, for its turn
