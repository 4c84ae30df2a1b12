"""Generations and chats that survive a restart: ``gen.save`` / ``resume_from``, ``Chat.save(kv=True)``.

The resumes here run in a fresh :class:`~mlx_notebook.Worker` (a new stream,
nothing cached): what a new process has, less the model load. The real
kernel restart is in tests/test_persistence_kernel.py. Bad files must give
one-line errors and leave the worker, the model and other generations as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlx_notebook
from mlx_notebook.errors import InvalidArgumentError
from mlx_notebook.generation import persist
from mlx_notebook.generation.kv_file import KVFileError, load, read_metadata
from testkit.tiny_model import make_tiny_model
from testkit.waiting import wait_state, wait_tokens

PROMPT = "Tell me a long story about the sea and the lighthouse on the rocks"
CASES = [
    pytest.param({}, id="greedy"),
    pytest.param({"temperature": 0.9, "seed": 11}, id="seeded"),
    pytest.param({"temperature": 0.8, "seed": 2, "top_k": 20, "repetition_penalty": 1.2}, id="seeded-filters"),
    pytest.param({"kv_bits": 8, "quantized_kv_start": 0}, id="kv8"),
    pytest.param({"kv_bits": 4, "quantized_kv_start": 30, "temperature": 0.7, "seed": 4}, id="kv4-seeded"),
    pytest.param({"max_kv_size": 24}, id="window"),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """A 4-layer random llama with head size 64 (mx.quantize groups fit it)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("wide") / "model", hidden=256, heads=4, intermediate=256))


@pytest.fixture
def fresh_worker():
    w = mlx_notebook.Worker()
    yield w
    assert w.shutdown(timeout=60)


def paused_at(worker, model: str, n: int, **kw) -> mlx_notebook.Generation:
    gen = mlx_notebook.generate(PROMPT, model=model, worker=worker, max_tokens=40, **kw)
    wait_tokens(gen, n)
    gen.pause()
    wait_state(gen, "paused")
    return gen


@pytest.mark.parametrize("kw", CASES)
def test_a_paused_generation_resumes_exactly_in_a_fresh_worker(worker, fresh_worker, wide_model, tmp_path, kw):
    whole = mlx_notebook.generate(PROMPT, model=wide_model, worker=worker, max_tokens=40, **kw)
    whole.result(timeout=120)
    gen = paused_at(worker, wide_model, 8, **kw)
    path = tmp_path / "gen.safetensors"
    assert gen.save(path) > 0
    saved_tokens = gen.tokens
    gen.cancel()
    resumed = mlx_notebook.resume_from(str(path), worker=fresh_worker)
    resumed.result(timeout=120)
    assert resumed.state == "done", resumed.error
    assert resumed.tokens[: len(saved_tokens)] == saved_tokens
    assert resumed.tokens == whole.tokens
    assert resumed.text == whole.text
    assert resumed.stats.cached_tokens == len(resumed.prompt_tokens) + len(saved_tokens) - 1


def test_the_file_is_mlx_lms_prompt_cache_format(worker, wide_model, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache

    gen = paused_at(worker, wide_model, 5)
    path = tmp_path / "gen.safetensors"
    gen.save(path)
    cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    data = json.loads(metadata[persist.META_KEY])
    assert data["format"] == persist.FORMAT and data["tokens"] == gen.tokens
    assert cache[0].offset == len(data["prompt"]) + len(data["tokens"]) - 1
    gen.cancel()


def test_a_finished_generation_saves_what_the_prompt_cache_holds_and_resumes_longer(
    worker, fresh_worker, wide_model, tmp_path
):
    longer = mlx_notebook.generate(PROMPT, model=wide_model, worker=worker, max_tokens=30)
    longer.result(timeout=120)
    short = mlx_notebook.generate(PROMPT, model=wide_model, worker=worker, max_tokens=12)
    short.result(timeout=120)
    path = tmp_path / "done.safetensors"
    short.save(path)
    data = json.loads(read_metadata(path)[persist.META_KEY])
    assert data["kv_tokens"] > len(data["prompt"])  # the cache came from the prompt cache
    resumed = mlx_notebook.resume_from(str(path), worker=fresh_worker, max_tokens=30)
    resumed.result(timeout=120)
    assert resumed.tokens == longer.tokens


def test_a_running_or_queued_generation_is_not_saved(worker, wide_model, tmp_path):
    gen = mlx_notebook.generate(PROMPT, model=wide_model, worker=worker, max_tokens=400)
    wait_tokens(gen, 2)
    with pytest.raises(InvalidArgumentError, match=r"is decoding: pause it first") as info:
        gen.save(tmp_path / "x.safetensors")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "x.safetensors").exists()
    gen.cancel()
    gen.wait(60)


