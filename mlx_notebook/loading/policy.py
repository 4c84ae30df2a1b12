"""Device policies of a load: dequantize for OpenBLAS on the CPU, read big weights in blocks on GPUs.

Both are ``auto`` / ``1`` / ``0`` environment switches with an ``auto`` that
picks by device and model; the reasons and measurements are in each docstring.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from . import blas, weight_blocks

# Dequantized copies above this size stay quantized: the fast path is for small
# models, where fp32 weights fit easily and prefill is BLAS-bound.
CPU_DEQUANTIZE_MAX_BYTES = 4 << 30


def use_cpu_fast_path(model: nn.Module) -> bool:
    """Whether to dequantize ``model`` to float32 for MLX's CPU backend.

    Quantized matmuls on MLX's CPU backend do not use BLAS; float32 ones use
    OpenBLAS when :mod:`mlx_notebook.loading.blas` loaded it. Measured on a 2-core
    x86 CPU with SmolLM2-135M Q4_1: prefill 13.7 -> 180 tok/s, decode about
    the same, identical greedy tokens. ``MLX_NOTEBOOK_CPU_DEQUANTIZE`` is
    ``auto`` (default: CPU device, OpenBLAS active, quantized, fp32 copy
    <= 4 GiB), ``1`` (always on CPU) or ``0`` (never).
    """
    choice = env_switch("MLX_NOTEBOOK_CPU_DEQUANTIZE")
    if choice == "off" or mx.default_device().type != mx.cpu:
        return False
    quantized = [m for _, m in model.named_modules() if hasattr(m, "scales") and hasattr(m, "bits")]
    if not quantized:
        return False
    if choice == "on":
        return True
    fp32_bytes = sum(float32_bytes(m) for m in quantized)
    return blas.openblas_active() and fp32_bytes <= CPU_DEQUANTIZE_MAX_BYTES


def float32_bytes(quantized: nn.Module) -> int:
    """Bytes of a quantized layer's weight once dequantized to float32."""
    return quantized.weight.size * (32 // quantized.bits) * 4


def read_in_blocks(config: dict) -> bool:
    """Whether to read large weights in row blocks (:mod:`weight_blocks`).

    ``MLX_NOTEBOOK_BLOCK_LOAD`` is ``auto`` (default: on GPU streams, for model
    types whose weights are the file's tensors), ``1`` (those model types, any
    device) or ``0`` (never).
    """
    choice = env_switch("MLX_NOTEBOOK_BLOCK_LOAD")
    if choice == "off" or config.get("model_type") not in weight_blocks.BLOCK_SAFE_MODEL_TYPES:
        return False
    return choice == "on" or mx.default_device().type == mx.gpu


def batch_decode(model: nn.Module | None = None) -> bool:
    """Whether generations of one model decode together in one batched step.

    On by default wherever it pays, decided by measuring one batched step
    against one row's (``benchmarks/batch_step.py``). A GPU step is bound by
    reading the weights: 8 rows cost about what one does (H200, 8B models:
    4.5-5.9x one row's aggregate rate). On the CPU with float32 weights and
    OpenBLAS (the default model's fast path) a step is not "B times one"
    either: 2-core x86, SmolLM2-135M, B=1 / 4 / 8 steps of 70 / 118 / 151 ms
    (2.4x / 3.7x one row's rate); four generations of 48 tokens submitted
    together end 2.3x sooner than one after another, each with its solo
    tokens (``benchmarks/batching.py``; a batched step's OpenBLAS threads
    are chosen by timing it, :mod:`.blas_threads`). An earlier measurement said 1.07x:
    that benchmark imported ``mlx`` before ``mlx_notebook``, so OpenBLAS was
    never loaded and the model stayed Q4_1, and MLX's quantized CPU matmul
    (no BLAS) costs about B times one row for B rows (137 / 454 / 1096 ms:
    1.2x / 1.0x). So a model whose matmuls stay quantized on the CPU decodes
    alone (batching would only make every stop wait for a longer step); see
    docs/benchmarks.md. ``MLX_NOTEBOOK_BATCH`` is ``auto`` (default: on, except
    quantized matmuls on the CPU), ``1`` (always) or ``0`` (never).

    Args:
        model: The loaded model (after the CPU fast path). Default: ``None``
          (the device alone decides).
    """
    choice = env_switch("MLX_NOTEBOOK_BATCH")
    if choice != "auto":
        return choice == "on"
    if mx.default_device().type != mx.cpu or model is None:
        return True
    return not any(hasattr(m, "scales") and hasattr(m, "bits") for _, m in model.named_modules())


def env_switch(name: str) -> str:
    """An ``auto`` / ``1`` / ``0`` environment switch as ``"auto"``, ``"on"`` or ``"off"``."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("0", "no", "never", "off"):
        return "off"
    if value in ("1", "yes", "always", "on"):
        return "on"
    return "auto"


# Tokenizer files above this size load in a child process (see .tokenizer).
# Building one holds the GIL in single native calls for roughly 20-45 ms per MB
# of tokenizer.json on a 2-core CPU (9.5 MB Qwen3: 153-237 ms; 8 MB Llama 3: up
# to 408 ms; benchmarks/gil_probe.py), and every stop waits for the GIL. The
# tests' tiny tokenizers (tens of KB) stay in this process.
TOKENIZER_PROCESS_MIN_BYTES = 1 << 20


def tokenizer_in_child(folder: Path) -> bool:
    """Whether to load ``folder``'s tokenizer in a child process.

    ``MLX_NOTEBOOK_TOKENIZER_PROCESS`` is ``auto`` (default: when
    ``tokenizer.json`` is over 1 MB, i.e. building it here would hold the GIL
    longer than a stop may wait), ``1`` (always) or ``0`` (never: in this
    process, on a helper thread).
    """
    choice = env_switch("MLX_NOTEBOOK_TOKENIZER_PROCESS")
    if choice != "auto":
        return choice == "on"
    try:
        return (Path(folder) / "tokenizer.json").stat().st_size > TOKENIZER_PROCESS_MIN_BYTES
    except OSError:  # no tokenizer.json (sentencepiece models): transformers builds one
        return True
