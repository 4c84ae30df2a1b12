"""The bad-input catalogue: every mistake ends in one clear line, and nothing else happens.

Each case goes through a real kernel (``%%mlxgen`` and its line magics) or
the Python API, and must fail with one line that holds its key phrase (no
traceback), or, for the inputs that are fine as they are (stray braces, a
second ``%load_ext``), pass without changing anything. Cases that can only
be found while loading or preparing (bad GGUF files, prompts beyond the
context) fail their generation; with ``--wait`` the cell then ends with the
same one line. After the catalogue the kernel still answers and a greedy
generation gives the reference tokens.

Run with ``-s`` to print the table of messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_gguf
from conftest import needs_default_model

import mlx_notebook
from mlx_notebook import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from testkit import gguf_writer as gw
from testkit.kernel_helpers import (
    KernelSession,
    greedy_tokens,
    one_line_usage_error,
    start_kernel,
    wait_decoding,
    wait_state,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = "Name three rivers."
REF_TOKENS = 8


@dataclass(frozen=True)
class Case:
    """A cell and the key phrase of the one line it must end with."""

    name: str
    cell: str  # ``{tmp}`` is the folder of bad files
    phrase: str
    by_ipython: bool = False  # IPython's own one-line UsageError, before the magic runs


GGUF_CASES = {
    # name: (file bytes, phrase)
    "gguf_empty": (test_gguf.BAD_FILES["empty"][0], "gguf_empty.gguf: empty file, not a GGUF file"),
    "gguf_truncated": (test_gguf.BAD_FILES["cut_data"][0], "gguf_truncated.gguf: corrupt or truncated GGUF file"),
    "gguf_corrupt": (test_gguf.BAD_FILES["zip"][0], "gguf_corrupt.gguf: not a GGUF file (bad magic)"),
    "gguf_not_llama": (test_gguf.BAD_FILES["arch_klingon"][0], "unsupported GGUF architecture 'klingon'"),
    "gguf_absurd_dims": (test_gguf.BAD_FILES["dim_huge"][0], "runs past the end of the file"),
    "gguf_absurd_count": (test_gguf.BAD_FILES["tensor_count_2e60"][0], "header says 1152921504606846976 tensors"),
    "gguf_absurd_ffn": (
        test_gguf._tiny_bytes(**{"llama.feed_forward_length": gw.typed(gw.UINT64, 2**40)})[0],
        "invalid metadata (intermediate_size = 1099511627776; corrupt GGUF file)",
    ),
    "gguf_context_0": (
        test_gguf._tiny_bytes(**{"llama.context_length": 0})[0],
        "invalid metadata llama.context_length = 0 (corrupt GGUF file)",
    ),
}

CASES: list[Case] = [
    Case("model_unknown", f"%%mlxgen -m no-such-model\n{PROMPT}", "model 'no-such-model' not found: give 'default'"),
    Case(
        "model_hub_not_cached",
        f"%%mlxgen -m someorg/not-cached\n{PROMPT}",
        "not in the local Hugging Face cache and downloads are off",
    ),
    Case("gguf_missing", f"%%mlxgen -m {{tmp}}/missing.gguf\n{PROMPT}", "missing.gguf' not found (no such file)"),
    Case(
        "not_a_model_file",
        f"%%mlxgen -m {{tmp}}/notes.txt\n{PROMPT}",
        "notes.txt: not a model file; give a .gguf file or an MLX model folder",
    ),
    Case("folder_without_config", f"%%mlxgen -m {{tmp}}/empty\n{PROMPT}", "not found (the folder has no config.json)"),
    *[
        Case(name, f"%%mlxgen -m {{tmp}}/{name}.gguf --wait\n{PROMPT}", phrase)
        for name, (_, phrase) in GGUF_CASES.items()
    ],
    Case("empty_prompt", "%%mlxgen\n", "%%mlxgen is a cell magic, but the cell body is empty.", by_ipython=True),
    Case("whitespace_prompt", "%%mlxgen\n   \n\t\n", "the cell is empty"),
    Case("whitespace_variable", "%%mlxgen\n{blank}", "prompt is empty: give some text to generate from"),
    Case("n_zero", f"%%mlxgen -n 0\n{PROMPT}", "max_tokens must be >= 1, got 0"),
    Case("n_negative", f"%%mlxgen -n -3\n{PROMPT}", "max_tokens must be >= 1, got -3"),
    Case("budget_zero", f"%%mlxgen --budget 0\n{PROMPT}", "stop_budget must be > 0.0, got 0.0"),
    Case("budget_negative", f"%%mlxgen --budget -1\n{PROMPT}", "stop_budget must be > 0.0, got -1.0"),
    Case("budget_inf", f"%%mlxgen --budget inf\n{PROMPT}", "stop_budget must be > 0.0, got inf"),
    Case("n_not_a_number", f"%%mlxgen -n abc\n{PROMPT}", "argument -n/--max-tokens: invalid int value: 'abc'"),
    Case("n_fraction", f"%%mlxgen -n 1.5\n{PROMPT}", "argument -n/--max-tokens: invalid int value: '1.5'"),
    Case("t_not_a_number", f"%%mlxgen -t hot\n{PROMPT}", "argument -t/--temperature: invalid float value: 'hot'"),
    Case("t_nan", f"%%mlxgen -t nan\n{PROMPT}", "temperature must be a number, got nan"),
    Case("t_negative", f"%%mlxgen -t -0.5\n{PROMPT}", "temperature must be >= 0.0, got -0.5"),
    Case("top_p_above_1", f"%%mlxgen --top-p 2\n{PROMPT}", "top_p must be > 0.0 and <= 1.0, got 2.0"),
    Case("seed_negative", f"%%mlxgen --seed -1\n{PROMPT}", "seed must be >= 0, got -1"),
    Case("top_k_zero", f"%%mlxgen --top-k 0\n{PROMPT}", "top_k must be >= 1, got 0"),
    Case("min_p_above_1", f"%%mlxgen --min-p 3\n{PROMPT}", "min_p must be > 0.0 and <= 1.0, got 3.0"),
    Case("stop_empty", f"%%mlxgen --stop ''\n{PROMPT}", "stop strings must be non-empty, got ''"),
    Case("logit_bias_malformed", f"%%mlxgen --logit-bias '{{1:'\n{PROMPT}", "--logit-bias must be JSON like"),
    Case("logit_bias_not_a_dict", f"%%mlxgen --logit-bias '[1, 2]'\n{PROMPT}", "must be a dict of token id to bias"),
    Case("logit_bias_bad_key", f"%%mlxgen --logit-bias '{{\"x\": 1}}'\n{PROMPT}", "keys must be token ids"),
    Case(
        "logit_bias_beyond_vocab",
        f"%%mlxgen --wait --logit-bias '{{\"99999999\": 1}}'\n{PROMPT}",
        "logit_bias token id 99999999 is not in the model's vocabulary",
    ),
    Case("logprobs_negative", f"%%mlxgen --logprobs -1\n{PROMPT}", "logprobs must be >= 0, got -1"),
    Case("flag_unknown", f"%%mlxgen --bogus\n{PROMPT}", "unrecognized arguments: --bogus"),
    Case("flag_without_value", f"%%mlxgen -n\n{PROMPT}", "argument -n/--max-tokens: expected one argument"),
    Case("out_not_a_name", f"%%mlxgen -o 1x\n{PROMPT}", "--out needs a Python variable name, got '1x'"),
    Case("variable_unknown", "%%mlxgen\nTell me about {nme}.", "unknown variable {nme} in the prompt; define it"),
    Case(
        "attribute_unknown",
        "%%mlxgen\nTell me about {topic.nope}.",
        "{topic.nope} in the prompt: topic has no attribute 'nope'",
    ),
    Case("str_raises", "%%mlxgen\nTell me about {unprintable}.", "str() failed with ValueError: no text"),
    Case(
        "lone_surrogate",
        "%%mlxgen\n{surrogate}",
        "prompt is not valid UTF-8 text: '\\udcff' at position 3 is a lone surrogate",
    ),
    Case(
        "beyond_context_tiny", "%%mlxgen --wait\n{long_prompt}", "but the model's context is 4096: shorten the prompt"
    ),
    Case("stop_bad_id", "%mlxgen_stop abc", "give a generation id or 'all', got 'abc'"),
    Case("stop_unknown_id", "%mlxgen_stop 999999", "no generation #999999: %mlxgen_jobs lists them"),
    Case("jobs_with_arguments", "%mlxgen_jobs x", "%mlxgen_jobs takes no arguments"),
    Case("unload_unknown_model", "%mlxgen_models --unload no-such-model", "model 'no-such-model' not found"),
    Case("models_unknown_flag", "%mlxgen_models --bogus", "unrecognized arguments: --bogus"),
]

TABLE: list[str] = []


def record(via: str, name: str, message: str) -> None:
    TABLE.append(f"| {via} | {name} | {message} |")
    print(f"\nCASE | {via} | {name} | {message}")


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bad")
    for name, (data, _) in GGUF_CASES.items():
        (folder / f"{name}.gguf").write_bytes(data)
    (folder / "notes.txt").write_text("not a model")
    (folder / "empty").mkdir()
    return folder


@pytest.fixture(scope="module")
def kernel(tiny_model: str):
    setup = (
        "blank = '   '\n"
        "topic = 'rivers'\n"
        "surrogate = 'caf\\udcff'\n"
        "long_prompt = 'fox ' * 5000\n"
        "class Unprintable:\n"
        "    def __str__(self):\n"
        "        raise ValueError('no text')\n"
        "unprintable = Unprintable()",
    )
    with start_kernel(tiny_model, setup=setup) as session:
        yield session


@pytest.fixture(scope="module")
def reference(kernel: KernelSession) -> list[int]:
    return greedy_tokens(kernel, PROMPT, REF_TOKENS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_case(kernel: KernelSession, reference: list[int], bad_files: Path, case: Case) -> None:
    reply = kernel.execute(case.cell.replace("{tmp}", str(bad_files)), timeout=300)
    if case.by_ipython:
        message = reply.stream("stderr").strip()
        assert reply.content["ename"] == "UsageError" and len(message.splitlines()) == 1, message
    else:
        message = one_line_usage_error(reply)
    record("kernel", case.name, message)
    assert case.phrase in message, message
    assert kernel.execute("assert 1 + 1 == 2").ok


@needs_default_model
def test_prompt_beyond_the_default_models_context(kernel: KernelSession, reference: list[int]) -> None:
    """SmolLM2's context is 8192 tokens; the prompt is checked before any prefill."""
    reply = kernel.execute("%%mlxgen -m default --wait -o g\n{long_prompt}{long_prompt}", timeout=600)
    message = one_line_usage_error(reply)
    record("kernel", "beyond_context_default", message)
    assert re.search(r"prompt has \d{5} tokens but the model's context is 8192: shorten the prompt", message)
    assert kernel.eval("(g.state, g.tokens, g.stats.prefill_chunks)") == ("failed", [], 0)


