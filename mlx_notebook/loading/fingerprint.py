"""A fingerprint of a loaded model's weights: does a saved KV cache belong to this model?

A KV cache is only valid for the weights that computed it. A file saved from
one model and resumed on another (a different quantization, a fine-tune, the
same architecture with other weights) would give wrong tokens silently, so a
saved generation carries this fingerprint and a resume checks it.

Hashing every weight of an 8B model means reading 16 GB; the fingerprint
hashes, for every parameter, its name, shape and dtype and its first and
last :data:`SAMPLE` values: any other file, quantization or fine-tune changes
those, and it costs a few milliseconds.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx

# Values hashed at each end of every parameter.
SAMPLE = 64


def weights_fingerprint(model: Any) -> str:
    """A short hex digest of ``model``'s parameters (names, shapes, dtypes, sampled values)."""
    from mlx.utils import tree_flatten

    digest = hashlib.sha256()
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    params = sorted(flat, key=lambda item: item[0])
    ends: list[mx.array] = []
    for name, value in params:
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        values = value.reshape(-1)
        ends.append(mx.concatenate([values[:SAMPLE], values[-SAMPLE:]]))
    mx.eval(ends)
    for sample in ends:
        # Through the bits, whatever the dtype (numpy has no bfloat16).
        digest.update(bytes(memoryview(sample.view(_uint_of(sample.dtype)))))  # type: ignore[arg-type]
    return digest.hexdigest()[:32]


def _uint_of(dtype: mx.Dtype) -> mx.Dtype:
    return {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[dtype.size]


__all__ = ["SAMPLE", "weights_fingerprint"]
