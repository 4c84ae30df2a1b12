"""K-quant and IQ GGUF files: converted block by block, stoppable, and as close to gguf's values as the bits say.

``gguf`` dequantizes K-quants but cannot quantize them, so the blocks are written
directly (testkit.gguf_writer.random_blocks: random bytes, sane float16 scales).
A Q4_K_M-style file (Q4_K, with Q6_K for the embedding, attn_v and ffn_down as
llama.cpp's Q4_K_M mix does) and a Q5_K file of a qwen3-shaped model are
compared with an F32 file holding gguf's own dequantization of the same blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import mlx_notebook
from mlx_notebook.control import Cancelled, CancelToken, Pace
from mlx_notebook.errors import ModelFormatError
from mlx_notebook.loading import gguf
from mlx_notebook.loading.gguf_quants import GROUP_SIZE, TARGETS, affine_rows
from testkit import gguf_writer as gw

REPO = Path(__file__).resolve().parents[1]
IDS = [5, 300, 700, 1200, 42, 9, 17, 1000]
SHAPE = dict(hidden=256, intermediate=512, vocab=2048, head_dim=64)  # K-quant rows: multiples of 256


def _mlx_values(raw: np.ndarray, type_name: str, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Our triplet for the rows, dequantized by MLX (in float16, the scales' dtype), its scales and biases."""
    triplet = affine_rows(raw, type_name, columns)
    assert triplet is not None
    weight, scales, biases = (mx.array(a) for a in triplet)
    values = mx.dequantize(weight, scales, biases, group_size=GROUP_SIZE, bits=TARGETS[type_name].bits)
    return np.array(values.astype(mx.float32)), np.array(scales.astype(mx.float32)), np.array(biases.astype(mx.float32))


