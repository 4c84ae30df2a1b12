"""KV memory settings: quantized (``kv_bits``) and rotating (``max_kv_size``) caches, per generation.

A small random-weight llama whose head size (64) mx.quantize can group, run on
the CPU in fp32: quantized and rotating generations must pause and resume
exactly, hold fewer bytes, decode alone beside plain rows, and only reuse
prefix-cache entries made with the same settings.
"""

from __future__ import annotations

import pytest

import mlx_notebook
from mlx_notebook.errors import InvalidArgumentError
from testkit.tiny_model import make_tiny_model
from testkit.waiting import assert_stays_paused, other_generation, wait_tokens

PROMPT = "The history of the lighthouse keepers on the northern coast, told by one of them " * 4
SETTINGS = [
    pytest.param({"kv_bits": 8, "quantized_kv_start": 0}, id="8bit"),
    pytest.param({"kv_bits": 4, "quantized_kv_start": 0, "kv_group_size": 32}, id="4bit-g32"),
    pytest.param({"kv_bits": 4, "quantized_kv_start": 40}, id="4bit-from-40"),
    pytest.param({"max_kv_size": 24}, id="window-24"),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """A 4-layer random llama with head size 64 (hidden 256, 4 heads)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("wide") / "model", hidden=256, heads=4, intermediate=256))


def run(worker, model, **kw) -> mlx_notebook.Generation:
    gen = mlx_notebook.generate(PROMPT, model=model, worker=worker, max_tokens=32, **kw)
    gen.result(timeout=120)
    assert gen.state == "done", (gen.state, gen.error)
    return gen


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("settings", SETTINGS)
def test_pause_and_resume_are_exact_with_kv_settings(worker, wide_model, settings, seed):
    worker.prompt_cache_gb = 0  # each run prefills: the paused run's prefill is its own
    try:
        sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {}
        plain = run(worker, wide_model, **sampling)
        whole = run(worker, wide_model, **settings, **sampling)
        gen = mlx_notebook.generate(PROMPT, model=wide_model, worker=worker, max_tokens=32, **settings, **sampling)
        wait_tokens(gen, 6)
        gen.pause()
        assert_stays_paused(gen, lambda: other_generation(worker, wide_model))
        gen.resume()
        gen.result(timeout=120)
        assert gen.tokens == whole.tokens
        assert whole.stats.kv_bytes < plain.stats.kv_bytes
        assert whole.stats.kv and whole.stats.batch_size == 1
    finally:
        worker.prompt_cache_gb = mlx_notebook.generation.prefix_cache.DEFAULT_PROMPT_CACHE_GB


def test_quantized_bytes_against_the_models_dtype(worker, wide_model):
    """Bytes per cached position: fp32 keys and values against 8 and 4 bits with an fp32 scale and bias per 64 values.

    Compared per position, not as totals: a plain cache's buffer holds the room
    mlx-lm's ``KVCache`` added where the prefill chunks happened to end (they
    are timed), 424-498 positions over runs of this prompt, and a ratio of the
    totals read 0.29-0.34 for the same 8-bit cache (it failed under CPU load).
    """
    import json
    from pathlib import Path

    config = json.loads((Path(wide_model) / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_position = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4  # fp32
    worker.prompt_cache_gb = 0
    try:
        plain = run(worker, wide_model)
        eight = run(worker, wide_model, kv_bits=8, quantized_kv_start=0)
        four = run(worker, wide_model, kv_bits=4, quantized_kv_start=0)
    finally:
        worker.prompt_cache_gb = mlx_notebook.generation.prefix_cache.DEFAULT_PROMPT_CACHE_GB
    held = plain.stats.prompt_tokens + len(plain.tokens) - 1
    positions, rest = divmod(plain.stats.kv_bytes, per_position)
    assert rest == 0 and positions >= held, (plain.stats.kv_bytes, per_position, held)
    for gen, bits in ((eight, 8), (four, 4)):
        # Per value: bits / 8 bytes of data, plus 2 x 4 bytes per group of 64.
        ratio = (bits / 8 + 8 / 64) / 4  # 0.28 for 8 bits, 0.16 for 4
        steps = gen.stats.kv_bytes / (per_position * ratio * 256)  # QuantizedKVCache grows 256 positions at a time
        assert steps == int(steps) and steps * 256 >= gen.stats.prompt_tokens + len(gen.tokens) - 1, (bits, steps)


def test_quantized_rows_decode_alone_beside_a_plain_batch(worker, wide_model):
    gens = [
        mlx_notebook.generate(PROMPT + str(i), model=wide_model, worker=worker, max_tokens=24, **kw)
        for i, kw in enumerate([{}, {}, {"kv_bits": 8, "quantized_kv_start": 0}])
    ]
    for gen in gens:
        gen.result(timeout=120)
    assert [g.stats.batch_size for g in gens] == [2, 2, 1]


def test_a_prefix_hit_needs_the_same_kv_settings(worker, wide_model):
    worker.prompt_cache_gb = 1
    try:
        run(worker, wide_model, kv_bits=8, quantized_kv_start=0)
        other = run(worker, wide_model, kv_bits=4, quantized_kv_start=0)
        assert other.stats.cached_tokens == 0
        same = run(worker, wide_model, kv_bits=8, quantized_kv_start=0)
        assert same.stats.cached_tokens > 0
        # A rotating cache is never kept: what it dropped cannot serve a prefix.
        run(worker, wide_model, max_kv_size=24)
        assert run(worker, wide_model, max_kv_size=24).stats.cached_tokens == 0
    finally:
        worker.prompt_cache_gb = mlx_notebook.generation.prefix_cache.DEFAULT_PROMPT_CACHE_GB


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_bits": 7}, "kv_bits must be one of 2, 3, 4, 5, 6, 8, got 7"),
        ({"kv_bits": 8.0}, "kv_bits must be one of"),
        ({"kv_group_size": 48}, "kv_group_size must be one of 32, 64, 128, got 48"),
        ({"quantized_kv_start": -1}, "quantized_kv_start must be >= 0"),
        ({"max_kv_size": 4}, "max_kv_size must be >= 5"),
        ({"kv_bits": 4, "max_kv_size": 64}, "kv_bits and max_kv_size cannot be combined"),
    ],
)
def test_bad_kv_settings_are_one_line_errors(kw, message):
    request = mlx_notebook.GenerationRequest("hi", **kw)
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(")) as info:
        request.validate()
    assert "\n" not in str(info.value)


def test_a_group_size_the_head_does_not_fit_fails_that_generation_only(worker, tiny_model):
    # The tiny model's head size is 16: no mx.quantize group fits it.
    gen = mlx_notebook.generate("hi", model=tiny_model, worker=worker, max_tokens=4, kv_bits=8)
    gen.wait(120)
    assert gen.state == "failed"
    assert "does not divide the model's head size 16: leave kv_bits unset" in str(gen.error)
    assert run(worker, tiny_model).tokens  # the model and the worker go on
