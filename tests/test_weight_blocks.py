"""Large weights read in row blocks during a load (``weight_blocks``, ``budgeted.evaluate_parameters``).

The blocks must join into exactly the tensors mlx-lm loads, a stop between
blocks must end the load with nothing kept, and the path must be used where
it is meant to be (GPU streams, model types whose weights are the file's
tensors) and nowhere else.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from conftest import needs_default_model
from mlx.utils import tree_flatten
from test_default_model import QUESTION

import mlx_notebook
from mlx_notebook.control import Cancelled, CancelToken, Pace
from mlx_notebook.loading import budgeted, policy, store, weight_blocks
from testkit.tiny_model import make_tiny_model


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def tiny_folder(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", dtype=request.param)


@pytest.fixture
def small_batches(monkeypatch):
    """Batches of a few KiB (with a tiny budget), so the tiny model's weights split into many blocks."""
    monkeypatch.setattr(budgeted, "FIRST_BATCH_BYTES", 4 << 10)
    monkeypatch.setattr(budgeted, "MIN_BATCH_BYTES", 4 << 10)
    monkeypatch.setenv("MLX_NOTEBOOK_BLOCK_LOAD", "1")


def count_reads(monkeypatch) -> list:
    reads = []
    real = weight_blocks.read_rows

    def spy(fd, stored, first, count):
        reads.append((stored.path, first, count))
        return real(fd, stored, first, count)

    monkeypatch.setattr(weight_blocks, "read_rows", spy)
    return reads


def test_blocks_join_into_the_tensors_mlx_lm_loads(tiny_folder: Path, small_batches, monkeypatch) -> None:
    from mlx_lm.utils import load_model

    reads = count_reads(monkeypatch)
    seen = []
    loaded = store.ModelStore().get(
        str(tiny_folder), Pace(CancelToken(), 1e-6), progress=lambda d, t: seen.append((d, t))
    )
    reference, _ = load_model(tiny_folder)
    ours = dict(tree_flatten(loaded.model.parameters()))
    theirs = dict(tree_flatten(reference.parameters()))
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype and mx.array_equal(value, theirs[name]).item(), name
    # The embedding (384 x 64) was read in several blocks, not once.
    embedding = [r for r in reads if r[2] < 384]
    assert len(reads) > 10 and len(embedding) >= 3, reads
    assert seen[-1][0] == seen[-1][1] == loaded.nbytes
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    tokens = mx.array([[1, 5, 9, 2]])
    assert mx.array_equal(loaded.model(tokens), reference(tokens)).item()


def test_stop_between_blocks_keeps_nothing(tiny_folder: Path, small_batches, monkeypatch) -> None:
    reads = count_reads(monkeypatch)
    models = store.ModelStore()
    token = CancelToken()
    seen = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if len(reads) == 3:
            token.cancel()

    with pytest.raises(Cancelled):
        models.get(str(tiny_folder), Pace(token, 1e-6), progress=progress)
    assert len(reads) == 3, "the stop should land at the checkpoint after the block being read"
    assert models.loaded() == []
    assert seen[-1] < seen[0] + 3 * (4 << 10) + 1, seen
    # The next load starts over and gives the whole model.
    loaded = models.get(str(tiny_folder), Pace(CancelToken(), 1e-6))
    assert len(reads) > 6 and models.loaded() == [loaded]


def test_not_used_on_cpu_by_default_nor_for_other_model_types(monkeypatch) -> None:
    monkeypatch.delenv("MLX_NOTEBOOK_BLOCK_LOAD", raising=False)
    with mx.stream(mx.cpu):
        assert not policy.read_in_blocks({"model_type": "llama"})
    monkeypatch.setenv("MLX_NOTEBOOK_BLOCK_LOAD", "1")
    assert policy.read_in_blocks({"model_type": "llama"})
    # A family whose sanitize may transform a weight under its own name.
    assert not policy.read_in_blocks({"model_type": "mixtral"})
    monkeypatch.setenv("MLX_NOTEBOOK_BLOCK_LOAD", "0")
    assert not policy.read_in_blocks({"model_type": "llama"})


def test_a_stored_tensor_only_matches_its_own_shape_and_dtype(tiny_folder: Path) -> None:
    index = weight_blocks.index_folder(tiny_folder)
    stored = index["model.embed_tokens.weight"]
    dtype = _dtype_of(stored)
    assert stored.matches(mx.zeros(stored.shape, dtype))
    assert not stored.matches(mx.zeros(stored.shape[::-1], dtype))
    assert not stored.matches(mx.zeros(stored.shape, mx.float16))
    # One row of the file is what mlx-lm's own lazy load gives for it.
    with open(stored.path, "rb") as f:
        row = weight_blocks.read_rows(f.fileno(), stored, 7, 2)
    whole = mx.load(stored.path)["model.embed_tokens.weight"]
    assert mx.array_equal(row, whole[7:9]).item()


def _dtype_of(stored: weight_blocks.StoredTensor):
    return {"F32": mx.float32, "BF16": mx.bfloat16}[stored.dtype]


def test_a_join_does_not_size_the_next_reads() -> None:
    # A join is a copy at memory bandwidth; sizing file reads from its rate
    # made the next blocks run 4x over the budget on an H200.
    evaluator = budgeted.BatchEvaluator(Pace(CancelToken(), 0.01))
    before = evaluator.batch_bytes
    evaluator.run([mx.concatenate([mx.ones((256, 1024)), mx.ones((256, 1024))])], counted=False)
    assert evaluator.batch_bytes == before and evaluator.done == 0
    evaluator.run([mx.ones((256, 1024))])
    assert evaluator.done == 256 * 1024 * 4


@needs_default_model
def test_the_default_model_read_in_blocks_gives_the_same_tokens(small_batches, monkeypatch) -> None:
    # Kept 4-bit (as on an Apple GPU, where the block path is on by default):
    # packed uint32 weights, scales and biases, each split along its rows.
    monkeypatch.setenv("MLX_NOTEBOOK_CPU_DEQUANTIZE", "0")
    reads = count_reads(monkeypatch)
    tokens = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("MLX_NOTEBOOK_BLOCK_LOAD", mode)
        worker = mlx_notebook.Worker()
        try:
            worker.load_model()
            gen = mlx_notebook.generate(QUESTION, max_tokens=12, worker=worker)
            gen.result(timeout=300)
            tokens[mode] = gen.tokens
        finally:
            assert worker.shutdown(timeout=60)
        if mode == "1":
            # Read in blocks: some tensors in several (a block starting past row 0).
            assert len(reads) >= 3 and any(first > 0 for _, first, _ in reads), reads
    assert tokens["1"] == tokens["0"] and len(tokens["1"]) >= 5, tokens
