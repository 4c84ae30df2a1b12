"""The notebook surface in-process: interpolation, magics, config, views, interrupts.

Fast tests on the tiny random-weight model in an in-process IPython shell
(no kernel; tests/test_kernel.py covers the kernel). Widgets are real
ipywidgets objects clicked through their own ``click()`` dispatcher.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp
from traitlets import TraitError

import mlx_notebook
from mlx_notebook.generation.request import DEFAULT_MAX_BATCH
from mlx_notebook.notebook.extension import load, loaded_magics, unload
from mlx_notebook.notebook.interpolate import UnknownVariableError, interpolate, placeholders
from mlx_notebook.notebook.job_magics import JobMagics
from mlx_notebook.notebook.kernel_hooks import shutdown_worker, wait_for
from mlx_notebook.notebook.magics import MLXGen
from mlx_notebook.notebook.widget import (
    DisplayRouter,
    TerminalView,
    WidgetView,
    choose_ui,
    plain_text,
    status_line,
)
from testkit.waiting import assert_stays_paused, other_generation, wait_state, wait_tokens, wait_until

PROMPT = "Once upon a time the quick brown fox"


@pytest.fixture(scope="module")
def ip() -> Any:
    # Through the module: its first call starts the shell and replaces the module's get_ipython;
    # a name imported before that (at collection) keeps the starter, which returns None once started.
    return globalipapp.get_ipython()


@pytest.fixture()
def magics(ip: Any, worker: mlx_notebook.Worker, tiny_model: str) -> Iterator[MLXGen]:
    """MLXGen (and the job magics on its worker) on the test worker and the tiny model, registered in the shell."""
    m = MLXGen(shell=ip, worker=worker)
    m.model = tiny_model
    jobs = JobMagics(ip, m)
    for registered in (m, jobs):
        ip.register_magics(registered)
    yield m
    for registered in (m, jobs):
        ip.magics_manager.registry.pop(type(registered).__name__, None)
        for kind, names in registered.magics.items():
            for name in names:
                ip.magics_manager.magics[kind].pop(name, None)
    if m in ip.configurables:
        ip.configurables.remove(m)


def generate(worker: mlx_notebook.Worker, model: str, **kw: Any) -> mlx_notebook.Generation:
    kw.setdefault("max_tokens", 40)
    return mlx_notebook.generate(PROMPT, model=model, worker=worker, **kw)


# -- interpolation --------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "template, expected",
    [
        ("About {topic}.", "About rivers."),
        ("{doc.title} by {doc.author.name}", "Danube by Ada"),
        ("{{topic}} stays", "{topic} stays"),
        ('JSON {"a": {"b": 1}} stays', 'JSON {"a": {"b": 1}} stays'),
        ("{x: 1 for x in y} and {} and { topic }", "{x: 1 for x in y} and {} and { topic }"),
        ("f'{topic}' and {n}", "f'rivers' and 3"),
        ("{{ jinja }} and }} and {{", "{{ jinja }} and }} and {{"),
        ("no braces", "no braces"),
    ],
)
def test_interpolate(template: str, expected: str) -> None:
    doc = SimpleNamespace(title="Danube", author=SimpleNamespace(name="Ada"))
    assert interpolate(template, {"topic": "rivers", "doc": doc, "n": 3}) == expected


@pytest.mark.unit
def test_unknown_variable_is_a_clear_error() -> None:
    with pytest.raises(UnknownVariableError) as err:
        interpolate("Tell me about {nme}.", {"name": 1})
    assert str(err.value) == ("unknown variable {nme} in the prompt; define it or write {{nme}} for literal braces")
    with pytest.raises(mlx_notebook.InvalidArgumentError, match=r"\{n\.nope\}.*no attribute 'nope'"):
        interpolate("{n.nope}", {"n": 3})
    assert placeholders("{a} {{b}} {c.d} {1}") == ["a", "c.d"]


# -- the magics in a shell ---------------------------------------------------------------------


def test_cell_magic_generates_and_binds_out(ip: Any, magics: MLXGen, capsys: Any) -> None:
    ip.user_ns["topic"] = "foxes"
    result = ip.run_cell("%%mlxgen -n 8 --wait -o g --seed 1 -t 0.5\nTell me about {topic}.")
    assert result.success
    gen = ip.user_ns["g"]
    assert gen.state == "done" and gen.request.prompt == "Tell me about foxes."
    assert (gen.request.max_tokens, gen.request.temperature, gen.request.seed) == (8, 0.5, 1)
    out = capsys.readouterr().out
    assert gen.text in out and f"[mlxgen #{gen.id} done" in out  # terminal view printed it


def test_top_p_flag_samples_as_the_api_does(
    ip: Any, magics: MLXGen, worker: mlx_notebook.Worker, tiny_model: str
) -> None:
    result = ip.run_cell(f"%%mlxgen -n 16 --wait -o nucleus -t 0.9 --seed 5 --top-p 0.5\n{PROMPT}")
    assert result.success
    gen = ip.user_ns["nucleus"]
    assert gen.state == "done" and gen.request.top_p == 0.5
    same = generate(worker, tiny_model, max_tokens=16, temperature=0.9, seed=5, top_p=0.5)
    wide = generate(worker, tiny_model, max_tokens=16, temperature=0.9, seed=5)
    same.result(60), wide.result(60)
    assert gen.tokens == same.tokens
    assert gen.tokens != wide.tokens, "top-p 0.5 changed nothing: the test would pass without the flag"


def test_options_are_split_as_a_shell_does(ip: Any, magics: MLXGen) -> None:
    ip.run_cell(f"%%mlxgen -n 2 --wait -o quoted -s 'Be terse, please' --stop \"a b\" --stop ''\n{PROMPT}")
    # The empty stop string is refused: nothing ran.
    assert "quoted" not in ip.user_ns
    ip.run_cell(f"%%mlxgen -n 2 --wait -o quoted -s 'Be terse, please' --stop \"a b\"\n{PROMPT}")
    gen = ip.user_ns["quoted"]
    assert (gen.request.system, gen.request.stop) == ("Be terse, please", ["a b"])
    with pytest.raises(UsageError, match="no closing quotation in the magic's options"):
        ip.run_cell_magic("mlxgen", "-s 'unclosed", PROMPT)


def test_config_traits_are_defaults_and_validated(ip: Any, magics: MLXGen) -> None:
    magics.max_tokens = 3
    magics.system = "Be brief."
    assert ip.run_cell("%%mlxgen --wait --raw -o g\nHello").success
    gen = ip.user_ns["g"]
    assert gen.request.max_tokens == 3 and gen.request.system == "Be brief." and not gen.request.chat
    for name, value in [("max_tokens", 0), ("temperature", -1.0), ("stop_budget", 0.0), ("throttle", -1.0)]:
        with pytest.raises(TraitError, match=name):
            setattr(magics, name, value)
    assert MLXGen.class_traits(config=True).keys() >= {
        "model",
        "max_tokens",
        "temperature",
        "system",
        "stop_budget",
        "wait",
        "throttle",
        "ui",
    }


@pytest.mark.parametrize(
    "cell, fragment",
    [
        ("%%mlxgen --nope\nhi", "unrecognized arguments"),
        ("%%mlxgen -n x\nhi", "invalid int value"),
        ("%%mlxgen\n{undefined_name}", "unknown variable {undefined_name}"),
        ("%%mlxgen -m /no/such.gguf\nhi", "not found"),
        ("%%mlxgen --budget 0\nhi", "stop_budget must be"),
        ("%%mlxgen -o for\nhi", "--out needs a Python variable name"),
    ],
)
def test_bad_input_raises_one_usage_error(ip: Any, magics: MLXGen, cell: str, fragment: str) -> None:
    with pytest.raises(UsageError) as err:
        ip.run_cell_magic("mlxgen", *cell[len("%%mlxgen") :].split("\n", 1))
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("mlxgen: ")


def test_line_magics(ip: Any, magics: MLXGen, worker: mlx_notebook.Worker, capsys: Any) -> None:
    # One at a time, so that the second waits in the queue rather than joining the first's batch.
    ip.run_line_magic("config", "MLXGen.max_batch = 1")
    ip.run_cell(f"%%mlxgen -n 3000 -o long\n{PROMPT}")
    ip.run_cell(f"%%mlxgen -n 5 -o queued\n{PROMPT}")
    ip.run_line_magic("config", f"MLXGen.max_batch = {DEFAULT_MAX_BATCH}")
    long, queued = ip.user_ns["long"], ip.user_ns["queued"]
    wait_state(long, "decoding")
    capsys.readouterr()
    ip.run_line_magic("mlxgen_jobs", "")
    jobs = capsys.readouterr().out
    assert f"#{long.id}" in jobs and "decoding" in jobs and "queued" in jobs
    ip.run_line_magic("mlxgen_stop", str(queued.id))
    assert queued.wait(5) and queued.state == "stopped"
    ip.run_line_magic("mlxgen_stop", "all")
    assert long.wait(10) and long.state == "stopped"
    assert "stopping" in capsys.readouterr().out
    ip.run_line_magic("mlxgen_models", "")
    listing = capsys.readouterr().out
    assert "MB" in listing and "prompt cache" in listing
    with pytest.raises(UsageError, match="no generation #123456"):
        ip.run_line_magic("mlxgen_stop", "123456")


def test_extension_load_unload_is_idempotent(ip: Any) -> None:
    load(ip)
    magics = loaded_magics(ip)
    assert magics is not None and magics.hooks.installed
    assert load(ip) is magics  # a second load changes nothing
    assert sum(isinstance(c, MLXGen) for c in ip.configurables) == 1
    assert ip.find_cell_magic("mlxgen") is not None
    unload(ip)
    assert loaded_magics(ip) is None and not magics.hooks.installed
    assert ip.find_cell_magic("mlxgen") is None and ip.find_line_magic("mlxgen_jobs") is None
    assert ip.find_line_magic("mlxgen_cluster") is None and ip.find_cell_magic("mlxchat") is None
    assert magics not in ip.configurables
    assert magics.router.pre_run_cell not in ip.events.callbacks["pre_run_cell"]
    unload(ip)  # harmless when not loaded


@pytest.mark.unit
def test_help_is_generated_from_the_arguments() -> None:
    doc = MLXGen.mlxgen.__doc__
    assert doc.lstrip(": \n").startswith("%%mlxgen [")
    for flag in (
        "--model",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--system",
        "--raw",
        "--out",
        "--wait",
        "--budget",
    ):
        assert flag in doc


# -- interrupts ----------------------------------------------------------------------------------


def test_wait_for_turns_sigint_into_a_drained_stop(
    worker: mlx_notebook.Worker, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = generate(worker, tiny_model, max_tokens=20)
    reference.result(60)
    gen = generate(worker, tiny_model, max_tokens=3000)
    wait_tokens(gen, 3)
    draining, noted = threading.Event(), threading.Event()

    def slow_display(event: mlx_notebook.GenerationEvent) -> None:
        if event.state == "stopped":
            # Keeps the drain going until the second interrupt has been seen.
            draining.set()
            noted.wait(30)

    gen.add_listener(slow_display)

    class NoteWatch(io.StringIO):
        """stderr: tells when wait_for's "stopping; waiting..." note (its answer to a second interrupt) is out."""

        def write(self, text: str) -> int:
            if "waiting for the current piece of work" in text:
                noted.set()
            return super().write(text)

    before = signal.getsignal(signal.SIGINT)
    errors: list[str] = []

    def interrupt_twice() -> None:
        try:
            # Not before wait_for's own handler is in place (pytest's would raise at once).
            wait_until(lambda: signal.getsignal(signal.SIGINT) is not before, 30, "wait_for's SIGINT handler")
            os.kill(os.getpid(), signal.SIGINT)
            assert draining.wait(30), "the first interrupt did not stop the generation"
            os.kill(os.getpid(), signal.SIGINT)  # during the drain: must not abandon it
        except AssertionError as exc:
            errors.append(str(exc))
            gen.cancel()

    stderr = NoteWatch()
    monkeypatch.setattr(sys, "stderr", stderr)
    threading.Thread(target=interrupt_twice, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="stopped after"):
        wait_for(gen)
    assert not errors, errors
    assert gen.finished and gen.state == "stopped"
    assert signal.getsignal(signal.SIGINT) is before
    assert noted.is_set() and "waiting for the current piece of work" in stderr.getvalue()
    # Nothing lost: the model still gives the same greedy tokens.
    again = generate(worker, tiny_model, max_tokens=20)
    again.result(60)
    assert again.tokens == reference.tokens
    n = min(len(gen.tokens), 20)
    assert gen.tokens[:n] == reference.tokens[:n]