# -- inputs that are fine ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, prompt",
    [
        ('Return {"a": 1} and { x } and {} and {{n}} }{', 'Return {"a": 1} and { x } and {} and {n} }{'),
        ("{", "{"),
        ("def f(x): return {x: [1, 2]}", "def f(x): return {x: [1, 2]}"),
    ],
    ids=["stray_braces", "lone_brace", "code_with_braces"],
)
def test_stray_braces_pass_through(kernel: KernelSession, reference: list[int], body: str, prompt: str) -> None:
    reply = kernel.execute(f"%%mlxgen -n 2 --wait -o g\n{body}", timeout=300)
    assert reply.ok and not reply.stream("stderr"), reply.content
    assert kernel.eval("(g.request.prompt, g.state)") == (prompt, "done")
    record("kernel", "accepted: " + body, f"generated from {prompt!r}")


def test_every_sampling_flag_reaches_the_request_and_the_api_gives_the_same(kernel: KernelSession) -> None:
    flags = (
        "-t 0.8 --seed 3 --top-k 7 --min-p 0.02 --repetition-penalty 1.3 --repetition-context 9 "
        "--logit-bias bias --stop zzz --stop '###' --logprobs 2"
    )
    assert kernel.execute("bias = {5: 1.5}").ok
    reply = kernel.execute(f"%%mlxgen -n 12 --wait -o g {flags}\n{PROMPT}", timeout=300)
    assert reply.ok and not reply.stream("stderr"), reply.content
    got = kernel.eval(
        "(g.state, g.request.top_k, g.request.min_p, g.request.repetition_penalty, g.request.repetition_context, "
        "g.request.logit_bias, g.request.stop, len(g.logprobs) == len(g.tokens))"
    )
    assert got == ("done", 7, 0.02, 1.3, 9, {5: 1.5}, ["zzz", "###"], True), got
    same = kernel.eval(
        "__import__('mlx_notebook').generate(g.request.prompt, model=g.request.model, max_tokens=12, temperature=0.8, seed=3, "
        "top_k=7, min_p=0.02, repetition_penalty=1.3, repetition_context=9, logit_bias={5: 1.5}, "
        "stop=['zzz', '###'], logprobs=2).result(timeout=120) == g.text"
    )
    assert same
    # JSON works too, and the config traits are the defaults of the flags.
    assert kernel.execute("%config MLXGen.top_k = 3").ok
    reply = kernel.execute(f"%%mlxgen -n 4 --wait -o h --logit-bias '{{\"5\": 2}}'\n{PROMPT}", timeout=300)
    assert reply.ok, reply.content
    assert kernel.eval("(h.request.top_k, h.request.logit_bias)") == (3, {5: 2})
    assert kernel.execute("%config MLXGen.top_k = None").ok