def test_bad_files_give_one_line_errors_and_change_nothing(worker, wide_model, tiny_model, tmp_path):
    gen = paused_at(worker, wide_model, 5)
    good = tmp_path / "good.safetensors"
    gen.save(good)
    raw = good.read_bytes()
    other = paused_at(worker, wide_model, 3)  # paused beside it: the bad files below must not touch it
    other_tokens = other.tokens

    cases: dict[str, tuple[bytes, type[Exception], str]] = {
        "truncated": (raw[: len(raw) - 100], KVFileError, "truncated"),
        "not a file of ours": (b'{"hello": 1}', KVFileError, "safetensors"),
        "empty": (b"", KVFileError, "safetensors"),
    }
    for name, (content, error, words) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(error, match=words) as info:
            mlx_notebook.resume_from(str(path), worker=worker)
        assert "\n" not in str(info.value), name

    # A request field that does not validate.
    from mlx_notebook.control import unpaced

    cache, _ = load(good, unpaced())
    data = json.loads(read_metadata(good)[persist.META_KEY])
    data["request"]["max_tokens"] = -3
    bad = tmp_path / "bad_request.safetensors"
    persist.write(bad, cache, data, unpaced())
    with pytest.raises(InvalidArgumentError, match="max_tokens must be >= 1"):
        mlx_notebook.resume_from(str(bad), worker=worker)

    other.resume()
    gen.resume()
    assert other.result(timeout=120) is not None and other.tokens[: len(other_tokens)] == other_tokens
    gen.result(timeout=120)
    assert gen.state == "done"

    # Another model's weights: refused once its model is loaded (the fingerprint).
    data = json.loads(read_metadata(good)[persist.META_KEY])
    data["request"]["model"] = tiny_model
    moved = tmp_path / "moved.safetensors"
    persist.write(moved, cache, data, unpaced())
    resumed = mlx_notebook.resume_from(str(moved), worker=worker)
    resumed.wait(120)
    assert resumed.state == "failed" and "was saved from other weights" in str(resumed.error)
    assert "\n" not in str(resumed.error)


def test_a_chat_saved_with_its_kv_serves_the_next_turn_from_it(worker, fresh_worker, wide_model, tmp_path):
    chat = mlx_notebook.Chat(wide_model, worker=worker, max_tokens=12)
    for i in range(3):
        chat.send(f"Question {i}: what is behind the hill?").result(timeout=120)
    path = tmp_path / "chat.safetensors"
    chat.save(path, kv=True)
    chat.save(tmp_path / "chat.json")
    again = chat.send("And then?")
    again.result(timeout=120)

    loaded = mlx_notebook.Chat.load(path, worker=fresh_worker)
    assert loaded.messages == chat.messages[:-2]
    turn = loaded.send("And then?")
    turn.result(timeout=120)
    assert turn.stats.cached_tokens > 0.8 * turn.stats.prompt_tokens
    assert turn.tokens == again.tokens

    plain = mlx_notebook.Chat.load(tmp_path / "chat.json", worker=fresh_worker)
    fresh_worker.prompt_cache_gb = 0
    cold = plain.send("And then?")
    cold.result(timeout=120)
    assert cold.stats.cached_tokens == 0 and cold.tokens == again.tokens


def test_a_chat_with_a_rotating_cache_refuses_to_keep_its_kv(worker, wide_model, tmp_path):
    chat = mlx_notebook.Chat(wide_model, worker=worker, max_tokens=4, max_kv_size=32)
    chat.send("hello").result(timeout=120)
    with pytest.raises(InvalidArgumentError, match="a chat with max_kv_size cannot keep its KV"):
        chat.save(tmp_path / "c.safetensors", kv=True)
    assert not Path(tmp_path / "c.safetensors").exists()


def test_mutated_json_in_a_save_file_gives_one_line_errors(worker, wide_model, tmp_path):
    """Every field of the file's JSON replaced by wrong values: a one-line error (at resume_from, or
    the generation fails with one), never a crash, a hang or another exception type."""
    from mlx_notebook.control import unpaced

    gen = paused_at(worker, wide_model, 4)
    good = tmp_path / "good.safetensors"
    gen.save(good)
    gen.cancel()
    gen.wait(60)
    cache, _ = load(good, unpaced())
    data = json.loads(read_metadata(good)[persist.META_KEY])
    wrong = [None, -1, 10**12, "x", [], [-5], {}, [1.5], True]
    outcomes = []
    for field in list(data) + [f"request.{name}" for name in data["request"]]:
        for value in wrong:
            mutated = json.loads(json.dumps(data))
            target, key = (mutated["request"], field.split(".", 1)[1]) if "." in field else (mutated, field)
            target[key] = value
            path = tmp_path / "mutated.safetensors"
            persist.write(path, cache, mutated, unpaced())
            try:
                resumed = mlx_notebook.resume_from(str(path), worker=worker, max_tokens=len(data["tokens"]) + 2)
            except mlx_notebook.MLXNotebookError as exc:
                assert "\n" not in str(exc), (field, value, str(exc))
                outcomes.append("refused")
                continue
            assert resumed.wait(120), (field, value)
            if resumed.state == "failed":
                assert "\n" not in str(resumed.error), (field, value, str(resumed.error))
            outcomes.append(resumed.state)
    assert outcomes.count("refused") > len(outcomes) // 2, outcomes
    assert mlx_notebook.generate(PROMPT, model=wide_model, worker=worker, max_tokens=4).result(timeout=60)
