"""GGUF files of other families than llama: Qwen2, Qwen3 and Mistral (Nemo).

Each file is written with ``gguf``'s own ``GGUFWriter`` the way llama.cpp's
converter writes that family (tensor names from gguf's map, q/k rows permuted
for the llama architecture), with random weights and a real-size byte-level
tokenizer (testkit.real_tokenizer). The converted model must compute what the
same weights compute as an ordinary mlx-lm folder, tokenize like the source
tokenizer, generate through the worker, and through ``%%mlxgen -m file.gguf``
in a real kernel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import mlx_notebook
from mlx_notebook.loading import gguf
from mlx_notebook.loading.names import cache_dir
from testkit import gguf_writer as gw
from testkit.kernel_helpers import start_kernel

FAMILIES = ["qwen2", "qwen3", "mistral"]
IDS = [5, 300, 7000, 120000, 42, 9]
TEXTS = ["Hello world! 123 and 4567.", "  spaces\tand\nnewlines  ", "don't we'll they've", "Zürich über 東京 ok"]


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any], dict[str, Any]]]:
    """family -> (the .gguf file, its config, its weights by Hugging Face name)."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        config, weights = gw.family_weights(family)
        out[family] = (gw.write_family_gguf(folder / f"{family}.gguf", family, config, weights), config, weights)
    return out


@pytest.fixture(scope="module")
def converted(families: dict) -> dict[str, Path]:
    """family -> its GGUF converted once (~7 s each on a 2-core CPU), into the cache the worker and kernels read.

    So the tests that generate from the ``.gguf`` file (the worker here, ``%%mlxgen -m``
    in a kernel) find it converted instead of converting it again.
    """
    return {family: gguf.cached_conversion(families[family][0], cache_dir()) for family in FAMILIES}


def _reference_logits(folder: Path, config: dict[str, Any], weights: dict[str, Any]) -> np.ndarray:
    """The same weights (rounded to float16, as the file stores them) as a plain mlx-lm folder."""
    from mlx_lm.utils import load_model

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    arrays = {k: mx.array(v.astype(np.float16) if v.ndim == 2 else v) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), arrays)
    model, _ = load_model(folder)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_converts_to_the_same_model(tmp_path: Path, families: dict, converted: dict, family: str) -> None:
    from mlx_lm.utils import load_model

    _, config, weights = families[family]
    folder = converted[family]
    written = json.loads((folder / "config.json").read_text())
    assert written["model_type"] == config["model_type"]
    assert written["head_dim"] == config["head_dim"]  # Qwen3: 32, not hidden / heads = 16
    # Only the llama architecture has its q/k rows permuted by llama.cpp.
    assert written["rope_traditional"] == (family == "mistral")
    assert written["tie_word_embeddings"] == config["tie_word_embeddings"]
    model, _ = load_model(folder)
    got = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    want = _reference_logits(tmp_path / "reference", config, weights)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_tokenizer_matches_the_source(converted: dict, family: str) -> None:
    from tokenizers import Tokenizer

    source = Tokenizer.from_str(json.dumps(gw.family_tokenizer(family)))
    read = Tokenizer.from_file(str(converted[family] / "tokenizer.json"))
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert read.encode(text).ids == source.encode(text).ids, text


def test_mistral_tokenizer_and_template(converted: dict) -> None:
    import mlx_lm

    _, tok = mlx_lm.load(str(converted["mistral"]), lazy=True)
    ids = tok.encode("[INST]hi[/INST]")
    assert tok.convert_ids_to_tokens([ids[0], ids[1], ids[-1]]) == [
        "<s>",
        "[INST]",
        "[/INST]",
    ]  # add_bos, specials whole
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "</s>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s>[INST]hi[/INST]"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_generates(families: dict, converted: dict, family: str, worker: mlx_notebook.Worker) -> None:
    gen = mlx_notebook.generate("Name three rivers.", model=str(families[family][0]), max_tokens=6, worker=worker)
    gen.result(timeout=600)
    assert gen.state == "done", gen.error
    assert len(gen.tokens) >= 1


@pytest.mark.kernel
def test_mlxgen_magic_runs_family_ggufs_in_a_kernel(families: dict, converted: dict) -> None:
    with start_kernel() as session:
        for family in ("qwen3", "mistral"):
            path = families[family][0]
            reply = session.execute(f"%%mlxgen -m {path} -n 5 --wait -o out_{family}\nName three rivers.", timeout=600)
            assert reply.ok, reply.content
            assert session.eval(f"out_{family}.state") == "done", session.eval(f"str(out_{family}.error)")
            assert len(session.eval(f"out_{family}.tokens")) >= 1
