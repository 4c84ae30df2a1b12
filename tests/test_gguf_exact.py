"""Every supported family's GGUF, written as llama.cpp's converter writes it, runs as mlx-lm runs the same weights.

Each file is written with ``gguf.GGUFWriter`` (testkit.gguf_writer: llama.cpp's
metadata keys, q/k permutation for the llama architecture, gemma's norms +1,
Llama 3.1's ``rope_freqs`` and Phi-4-mini's longrope factors as tensors, a
byte-level tokenizer) with random F32 weights. The converted folder must give
the logits of the same weights loaded as an ordinary mlx-lm folder, in fp32,
within 1e-4, and the same greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_notebook.loading import gguf
from testkit import gguf_writer as gw

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "phi3_partial", "gemma2", "gemma3"]
IDS = [5, 300, 700, 1200, 42, 9, 17, 1000]
VOCAB = 1536  # small: the tokenizer is not what these tests compare
TOLERANCE = 1e-4


def _reference(folder: Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> Any:
    """The same weights as a plain mlx-lm folder (float32)."""
    from mlx_lm.utils import load_model

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return load_model(folder)[0]


def _logits(model: Any, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def greedy(model: Any, ids: list[int], steps: int = 8) -> list[int]:
    """Greedy tokens, the whole sequence recomputed each step (no cache to differ in)."""
    out = list(ids)
    for _ in range(steps):
        out.append(int(_logits(model, out)[-1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_gguf_matches_mlx_lm(tmp_path: Path, family: str) -> None:
    from mlx_lm.utils import load_model

    config, weights = gw.family_weights(family, vocab=VOCAB)
    path = gw.write_family_gguf(tmp_path / f"{family}.gguf", family, config, weights, dtype="F32")
    folder = gguf.convert_gguf(path, tmp_path / "converted")
    converted, _ = load_model(folder)
    reference = _reference(tmp_path / "reference", config, weights)
    got, want = _logits(converted, IDS), _logits(reference, IDS)
    diff = float(np.abs(got - want).max())
    print(f"{family}: max logit difference {diff:.2e} (max |logit| {np.abs(want).max():.1f})")
    assert diff <= TOLERANCE, diff
    assert greedy(converted, IDS) == greedy(reference, IDS)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("family", "expect"),
    [
        ("llama", {"rope_traditional": True, "rope_scaling": gw.LLAMA3_SCALING}),
        ("mistral", {"rope_traditional": True}),
        ("qwen3", {"rope_traditional": False, "head_dim": 32}),
        ("phi3", {"rope_traditional": False}),
        ("phi3_partial", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096}),
        ("gemma2", {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
        (
            "gemma3",
            {
                "model_type": "gemma3_text",
                "rope_local_base_freq": 10000.0,
                "sliding_window": 512,
                "rope_scaling": {"type": "linear", "factor": 8.0},
            },
        ),
    ],
)
def test_rotary_and_family_settings_reach_the_config(tmp_path: Path, family: str, expect: dict[str, Any]) -> None:
    """A unit test per family: what the header says is in the config mlx-lm reads."""
    config, weights = gw.family_weights(family, vocab=VOCAB)
    path = gw.write_family_gguf(tmp_path / f"{family}.gguf", family, config, weights)
    plan = gguf.plan_model(gguf.check_gguf(path))
    for key, value in expect.items():
        got = plan.config.get(key)
        if isinstance(value, dict):
            assert got is not None and {k: got.get(k) for k in value if k != "rope_type"} == {
                k: pytest.approx(v) for k, v in value.items() if k != "rope_type"
            }, got
        else:
            assert got == value, (key, got)
    assert "partial_rotary_factor" not in plan.config or family == "phi3_partial"
    if family == "phi3_partial":
        scaling = plan.config["rope_scaling"]
        assert scaling["type"] == "longrope"
        np.testing.assert_allclose(scaling["long_factor"], config["rope_scaling"]["long_factor"], rtol=1e-6)
        np.testing.assert_allclose(scaling["short_factor"], config["rope_scaling"]["short_factor"], rtol=1e-6)
    if family.startswith("gemma"):
        assert plan.shifts and all(v == -1.0 for v in plan.shifts.values())
        assert set(plan.shifts) == {n for n in plan.names if n.endswith("norm.weight")}


@pytest.mark.unit
def test_yarn_scaling_reaches_the_config(tmp_path: Path) -> None:
    import gguf as gg

    config, weights = gw.family_weights("qwen3", vocab=VOCAB)
    path = tmp_path / "yarn.gguf"
    gw.write_family_gguf(path, "qwen3", config, weights)
    # Qwen3 with YaRN (factor 4 over 32k), as llama.cpp's converter writes it.
    reader = gg.GGUFReader(path)
    writer = gg.GGUFWriter(str(tmp_path / "yarn2.gguf"), "qwen3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        writer.add_key_value(
            field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    writer.add_rope_scaling_type(gg.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(32768)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plan = gguf.plan_model(gguf.check_gguf(tmp_path / "yarn2.gguf"))
    assert plan.config["rope_scaling"] == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert plan.config["original_max_position_embeddings"] == 32768


@pytest.mark.unit
def test_partial_rotary_on_a_family_without_it_is_refused(tmp_path: Path) -> None:
    from mlx_notebook.errors import ModelFormatError

    config, weights = gw.family_weights("qwen2", vocab=VOCAB)
    config["partial_rotary_factor"] = 0.5  # qwen2 in mlx-lm rotates whole heads
    path = gw.write_family_gguf(tmp_path / "partial.gguf", "qwen2", config, weights)
    with pytest.raises(
        ModelFormatError, match="rotates 8 of 16 head dimensions, which mlx-lm's 'qwen2' model cannot; "
    ):
        gguf.check_gguf(path)
