"""Evaluate a model's weights in pieces that each fit the stop budget.

Loading builds the model with lazy weights; here its parameters are
evaluated in batches sized from the measured read rate so that one batch
takes about the budget, with a checkpoint between batches: stopping a load
takes one batch, not the whole model. Weights larger than a batch are read
in row blocks (:mod:`.weight_blocks`), and the CPU fast path dequantizes in
row blocks the same way.

Everything here runs on the worker thread (MLX streams belong to threads).
This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..budget import LOAD_PIECE_SHARE
from ..control import Pace
from . import weight_blocks
from .policy import float32_bytes

ProgressCallback = Callable[[int, int], None]

# Small first batch: its only job is to measure the rate.
FIRST_BATCH_BYTES = 4 << 20
MIN_BATCH_BYTES = 1 << 20
# Small blocks: the batch evaluator groups them up to its budget.
DEQUANTIZE_BLOCK_BYTES = 1 << 20


class BatchEvaluator:
    """Evaluates lazy arrays in batches sized so that one batch takes about ``pace.budget_s``.

    The batch size adapts to the bytes per second measured on the previous
    batch, so a stop waits for one batch at most; there is a checkpoint after
    every batch, and ``progress(done, total)`` with the bytes counted so far.

    Args:
        pace: The generation's pace (checkpoint and budget).
        progress: Called with ``(bytes_done, bytes_total)``. Default: ``None``.
        total: Bytes the whole job will count. Default: ``0``.
    """

    def __init__(self, pace: Pace, *, progress: ProgressCallback | None = None, total: int = 0) -> None:
        self.pace = pace
        self.progress = progress
        self.total = total
        self.done = 0
        self.batch_bytes = FIRST_BATCH_BYTES

    def run(self, arrays: list[mx.array], *, counted: bool = True) -> None:
        """Evaluate ``arrays``.

        Args:
            counted: Their bytes are new bytes of the model: they count towards
              progress and their rate sizes the next batch. A join of blocks
              (a copy at memory bandwidth, ~100x a file read's rate on a GPU) is
              not counted: sizing the next reads from its rate made them run 4x
              over the budget (measured on an H200). Default: ``True``.
        """
        i = 0
        while i < len(arrays):
            batch: list[mx.array] = []
            size = 0
            while i < len(arrays) and (not batch or size + arrays[i].nbytes <= self.batch_bytes):
                batch.append(arrays[i])
                size += arrays[i].nbytes
                i += 1
            t0 = time.perf_counter()
            mx.eval(batch)
            self._measured(size, time.perf_counter() - t0, counted)

    def read_blocks(self, stored: weight_blocks.StoredTensor) -> mx.array:
        """Read one stored tensor in row blocks of about a batch each, then join them."""
        rows, row_bytes = stored.shape[0], stored.row_bytes
        blocks: list[mx.array] = []
        fd = os.open(stored.path, os.O_RDONLY)
        try:
            first = 0
            while first < rows:
                count = max(1, min(rows - first, self.batch_bytes // row_bytes))
                t0 = time.perf_counter()
                blocks.append(weight_blocks.read_rows(fd, stored, first, count))
                self._measured(count * row_bytes, time.perf_counter() - t0, counted=True)
                first += count
        finally:
            os.close(fd)
        joined = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)
        del blocks
        self.run([joined], counted=False)  # the join: a device copy, no new bytes
        return joined

    def _measured(self, size: int, elapsed: float, counted: bool) -> None:
        """Size the next batch from this one's rate, report progress, checkpoint."""
        if counted:
            elapsed = max(elapsed, 1e-4)
            # At most 4x growth per batch: a rate measured on small tensors may not hold for large ones.
            target = int(size / elapsed * self.pace.budget_s * LOAD_PIECE_SHARE)
            self.batch_bytes = max(MIN_BATCH_BYTES, min(target, self.batch_bytes * 4))
            self.done += size
            if self.progress is not None:
                self.progress(self.done, self.total)
        self.pace.checkpoint()


def parameters_of(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The model's parameters as ``(dotted name, array)`` pairs."""
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def evaluate_parameters(
    model: nn.Module,
    pace: Pace,
    *,
    progress: ProgressCallback | None = None,
    stored: dict[str, weight_blocks.StoredTensor] | None = None,
) -> int:
    """Evaluate a lazily loaded model's parameters in budget-sized batches.

    Args:
        model: The model, its weights lazy.
        pace: Checkpoint and budget of the load.
        progress: Called with ``(bytes_done, bytes_total)``. Default: ``None``.
        stored: Where the parameters are in the model's safetensors files
          (:func:`weight_blocks.index_folder`): a parameter larger than one
          batch is then read in row blocks instead of in one piece.
          Default: ``None`` (every parameter in one piece).

    Returns:
        The total bytes of parameters.
    """
    named = parameters_of(model)
    total = sum(p.nbytes for _, p in named)
    if progress is not None:
        progress(0, total)
    evaluator = BatchEvaluator(pace, progress=progress, total=total)
    pending: list[mx.array] = []
    replaced: list[tuple[str, Any]] = []
    for name, param in named:
        place = stored.get(name) if stored else None
        if place is not None and param.nbytes > evaluator.batch_bytes and place.matches(param):
            evaluator.run(pending)
            pending = []
            replaced.append((name, evaluator.read_blocks(place)))
        else:
            pending.append(param)
    evaluator.run(pending)
    if replaced:
        model.update(tree_unflatten(replaced))
    return total


def dequantize_to_float32(model: nn.Module, pace: Pace, *, progress: ProgressCallback | None = None) -> None:
    """Replace quantized linear and embedding layers by float32 ones, in row blocks.

    ``mlx_lm.utils.dequantize_model`` makes each weight one lazy array: the
    default model's 49,152 x 576 embedding then dequantizes in a single
    evaluation (~0.8 s on a 2-core CPU) that a stop has to wait for. Here each
    weight is dequantized in blocks of rows evaluated in budget-sized batches,
    then joined (one copy).

    Args:
        model: A model with quantized layers, its weights evaluated.
        pace: Checkpoint and budget of the load.
        progress: Called with ``(bytes_done, bytes_total)``. Default: ``None``.
    """
    # Largest first: the first batches are small while the rate is unknown, and
    # the largest weight (the embedding) runs slowest per byte (fresh pages;
    # the smaller ones reuse freed buffers), so a rate learned on the small
    # ones would size its batches ~4x over the budget.
    targets = sorted(
        ((name, m) for name, m in model.named_modules() if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)),
        key=lambda item: -item[1].weight.size,
    )
    total = sum(float32_bytes(m) for _, m in targets)
    evaluator = BatchEvaluator(pace, progress=progress, total=total)
    replaced: list[tuple[str, nn.Module]] = []
    for name, m in targets:
        rows = m.weight.shape[0]
        row_bytes = float32_bytes(m) // rows
        step = max(1, DEQUANTIZE_BLOCK_BYTES // row_bytes)
        blocks = [
            mx.dequantize(
                m.weight[r : r + step],
                m.scales[r : r + step],
                None if getattr(m, "biases", None) is None else m.biases[r : r + step],
                m.group_size,
                m.bits,
                m.mode,
            ).astype(mx.float32)
            for r in range(0, rows, step)
        ]
        evaluator.run(blocks)
        weight = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)
        del blocks
        evaluator.run([weight], counted=False)  # the join: a copy, no new bytes
        layer: nn.Module
        if isinstance(m, nn.QuantizedEmbedding):
            layer = nn.Embedding(*weight.shape)
        else:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias
        layer.weight = weight
        replaced.append((name, layer))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