def test_wait_for_a_queued_generation_drops_it(worker: mlx_notebook.Worker, tiny_model: str) -> None:
    # max_batch=1: the second waits in the queue instead of joining the first's batch.
    running = generate(worker, tiny_model, max_tokens=3000, max_batch=1)
    queued = generate(worker, tiny_model, max_tokens=10, max_batch=1)
    wait_state(running, "decoding")
    before = signal.getsignal(signal.SIGINT)

    def interrupt() -> None:
        # Not before wait_for's own handler is in place (pytest's would raise at once).
        wait_until(lambda: signal.getsignal(signal.SIGINT) is not before, 30, "wait_for's SIGINT handler")
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="stopped after 0 tokens"):
        wait_for(queued)
    assert queued.state == "stopped" and running.state == "decoding"
    running.cancel()
    assert running.wait(10)


def test_shutdown_worker_stops_everything(tiny_model: str) -> None:
    worker = mlx_notebook.Worker()
    gen = generate(worker, tiny_model, max_tokens=3000)
    wait_tokens(gen, 2)
    assert shutdown_worker(worker, timeout=10)
    assert gen.state == "stopped" and not worker.alive


# -- views ------------------------------------------------------------------------------------------


def test_widget_buttons_follow_the_state(worker: mlx_notebook.Worker, tiny_model: str) -> None:
    reference = generate(worker, tiny_model, max_tokens=400)
    reference.result(60)
    gen = generate(worker, tiny_model, max_tokens=400)
    view = WidgetView(gen, throttle=0.0).show()
    wait_tokens(gen, 5)
    assert (view.pause_button.description, view.pause_button.disabled) == ("Pause", False)
    assert not view.stop_button.disabled

    view.pause_button.click()
    assert_stays_paused(gen, lambda: other_generation(worker, tiny_model))
    wait_until(lambda: view.pause_button.description == "Resume", 30, "the Resume label")
    assert not view.pause_button.disabled and not view.stop_button.disabled
    assert "paused" in view.status.value
    view.pause_button.click()  # Resume
    gen.result(60)
    assert gen.tokens == reference.tokens  # exact resume
    wait_until(lambda: view.progress.bar_style == "success", 30, "a green bar")
    assert view.stop_button.disabled and view.pause_button.disabled
    assert view.progress.value == 1.0
    assert gen.text.replace("&", "&amp;").replace("<", "&lt;")[:20] in view.text.value

    stopped = generate(worker, tiny_model, max_tokens=3000)
    view = WidgetView(stopped, throttle=0.0).show()
    wait_tokens(stopped, 5)
    view.stop_button.click()
    assert stopped.wait(10) and stopped.state == "stopped"
    wait_until(lambda: view.progress.bar_style == "warning", 30, "an orange bar")
    assert "stopped in" in view.status.value and view.stop_button.disabled