@pytest.mark.unit
@pytest.mark.parametrize("type_name", sorted(gw.F16_FIELDS))
def test_each_type_becomes_an_mlx_triplet_within_its_bound(type_name: str) -> None:
    raw = gw.random_blocks((8, 512), type_name, seed=3)
    want = gw.dequantized(raw, type_name)
    got, scales, biases = _mlx_values(raw, type_name, 512)
    err = np.abs(got - want).reshape(8, -1, GROUP_SIZE)
    levels = 2 ** TARGETS[type_name].bits - 1
    # float16: the scale and bias as stored (2^-11 of each, the scale times q) and the dequantized value.
    rounding = (scales * levels + np.abs(biases))[..., None] * 2.0**-11 + np.abs(want).reshape(err.shape) * 2.0**-10
    if TARGETS[type_name].exact:
        bound = rounding + 1e-7
    else:
        # Re-quantized: half a step of the group's grid, plus the rounding.
        bound = scales[..., None] * 0.5 + rounding + 1e-7
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.unit
def test_non_finite_blocks_are_refused() -> None:
    raw = gw.random_blocks((2, 256), "Q4_K")
    raw[0, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    assert affine_rows(raw, "Q4_K", 256) is None


# ------------------------------------------------------- whole models


def _explained(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The values our triplet holds, computed in float32 (what re-quantization leaves)."""
    triplet = affine_rows(raw, type_name, shape[1])
    assert triplet is not None
    weight, scales, biases = triplet
    values = mx.dequantize(
        mx.array(weight),
        mx.array(scales.astype(np.float32)),
        mx.array(biases.astype(np.float32)),
        group_size=GROUP_SIZE,
        bits=TARGETS[type_name].bits,
    )
    return np.array(values)


def _qwen3(tmp_path: Path, name: str, types: dict[str, str]) -> tuple[Path, Path, Path]:
    """A K-quant file, its F32 twin (gguf's dequantization of the same blocks), and an F32
    file of the values our triplets hold (gguf's, re-quantized)."""
    config, weights = gw.family_weights("qwen3", **SHAPE)
    blocks, explained = {}, dict(weights)
    for i, (hf_name, array) in enumerate(weights.items()):
        if array.ndim == 2:
            kind = next((t for key, t in types.items() if key in hf_name), types["*"])
            blocks[hf_name] = (kind, gw.random_blocks(array.shape, kind, seed=i))
            weights[hf_name] = gw.dequantized(blocks[hf_name][1], kind).reshape(array.shape)
            explained[hf_name] = _explained(blocks[hf_name][1], kind, array.shape)
    quantized = gw.write_family_gguf(tmp_path / f"{name}.gguf", "qwen3", config, weights, blocks=blocks)
    twin = gw.write_family_gguf(tmp_path / f"{name}-f32.gguf", "qwen3", config, weights, dtype="F32")
    ours = gw.write_family_gguf(tmp_path / f"{name}-ours.gguf", "qwen3", config, explained, dtype="F32")
    return quantized, twin, ours


# llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output/embedding, attn_v and ffn_down (half of them
# in the real mix; all here, so both types are in every layer).
Q4_K_M = {"embed_tokens": "Q6_K", "v_proj": "Q6_K", "down_proj": "Q6_K", "*": "Q4_K"}
Q5_K = {"*": "Q5_K"}


def _model(folder: Path) -> Any:
    from mlx_lm.utils import load_model

    return load_model(folder)[0]


def _logits(model: Any) -> np.ndarray:
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


@pytest.mark.parametrize(("name", "types"), [("q4_k_m", Q4_K_M), ("q5_k", Q5_K)])
def test_kquant_file_agrees_with_gguf_dequantization(tmp_path: Path, name: str, types: dict[str, str]) -> None:
    from test_gguf_exact import greedy

    quantized, twin, ours = _qwen3(tmp_path, name, types)
    kq = _model(gguf.convert_gguf(quantized, tmp_path / "kq"))
    ref = _model(gguf.convert_gguf(twin, tmp_path / "f32"))
    requantized = _model(gguf.convert_gguf(ours, tmp_path / "ours"))
    config = json.loads((tmp_path / "kq" / "config.json").read_text())
    bits = {TARGETS[t].bits for t in types.values()}
    assert config["quantization"]["bits"] in bits and config["quantization"]["group_size"] == 32
    got, want, explained = _logits(kq), _logits(ref), _logits(requantized)
    diff = float(np.abs(got - want).max())
    rest = float(np.abs(got - explained).max())
    print(
        f"{name}: max logit difference vs gguf's dequantization {diff:.2e} (max |logit| {np.abs(want).max():.1f}); "
        f"vs the re-quantized values in F32 {rest:.2e}"
    )
    # Re-quantization explains the difference: with its values in F32, what is left is the
    # float16 arithmetic of the quantized kernels (measured: Q5_K 1.9e-5, Q4_K_M 5.4e-3 of 6.0).
    assert rest <= 2e-3 * np.abs(want).max()
    assert diff <= 0.02 * np.abs(want).max()
    tokens_kq, tokens_ref = greedy(kq, IDS), greedy(ref, IDS)
    print(f"{name}: greedy tokens {'equal' if tokens_kq == tokens_ref else 'differ'}: {tokens_kq} vs {tokens_ref}")
    assert tokens_kq == greedy(requantized, IDS)
    if name == "q5_k":  # exact but for float16 scales
        assert tokens_kq == tokens_ref


def test_kquant_file_generates_through_the_worker(tmp_path: Path, worker: mlx_notebook.Worker) -> None:
    quantized = _qwen3(tmp_path, "gen", Q4_K_M)[0]
    gen = mlx_notebook.generate("Name three rivers.", model=str(quantized), max_tokens=5, worker=worker)
    gen.result(timeout=600)
    assert gen.state == "done", gen.error
    assert len(gen.tokens) >= 1


def test_stop_during_block_conversion_keeps_nothing(tmp_path: Path) -> None:
    quantized = _qwen3(tmp_path, "stop", Q4_K_M)[0]
    token = CancelToken()
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if len(seen) == 4:
            token.cancel()

    cache = tmp_path / "cache"
    with pytest.raises(Cancelled):
        gguf.cached_conversion(quantized, cache, pace=Pace(token, 0.02), progress=progress)
    assert len(seen) == 4 and seen[0][0] == 0 and seen[-1][0] < seen[-1][1]
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
    done: list[tuple[int, int]] = []
    folder = gguf.cached_conversion(quantized, cache, progress=lambda d, t: done.append((d, t)))
    assert done[-1][0] == done[-1][1] and all(a[0] <= b[0] for a, b in zip(done, done[1:]))
    assert gguf.cached_conversion(quantized, cache) == folder  # kept


# ------------------------------------------------ mutated K-quant files

_CHILD = textwrap.dedent("""
    import json, sys
    from mlx_notebook.loading import gguf
    from mlx_notebook.errors import ModelFormatError
    outcome = {}
    for path in sys.argv[1:]:
        try:
            gguf.convert_gguf(path, path + ".out")
            outcome[path] = "ok"
        except ModelFormatError:
            outcome[path] = "rejected"
        except Exception as exc:
            outcome[path] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(outcome))
""")


def mutate(data: bytes, rng: np.random.Generator, interesting: list[int], data_start: int) -> bytes:
    """1-3 random bytes changed: near a header field, anywhere in the header, or in the blocks."""
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        where = rng.random()
        if where < 0.4:
            at = int(rng.choice(interesting)) + int(rng.integers(0, 16))
        elif where < 0.7:
            at = int(rng.integers(0, data_start))
        else:
            at = int(rng.integers(data_start, len(out)))
        out[min(at, len(out) - 1)] = int(rng.integers(0, 256))
    return bytes(out)


def test_mutated_kquant_files_never_crash(tmp_path: Path) -> None:
    """Random byte flips in K-quant files (header and blocks): each is rejected or converts; none crash."""
    config, weights = gw.family_weights("qwen3", hidden=256, intermediate=256, vocab=512, layers=1, head_dim=64)
    blocks = {
        n: ("Q6_K" if "down" in n else "Q4_K", gw.random_blocks(a.shape, "Q6_K" if "down" in n else "Q4_K", i))
        for i, (n, a) in enumerate(weights.items())
        if a.ndim == 2
    }
    source = gw.write_family_gguf(tmp_path / "source.gguf", "qwen3", config, weights, blocks=blocks)
    data = source.read_bytes()
    info = gguf.check_gguf(source)
    interesting = [4, 8, 16, info.data_offset - 64, *(t.offset for t in info.tensors.values())]
    rng = np.random.default_rng(2024)
    paths = []
    for i in range(40):
        paths.append(tmp_path / f"mutated{i}.gguf")
        paths[-1].write_bytes(mutate(data, rng, interesting, info.data_offset))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, paths)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"child crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(outcome.values()) <= {"ok", "rejected"}, {
        k: v for k, v in outcome.items() if v not in ("ok", "rejected")
    }
    print(
        f"mutated K-quant files: {list(outcome.values()).count('ok')} converted, "
        f"{list(outcome.values()).count('rejected')} rejected, 0 crashes"
    )


@pytest.mark.unit
def test_unsupported_type_is_refused_in_one_line(tmp_path: Path) -> None:
    config, weights = gw.family_weights("qwen3", hidden=256, intermediate=256, vocab=512, layers=1, head_dim=64)
    raw = gw.random_blocks(weights["model.layers.0.mlp.up_proj.weight"].shape, "Q4_K")
    path = gw.write_family_gguf(
        tmp_path / "tq.gguf", "qwen3", config, weights, blocks={"model.layers.0.mlp.up_proj.weight": ("Q4_K", raw)}
    )
    data = bytearray(path.read_bytes())
    # Re-label that tensor TQ2_0 (same 256-value blocks, other size): refused before any read.
    import gguf as gg

    reader = gg.GGUFReader(path)
    field = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    at = int(field.field.offset) + 8 + len(field.name.encode()) + 4 + 8 * len(field.shape)
    assert int.from_bytes(data[at : at + 4], "little") == gg.GGMLQuantizationType.Q4_K
    data[at : at + 4] = int(gg.GGMLQuantizationType.TQ2_0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError) as caught:
        gguf.check_gguf(path)
    message = str(caught.value)
    assert "\n" not in message and "has type TQ2_0, which mlx-notebook cannot read; use a Q4_K_M" in message, message
