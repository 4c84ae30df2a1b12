"""A paused generation and a chat survive a real kernel restart (jupyter_client, the default model).

Issue 23's acceptance on the CPU: pause a generation at token 20,
``%mlxgen_save`` it, restart the kernel the way a frontend does,
``%mlxgen_resume`` it: the full token list equals the uninterrupted run's
(greedy, ``--seed`` sampling, quantized KV). And a 10-turn chat saved with its
KV serves turn 11 from it after the restart: a fraction of the time to first
token of a load without KV, ``cached_tokens`` > 0, the same answer.
"""

from __future__ import annotations

import pytest

from testkit.kernel_helpers import KernelSession, start_kernel

PROMPT = "Write a long story about a dragon and a knight who become friends."
FLAGS = [
    pytest.param("", id="greedy"),
    pytest.param("-t 0.8 --seed 7", id="seeded"),
    pytest.param("--kv-bits 8 --quantized-kv-start 0", id="kv8"),
]


def restart(session: KernelSession, model: str) -> None:
    """Restart the kernel as a frontend does, then load the extension again."""
    old = session.process
    session.km.restart_kernel(now=False)
    assert old.wait(timeout=30) == 0, "the old kernel did not exit cleanly"
    session.wait_ready()
    session.process = session.km.provisioner.process
    for code in ("%load_ext mlx_notebook", f"%config MLXGen.model = {model!r}", "%config MLXGen.format = 'text'"):
        assert session.execute(code).ok, code


def ok(session: KernelSession, code: str, timeout: float = 300.0) -> str:
    reply = session.execute(code, timeout)
    assert reply.ok, (code, reply.content)
    return reply.stream("stdout")


def test_paused_generations_resume_after_a_kernel_restart(model_name: str, tmp_path) -> None:
    """Greedy, seeded and quantized-KV generations paused and saved in one kernel, resumed after one restart."""
    references, paths = {}, {}
    with start_kernel(model_name, text=True) as session:
        for i, flags in enumerate(FLAGS):
            name = flags.id
            paths[name] = tmp_path / f"story-{name}.safetensors"
            ok(session, f"%%mlxgen -n 48 -o ref{i} --wait {flags.values[0]}\n{PROMPT}")
            references[name] = session.eval(f"ref{i}.tokens")
            assert len(references[name]) == 48, name
            ok(session, f"%%mlxgen -n 48 -o gen{i} {flags.values[0]}\n{PROMPT}")
            session.wait_until(lambda i=i: session.eval(f"len(gen{i}.tokens)") >= 20, 120, f"20 tokens ({name})")
            ok(session, f"gen{i}.pause()")
            session.wait_until(lambda i=i: session.eval(f"gen{i}.state") == "paused", 60, f"paused ({name})")
            assert session.eval(f"len(gen{i}.tokens)") < 48, name
            out = ok(session, f"%mlxgen_save {session.eval(f'gen{i}.id')} {paths[name]}")
            assert "saved to" in out, (name, out)
        restart(session, model_name)
        for i, flags in enumerate(FLAGS):
            name = flags.id
            ok(session, f"%mlxgen_resume {paths[name]} -o again{i} --wait")
            assert session.eval(f"again{i}.state") == "done", name
            assert session.eval(f"again{i}.tokens") == references[name], name
            assert session.eval(f"again{i}.stats.cached_tokens") > 0, name


def test_a_chat_saved_with_its_kv_answers_turn_11_from_it_after_a_restart(model_name: str, tmp_path) -> None:
    saved, plain = tmp_path / "chat.safetensors", tmp_path / "chat.json"
    with start_kernel(model_name, text=True) as session:
        ok(
            session,
            "import mlx_notebook\n"
            "chat = mlx_notebook.Chat(max_tokens=24)\n"
            "for i in range(10):\n"
            "    chat.send(f'Give me fact number {i + 1} about rivers, in one sentence.').result(timeout=300)\n"
            f"chat.save({str(saved)!r}, kv=True)\n"
            f"chat.save({str(plain)!r})\n",
            timeout=900,
        )
        ok(session, "turn = chat.send('And one more fact?'); turn.result(timeout=300)")
        answer = session.eval("turn.tokens")

        ttft = {}
        for name, path in (("kv", saved), ("json", plain)):
            restart(session, model_name)
            # The model loaded first: the times compare serving turn 11, not loading SmolLM2.
            ok(session, "import mlx_notebook\nmlx_notebook.load_model()")
            ok(
                session,
                f"chat = mlx_notebook.Chat.load({str(path)!r})\n"
                "turn = chat.send('And one more fact?'); turn.result(timeout=300)",
            )
            assert session.eval("turn.tokens") == answer, name
            ttft[name] = session.eval("turn.stats.ttft_s")
            cached = session.eval("turn.stats.cached_tokens")
            assert (cached > 0) == (name == "kv"), (name, cached)
        print(f"turn 11 TTFT after a restart: {ttft['kv']:.2f} s from the KV file, {ttft['json']:.2f} s from JSON")
        # The acceptance ratio (0.2x) is a benchmark figure (benchmarks/chat_restore.py); a test only
        # asserts that the KV was used, with room for a loaded CI machine.
        assert ttft["kv"] < ttft["json"], ttft