def test_second_load_ext_changes_nothing(kernel: KernelSession) -> None:
    probe = (
        "(sum(type(c).__name__ == 'MLXGen' for c in get_ipython().configurables), "
        "len(get_ipython().events.callbacks['pre_run_cell']))"
    )
    before = kernel.eval(probe)
    reply = kernel.execute("%load_ext mlx_notebook")
    assert reply.ok and not reply.stream("stderr")
    out = reply.stream("stdout")
    assert out.startswith("The mlx_notebook extension is already loaded."), out
    record("kernel", "second_load_ext", out.splitlines()[0] + " (IPython, not an error)")
    direct = kernel.execute("import mlx_notebook; mlx_notebook.load_ipython_extension(get_ipython())")
    assert direct.ok and not direct.stream("stdout") + direct.stream("stderr")
    assert kernel.eval(probe) == before


def test_bad_config_value_is_one_line(kernel: KernelSession) -> None:
    reply = kernel.execute("%config MLXGen.max_tokens = 0")
    err = reply.stream("stderr").strip()
    assert len(err.splitlines()) == 1 and "MLXGen.max_tokens must be >= 1, got 0" in err, err
    record("kernel", "config_max_tokens_0", err)
    assert kernel.eval("get_ipython().magics_manager.registry['MLXGen'].max_tokens") == 256
    # IPython keeps the rejected value in its config: a reload reads it from there.
    assert kernel.execute("%unload_ext mlx_notebook").ok
    reload = kernel.execute("%load_ext mlx_notebook")
    message = reload.stream("stderr").strip()
    record("kernel", "load_ext_after_rejected_config", message)
    assert reload.content["ename"] == "UsageError" and len(message.splitlines()) == 1, message
    assert "MLXGen.max_tokens must be >= 1, got 0 (in the IPython config); set a valid value" in message
    assert kernel.execute("%config MLXGen.max_tokens = 256").ok
    assert kernel.execute("%load_ext mlx_notebook").ok
    assert kernel.eval("get_ipython().magics_manager.registry['MLXGen'].max_tokens") == 256


