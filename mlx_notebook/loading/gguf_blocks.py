"""GGUF tensors that ``mx.load`` cannot read, converted in budget-sized row blocks.

A file holding K-quants or IQ types (:mod:`.gguf_quants`) is not handed to
``mx.load``: each tensor is read from the byte range the checked header gives
(:mod:`.gguf_header`), a block of rows at a time, turned into MLX's affine
triplet (or copied, for float tensors) and written straight to its place in
``model.safetensors``, whose header is known before the first byte of data.
Blocks are sized from the measured rate so that one takes about the stop
budget, with a checkpoint of the load's :class:`~mlx_notebook.control.Pace`
after each: stopping a conversion waits for one block, and memory holds one
block, not the model.

No MLX here: numpy and ``gguf`` only, so this also runs before MLX parses anything.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..budget import LOAD_PIECE_SHARE
from ..control import Pace
from ..errors import ModelFormatError
from .gguf_header import FIX_DOWNLOAD, GGUFInfo, GGUFTensor
from .gguf_quants import GROUP_SIZE, TARGETS, affine_rows, packed_columns

__all__ = ["convert_blocks"]

# Small first block: its only job is to measure the rate.
FIRST_BLOCK_BYTES = 256 << 10
_FLOAT: dict[str, tuple[str, np.dtype[Any]]] = {
    "F32": ("F32", np.dtype("<f4")),
    "F16": ("F16", np.dtype("<f2")),
    "BF16": ("BF16", np.dtype("<u2")),
}
_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


@dataclass
class _Output:
    """One tensor of the safetensors file: where its rows go."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int = 0

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * _ITEM[self.dtype] if len(self.shape) > 1 else _ITEM[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM[self.dtype]


def _outputs(tensor: GGUFTensor, name: str, shift: float | None) -> list[_Output]:
    """The safetensors tensors one GGUF tensor becomes (an affine triplet, or one float tensor)."""
    if tensor.type_name in TARGETS:
        rows, cols = tensor.shape
        stem = name.removesuffix(".weight")
        bits = TARGETS[tensor.type_name].bits
        return [
            _Output(f"{stem}.weight", "U32", (rows, packed_columns(cols, bits))),
            _Output(f"{stem}.scales", "F16", (rows, cols // GROUP_SIZE)),
            _Output(f"{stem}.biases", "F16", (rows, cols // GROUP_SIZE)),
        ]
    dtype = "F32" if shift is not None else _FLOAT[tensor.type_name][0]
    return [_Output(name, dtype, tensor.shape)]


def _header(outputs: list[_Output]) -> bytes:
    """The safetensors header, padded to 8 bytes; fills in each output's start."""
    table: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    at = 0
    for out in outputs:
        out.start = at
        table[out.name] = {"dtype": out.dtype, "shape": list(out.shape), "data_offsets": [at, at + out.nbytes]}
        at += out.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class _Blocks:
    """Rows per block from the measured rate, a checkpoint after every block."""

    def __init__(self, pace: Pace, progress: Callable[[int, int], None] | None, total: int) -> None:
        self.pace, self.progress, self.total = pace, progress, total
        self.done = 0
        self.block_bytes = FIRST_BLOCK_BYTES

    def rows(self, row_bytes: int) -> int:
        return max(1, self.block_bytes // max(1, row_bytes))

    def measured(self, size: int, elapsed: float) -> None:
        target = int(size / max(elapsed, 1e-4) * self.pace.budget_s * LOAD_PIECE_SHARE)
        self.block_bytes = max(16 << 10, min(target, self.block_bytes * 4))  # at most 4x growth a block
        self.done += size
        if self.progress is not None:
            self.progress(self.done, self.total)
        self.pace.checkpoint()


def convert_blocks(
    info: GGUFInfo,
    names: dict[str, str],
    out_path: Path,
    pace: Pace,
    *,
    shifts: dict[str, float] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write every tensor of a checked file to ``out_path`` as MLX safetensors, block by block.

    Args:
        info: A header :func:`~.gguf_header.read_header` accepted.
        names: GGUF tensor name -> mlx-lm parameter name (:class:`~.gguf_model.ModelPlan`).
        out_path: The ``model.safetensors`` to write.
        pace: Checkpoint and budget of the load.
        shifts: GGUF tensor name -> a constant to add (gemma's norms, stored +1). Default: none.
        progress: Called with ``(bytes_done, bytes_total)`` of the file's tensor data. Default: ``None``.

    Raises:
        ModelFormatError: A block decodes to non-finite values (corrupt file).
        Cancelled: A stop was requested (the caller removes the partial file).
    """
    shifts = shifts or {}
    plan = [(tensor, _outputs(tensor, names[tensor.name], shifts.get(tensor.name))) for tensor in info.tensors.values()]
    header = _header([out for _, outs in plan for out in outs])
    blocks = _Blocks(pace, progress, sum(t.nbytes for t in info.tensors.values()))
    if progress is not None:
        progress(0, blocks.total)
    source = os.open(info.path, os.O_RDONLY)
    try:
        with open(out_path, "wb") as sink:
            sink.write(header)
            sink.truncate(len(header) + sum(out.nbytes for _, outs in plan for out in outs))
            for tensor, outs in plan:
                _convert_tensor(info, tensor, outs, source, sink.fileno(), len(header), blocks, shifts.get(tensor.name))
    finally:
        os.close(source)


def _convert_tensor(
    info: GGUFInfo,
    tensor: GGUFTensor,
    outs: list[_Output],
    source: int,
    sink: int,
    data_start: int,
    blocks: _Blocks,
    shift: float | None,
) -> None:
    """One tensor, rows in blocks: read, convert, write at each output's offset."""
    rows = tensor.shape[0] if len(tensor.shape) > 1 else 1
    row_bytes = tensor.nbytes // rows
    columns = math.prod(tensor.shape[1:]) if len(tensor.shape) > 1 else tensor.shape[0]
    first = 0
    while first < rows:
        count = min(rows - first, blocks.rows(row_bytes))
        t0 = time.perf_counter()
        raw = os.pread(source, count * row_bytes, tensor.offset + first * row_bytes)
        if len(raw) != count * row_bytes:  # the file shrank since its header was checked
            raise ModelFormatError(f"{info.path.name}: truncated while being read; {FIX_DOWNLOAD}")
        parts = _convert_rows(info, tensor, np.frombuffer(raw, np.uint8).reshape(count, row_bytes), columns, shift)
        for out, part in zip(outs, parts):
            os.pwrite(sink, np.ascontiguousarray(part).tobytes(), data_start + out.start + first * out.row_bytes)
        blocks.measured(count * row_bytes, time.perf_counter() - t0)
        first += count


def _convert_rows(
    info: GGUFInfo, tensor: GGUFTensor, raw: np.ndarray, columns: int, shift: float | None
) -> list[np.ndarray]:
    if tensor.type_name in TARGETS:
        triplet = affine_rows(raw, tensor.type_name, columns)
        if triplet is None:
            raise ModelFormatError(
                f"{info.path.name}: tensor '{tensor.name}' decodes to non-finite or out-of-range values "
                f"(corrupt GGUF file); {FIX_DOWNLOAD}"
            )
        return list(triplet)
    _, dtype = _FLOAT[tensor.type_name]
    values = raw.view(dtype)
    if shift is None:
        return [values]
    floats = (values.astype(np.uint32) << 16).view(np.float32) if tensor.type_name == "BF16" else values
    return [floats.astype(np.float32) + np.float32(shift)]
