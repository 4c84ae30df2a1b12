"""The notebook split: one flag per request option, %%mlxchat on every MLXGen trait, the job magics apart.

In-process IPython shell (like tests/test_magics.py), the tiny random-weight
model; the magics parse real argument lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.testing import globalipapp

import mlx_notebook
from mlx_notebook.generation.request import option_names
from mlx_notebook.notebook.chat_magic import ChatMagics
from mlx_notebook.notebook.job_magics import JobMagics
from mlx_notebook.notebook.magics import MLXGen, parse_options
from mlx_notebook.notebook.option_flags import FLAGS, given_options, key_value, on_off, without_flag

# A value for each option as typed, and as the request gets it.
TYPED = {
    "model": ("-m", "m", "m"),
    "max_tokens": ("-n", "7", 7),
    "temperature": ("-t", "0.5", 0.5),
    "top_p": ("--top-p", "0.9", 0.9),
    "seed": ("--seed", "3", 3),
    "system": ("-s", "sys", "sys"),
    "chat": ("--raw", None, False),
    "stop_budget": ("--budget", "0.2", 0.2),
    "max_batch": ("--max-batch", "2", 2),
    "top_k": ("--top-k", "5", 5),
    "min_p": ("--min-p", "0.1", 0.1),
    "repetition_penalty": ("--repetition-penalty", "1.2", 1.2),
    "repetition_context": ("--repetition-context", "9", 9),
    "logit_bias": ("--logit-bias", "bias", "bias"),  # a dict's name (or JSON), read by the magic
    "stop": ("--stop", "zz", ["zz"]),
    "logprobs": ("--logprobs", "2", 2),
    "thinking": ("--thinking", "off", False),
    "chat_template_kwargs": ("--template-arg", "effort=3", {"effort": 3}),
    "thinking_budget": ("--thinking-budget", "4", 4),
}


@pytest.fixture(scope="module")
def ip() -> Any:
    # Through the module: its first call starts the shell and replaces the module's get_ipython;
    # a name imported before that (at collection) keeps the starter, which returns None once started.
    return globalipapp.get_ipython()


@pytest.fixture()
def shell(ip: Any, worker: mlx_notebook.Worker, tiny_model: str) -> Iterator[tuple[Any, MLXGen]]:
    gen_magics = MLXGen(shell=ip, worker=worker)
    gen_magics.model = tiny_model
    parts = [gen_magics, ChatMagics(ip, gen_magics), JobMagics(ip, gen_magics)]
    for part in parts:
        ip.register_magics(part)
    yield ip, gen_magics
    for part in parts:
        ip.magics_manager.registry.pop(type(part).__name__, None)
        for kind, names in part.magics.items():
            for name in names:
                ip.magics_manager.magics[kind].pop(name, None)
    if gen_magics in ip.configurables:
        ip.configurables.remove(gen_magics)


def test_every_request_option_has_one_flag_and_reads_back():
    assert without_flag() == [], "add the option's flag to notebook/option_flags.py"
    assert set(option_names()) == set(FLAGS)
    assert set(TYPED) <= set(option_names())
    line = " ".join(flag if text is None else f"{flag} {text}" for flag, text, _ in TYPED.values())
    args = parse_options(MLXGen.mlxgen, line)
    assert given_options(args, option_names()) == {name: want for name, (_, _, want) in TYPED.items()}
    # Nothing typed, nothing given: the request's (or the trait's) default holds.
    assert given_options(parse_options(MLXGen.mlxgen, ""), option_names()) == {}


def test_help_lists_every_flag():
    for magic in (MLXGen.mlxgen, ChatMagics.mlxchat):
        text = magic.__doc__
        for name, spec in FLAGS.items():
            if magic is ChatMagics.mlxchat and name == "chat":
                continue  # a chat always applies the template: no --raw
            assert spec.flags[-1] in text, (magic.__name__, spec.flags)


def test_flag_value_parsers_say_what_they_take():
    assert (on_off("ON"), on_off("false")) == (True, False)
    assert key_value("a=b") == ("a", "b") and key_value("x=[1, 2]") == ("x", [1, 2]) and key_value("e=") == ("e", "")
    for parse, text in ((on_off, "maybe"), (key_value, "novalue"), (key_value, "=1")):
        with pytest.raises(Exception, match="give"):
            parse(text)


def test_a_new_chat_takes_every_mlxgen_request_trait(shell):
    ip, gen_magics = shell
    traits = gen_magics.request_traits()
    assert {"top_p", "seed", "chat"} <= set(option_names()) - set(traits)  # per call, not config
    gen_magics.top_k, gen_magics.thinking_budget, gen_magics.logprobs = 4, 6, 1
    gen_magics.repetition_penalty, gen_magics.max_tokens = 1.3, 3
    assert ip.run_cell("%%mlxchat c --wait --stop zz\nHi").success
    chat = ip.user_ns["c"]
    assert {
        k: chat.options[k] for k in ("top_k", "thinking_budget", "logprobs", "repetition_penalty", "max_tokens")
    } == {
        "top_k": 4,
        "thinking_budget": 6,
        "logprobs": 1,
        "repetition_penalty": 1.3,
        "max_tokens": 3,
    }
    request = chat.generation.request
    assert (request.top_k, request.stop, request.thinking_budget) == (4, ["zz"], 6)
    assert "stop" not in chat.options  # a cell's flags are its turn's


def test_the_job_magics_are_their_own_magics(shell, capsys):
    ip, gen_magics = shell
    assert ip.run_cell("%%mlxgen -n 2 --wait -o j\nHello").success
    ip.run_line_magic("mlxgen_jobs", "")
    assert f"#{ip.user_ns['j'].id}" in capsys.readouterr().out
    assert isinstance(ip.find_line_magic("mlxgen_jobs").__self__, JobMagics)
    assert not hasattr(gen_magics, "mlxgen_jobs")