def test_views_show_a_finished_generation(worker: mlx_notebook.Worker, tiny_model: str, capsys: Any) -> None:
    gen = generate(worker, tiny_model, max_tokens=5)
    gen.result(60)
    TerminalView(gen, stream=True).show()  # the listener comes too late: drawn from the handle
    out = capsys.readouterr().out
    assert out.startswith(gen.text) and status_line(gen) in out
    assert plain_text(gen).startswith(gen.text) and plain_text(gen).endswith("]")
    bundle = WidgetView(gen).show()._bundle()
    assert bundle.data["text/plain"] == plain_text(gen)
    assert bundle.metadata["mlx_notebook"] == {"id": gen.id, "state": "done", "chars": len(gen.text)}


@pytest.mark.unit
def test_display_router_resends_finals_sent_while_idle() -> None:
    sent: list[str] = []
    view = SimpleNamespace(publish_final=lambda: sent.append("final"))
    router = DisplayRouter()
    router.final_sent(view)  # a cell runs: delivered with it
    router.post_run_cell()
    router.final_sent(view)  # idle: nobody reads it now
    assert sent == []
    router.pre_run_cell()
    assert sent == ["final"]
    router.pre_run_cell()
    assert sent == ["final"]


@pytest.mark.unit
def test_choose_ui() -> None:
    assert choose_ui("auto", SimpleNamespace()) == "terminal"
    kernel_shell = SimpleNamespace(kernel=object())
    assert choose_ui("auto", kernel_shell) == "widget"
    assert choose_ui("text", kernel_shell) == "text"
