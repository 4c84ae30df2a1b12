"""The CPU fast path's block-wise dequantization (``budgeted.dequantize_to_float32``).

It must give exactly the weights mlx-lm's ``dequantize_model`` gives, and a stop
in the middle must leave the model as it was: still quantized, still usable.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_notebook.control import Cancelled, CancelToken, Pace
from mlx_notebook.loading import budgeted


def quantized_tiny(folder: str):
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("block_bytes", [1 << 10, 1 << 20])
def test_same_weights_as_mlx_lm(tiny_model: str, monkeypatch, block_bytes: int) -> None:
    from mlx_lm.utils import dequantize_model

    # 1 KiB blocks split every weight of the tiny model into several blocks.
    monkeypatch.setattr(budgeted, "DEQUANTIZE_BLOCK_BYTES", block_bytes)
    ours, theirs = quantized_tiny(tiny_model), quantized_tiny(tiny_model)
    budgeted.dequantize_to_float32(ours, Pace(CancelToken(), 0.01))
    dequantize_model(theirs)
    theirs.set_dtype(mx.float32)

    kinds = {type(m).__name__ for _, m in ours.named_modules()}
    assert "QuantizedLinear" not in kinds and "QuantizedEmbedding" not in kinds, kinds
    ours_params, theirs_params = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
    assert ours_params.keys() == theirs_params.keys()
    for name, value in ours_params.items():
        assert value.dtype == theirs_params[name].dtype == mx.float32, name
        assert mx.array_equal(value, theirs_params[name]).item(), name
    tokens = mx.array([[1, 5, 9, 2]])
    assert mx.array_equal(ours(tokens), theirs(tokens)).item()


def test_stop_midway_leaves_the_model_quantized_and_usable(tiny_model: str, monkeypatch) -> None:
    monkeypatch.setattr(budgeted, "DEQUANTIZE_BLOCK_BYTES", 1 << 10)
    model = quantized_tiny(tiny_model)
    tokens = mx.array([[1, 5, 9, 2]])
    before = model(tokens)
    token = CancelToken()
    seen = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if len(seen) == 2:
            token.cancel()

    with pytest.raises(Cancelled):
        budgeted.dequantize_to_float32(model, Pace(token, 0.01), progress=progress)
    # The stop landed at the next checkpoint, within the third weight, long before the end.
    assert len(seen) == 2 and seen[-1][0] < seen[-1][1] / 4, seen
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert mx.array_equal(model(tokens), before).item()