def test_unload_ext_mid_generation_stops_it_and_load_works_again(
    kernel: KernelSession, tiny_model: str, reference: list[int]
) -> None:
    started = kernel.execute(f"%%mlxgen -n 100000 -o running\n{PROMPT}")
    assert started.ok, started.content
    wait_decoding(kernel, started.msg_id)
    reply = kernel.execute("%unload_ext mlx_notebook")
    assert reply.ok and not reply.stream("stderr"), reply.content
    # Stopped and drained by the time the unload returns; partial text readable.
    state, n, text = kernel.eval("(running.state, len(running.tokens), running.text)")
    assert state == "stopped" and 0 < n < 100000 and text
    assert wait_state(kernel, started.msg_id, ("stopped",), timeout=30) == "stopped"
    gone = kernel.execute(f"%%mlxgen\n{PROMPT}")
    assert gone.stream("stderr").strip() == "UsageError: Cell magic `%%mlxgen` not found."
    record(
        "kernel",
        "unload_ext_mid_generation",
        f"generation stopped after {n} tokens; then: " + gone.stream("stderr").strip(),
    )
    reloaded = kernel.execute("%load_ext mlx_notebook")
    assert reloaded.ok, reloaded.content
    assert kernel.execute(f"%config MLXGen.model = {tiny_model!r}").ok
    again = kernel.execute(f"%%mlxgen -n {REF_TOKENS} --wait -o again\n{PROMPT}", timeout=300)
    assert again.ok, again.content
    assert kernel.eval("again.tokens") == reference


# -- the Python API -----------------------------------------------------------------------------------


API_CASES: dict[str, tuple] = {
    # name: (generate() keyword arguments, error type, phrase)
    "api_empty_prompt": ({"prompt": ""}, InvalidArgumentError, "prompt is empty"),
    "api_whitespace_prompt": ({"prompt": " \n\t "}, InvalidArgumentError, "prompt is empty"),
    "api_bytes_prompt": (
        {"prompt": b"hi"},
        InvalidArgumentError,
        "prompt must be a string, a list of token ids or a list of messages, got bytes",
    ),
    "api_lone_surrogate": (
        {"prompt": "caf\udcff"},
        InvalidArgumentError,
        "prompt is not valid UTF-8 text: '\\udcff' at position 3",
    ),
    "api_surrogate_system": (
        {"system": "\ud800 sys"},
        InvalidArgumentError,
        "system is not valid UTF-8 text: '\\ud800' at position 0",
    ),
    "api_n_zero": ({"max_tokens": 0}, InvalidArgumentError, "max_tokens must be >= 1, got 0"),
    "api_n_negative": ({"max_tokens": -3}, InvalidArgumentError, "max_tokens must be >= 1, got -3"),
    "api_n_bool": ({"max_tokens": True}, InvalidArgumentError, "max_tokens must be an integer, got True"),
    "api_budget_zero": ({"stop_budget": 0}, InvalidArgumentError, "stop_budget must be > 0.0, got 0"),
    "api_budget_negative": ({"stop_budget": -1}, InvalidArgumentError, "stop_budget must be > 0.0, got -1"),
    "api_model_not_a_string": ({"model": 42}, ModelNotFoundError, "expected a string, got int"),
    "api_model_unknown": ({"model": "no-such-model"}, ModelNotFoundError, "model 'no-such-model' not found"),
    "api_empty_token_list": (
        {"prompt": []},
        InvalidArgumentError,
        "a token prompt must be a non-empty list of non-negative integers",
    ),
    "api_negative_token": ({"prompt": [1, -2]}, InvalidArgumentError, "a token prompt must be a non-empty list"),
}


@pytest.mark.parametrize("name", sorted(API_CASES))
def test_api_case(worker, tiny_model: str, name: str) -> None:
    kwargs, error, phrase = API_CASES[name]
    kwargs = {"prompt": PROMPT, "model": tiny_model, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(error) as caught:
        mlx_notebook.generate(prompt, worker=worker, **kwargs)
    message = str(caught.value)
    record("api", name, message)
    assert phrase in message and "\n" not in message, message


def test_api_token_beyond_the_vocabulary_fails_only_that_generation(worker, tiny_model: str) -> None:
    gen = mlx_notebook.generate([1, 10**9], model=tiny_model, worker=worker, max_tokens=2)
    with pytest.raises(InvalidArgumentError) as caught:
        gen.result(timeout=60)
    message = str(caught.value)
    record("api", "api_token_beyond_vocabulary", message)
    assert "token id 1000000000 is outside the model's vocabulary" in message and "\n" not in message
    assert gen.state == "failed"
    assert mlx_notebook.generate(PROMPT, model=tiny_model, worker=worker, max_tokens=2).result(timeout=60)


def test_api_bad_gguf_fails_in_the_handle(worker, bad_files: Path) -> None:
    gen = mlx_notebook.generate(PROMPT, model=str(bad_files / "gguf_truncated.gguf"), worker=worker)
    with pytest.raises(ModelFormatError) as caught:
        gen.result(timeout=60)
    message = str(caught.value)
    record("api", "api_gguf_truncated", message)
    assert "corrupt or truncated GGUF file" in message and "\n" not in message
    with pytest.raises(ModelNotFoundError) as missing:
        mlx_notebook.load_model("no-such-model", worker=worker)
    record("api", "api_load_model_unknown", str(missing.value))


# -- %%mlxgen --map over inputs ------------------------------------------------------------------------

MAP_SETUP = "map_number = 5\nmap_empty = []\nmap_rows = [{'name': 'Peru'}, {'title': 'Chile'}]\nmap_blank = [' ']"
MAP_CASES: list[Case] = [
    Case(
        "map_not_iterable", "%%mlxgen --map map_number\n{item}", "--map map_number is an int, not iterable; give a list"
    ),
    Case("map_single_string", "%%mlxgen --map topic\n{item}", "--map topic is a single str; give a list of inputs"),
    Case("map_empty_list", "%%mlxgen --map map_empty\n{item}", "--map map_empty is empty: nothing to generate"),
    Case(
        "map_missing_key",
        "%%mlxgen --map map_rows\nAbout {item[name]}.",
        "--map map_rows[1]: {item[name]} in the prompt: item has no key 'name' (KeyError)",
    ),
    Case(
        "map_missing_field",
        "%%mlxgen --map map_rows\nAbout {item.name}.",
        "--map map_rows[0]: {item.name} in the prompt: item has no attribute 'name' (AttributeError); "
        "for a dict write {item[name]}",
    ),
    Case("map_unknown_name", "%%mlxgen --map map_nope\n{item}", "--map map_nope: no variable 'map_nope'; define"),
    Case("map_not_a_name", "%%mlxgen --map 1x\n{item}", "--map needs the name of a variable that holds the inputs"),
    Case("map_blank_prompt", "%%mlxgen --map map_blank\n{item}", "--map map_blank: prompts[0]: prompt is empty"),
    Case("map_without_name", "%%mlxgen --map\n{item}", "argument --map: expected one argument"),
]


@pytest.mark.parametrize("case", MAP_CASES, ids=[c.name for c in MAP_CASES])
def test_map_case_queues_nothing(kernel: KernelSession, reference: list[int], case: Case) -> None:
    assert kernel.execute(MAP_SETUP).ok
    before = kernel.eval("len(__import__('mlx_notebook').default_worker().history)")
    message = one_line_usage_error(kernel.execute(case.cell))
    record("kernel", case.name, message)
    assert case.phrase in message, message
    assert kernel.eval("len(__import__('mlx_notebook').default_worker().history)") == before


def test_bad_map_leaves_a_running_generation_alone(kernel: KernelSession, reference: list[int]) -> None:
    assert kernel.execute(MAP_SETUP).ok
    started = kernel.execute(f"%%mlxgen -n {REF_TOKENS} -o survivor\n{PROMPT}")
    assert started.ok, started.content
    for case in MAP_CASES:
        one_line_usage_error(kernel.execute(case.cell))
    assert wait_state(kernel, started.msg_id, ("done", "stopped", "failed")) == "done"
    assert kernel.eval("survivor.tokens") == reference


def test_api_generate_many_bad_prompt_queues_nothing(worker, tiny_model: str) -> None:
    before = len(worker.history)
    with pytest.raises(InvalidArgumentError) as caught:
        mlx_notebook.generate_many([PROMPT, "  ", PROMPT], model=tiny_model, worker=worker)
    message = str(caught.value)
    record("api", "api_generate_many_blank_prompt", message)
    assert message == "prompts[1]: prompt is empty: give some text to generate from"
    assert len(worker.history) == before


# -- afterwards ------------------------------------------------------------------------------------------


def test_kernel_still_answers_with_the_reference_tokens(kernel: KernelSession, reference: list[int]) -> None:
    assert kernel.km.is_alive()
    assert kernel.execute("assert 1 + 1 == 2").ok
    reply = kernel.execute(f"%%mlxgen -n {REF_TOKENS} --wait -o after\n{PROMPT}", timeout=300)
    assert reply.ok, reply.content
    assert kernel.eval("after.tokens") == reference
    assert len(TABLE) >= 30
