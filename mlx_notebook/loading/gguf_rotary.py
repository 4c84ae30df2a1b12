"""The rotary embedding a GGUF file describes, as the config keys mlx-lm reads.

transformers' GGUF tables keep only ``rope.freq_base``; llama.cpp's converter
writes more, and a model run without it computes something else (Phi-4-mini
without its partial rotary: logits off by up to 4.1, the first greedy token
wrong). What llama.cpp writes, and where it goes:

- ``{arch}.rope.dimension_count`` below the head size: ``partial_rotary_factor``
  (Phi-3 / Phi-4-mini: 0.75); a family whose mlx-lm model has no such option
  is refused;
- ``{arch}.rope.scaling.type`` / ``.factor`` / ``.original_context_length`` /
  ``.yarn_beta_*``: ``rope_scaling`` (linear, yarn) and
  ``original_max_position_embeddings``;
- the per-frequency factors llama.cpp stores as tensors: ``rope_freqs`` (Llama
  3.1's scaling, precomputed; its factor, low/high frequency factors are
  recovered and checked against every stored value) and ``rope_factors_long`` /
  ``rope_factors_short`` (Phi-3's longrope);
- gemma3's local (sliding-window) layers rotate with their own base:
  ``rope.freq_base_swa`` when written, else llama.cpp's fixed 10000.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ModelFormatError
from .gguf_header import FIX_DOWNLOAD, FIX_OTHER, GGUFInfo

__all__ = ["ROPE_TENSORS", "rotary_config"]

# Tensors that are rotary settings, not parameters: they go into the config.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's gemma3 local-layer base when the file does not say (llama-model.cpp).
_GEMMA3_LOCAL_BASE = 10000.0
# What the converter assumes for Llama 3 when nothing says otherwise; any value
# fits the same factors (only the wavelength thresholds matter).
_LLAMA3_CONTEXT = 8192


def _float_tensor(info: GGUFInfo, name: str) -> np.ndarray:
    tensor = info.tensors[name]
    if tensor.type_name != "F32" or len(tensor.shape) != 1:
        raise ModelFormatError(
            f"{info.path.name}: tensor '{name}' should be 1-D F32, is {tensor.type_name} "
            f"{list(tensor.shape)} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    values = np.fromfile(info.path, dtype="<f4", count=tensor.shape[0], offset=tensor.offset).astype(np.float64)
    if not np.isfinite(values).all() or (values <= 0).any():
        raise ModelFormatError(
            f"{info.path.name}: tensor '{name}' holds invalid factors (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    return values


def _meta_float(info: GGUFInfo, key: str) -> float | None:
    value = info.metadata.get(f"{info.architecture}.{key}")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelFormatError(
            f"{info.path.name}: invalid metadata {info.architecture}.{key} = {value!r} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    return float(str(np.float32(value)))  # GGUF stores float32: write 8.0, not 7.999999...


def rotary_config(info: GGUFInfo, config: dict[str, Any], args_fields: set[str]) -> dict[str, Any]:
    """The rotary keys to add to ``config`` (which already has ``head_dim`` and ``model_type``).

    Args:
        info: The checked header.
        config: The config so far.
        args_fields: The fields of the mlx-lm model's ``ModelArgs``.

    Raises:
        ModelFormatError: A setting mlx-lm cannot express (one line, with the fix).
    """
    label, arch = info.path.name, info.architecture
    out: dict[str, Any] = {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dims = info.metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if isinstance(dims, bool) or not isinstance(dims, int) or not 2 <= dims <= head_dim or dims % 2:
        raise ModelFormatError(
            f"{label}: invalid metadata {arch}.rope.dimension_count = {dims!r} (head size {head_dim}; "
            f"corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    if dims < head_dim:
        if "partial_rotary_factor" not in args_fields:
            raise ModelFormatError(
                f"{label}: rotates {dims} of {head_dim} head dimensions, which mlx-lm's "
                f"'{config['model_type']}' model cannot; {FIX_OTHER}"
            )
        out["partial_rotary_factor"] = dims / head_dim
    original = info.metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ModelFormatError(
                f"{label}: invalid metadata {arch}.rope.scaling.original_context_length = {original!r} "
                f"(corrupt GGUF file); {FIX_DOWNLOAD}"
            )
        out["original_max_position_embeddings"] = original
    kind = info.metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = _meta_float(info, "rope.scaling.factor")
    if kind == "linear" and factor is not None:
        out["rope_scaling"] = {"type": "linear", "factor": factor}
    elif kind == "yarn" and factor is not None:
        yarn: dict[str, Any] = {"type": "yarn", "factor": factor}
        yarn["original_max_position_embeddings"] = out.get(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
        for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            value = _meta_float(info, f"rope.scaling.{name}")
            if value is not None:
                yarn[key] = value
        out["rope_scaling"] = yarn
    elif kind not in ("none", "linear"):
        raise ModelFormatError(f"{label}: rope scaling '{kind}' is not supported; {FIX_OTHER}")
    base = float(config.get("rope_theta", 10000.0))
    if "rope_factors_long.weight" in info.tensors:
        out["rope_scaling"] = _longrope(info, dims, config, out)
    if "rope_freqs.weight" in info.tensors:
        llama3 = _llama3(info, dims, base, original)
        if llama3 is not None:
            out["rope_scaling"] = llama3
    if config.get("model_type") == "gemma3_text":
        out["rope_local_base_freq"] = _meta_float(info, "rope.freq_base_swa") or _GEMMA3_LOCAL_BASE
    if "rope_scaling" in out and "rope_scaling" not in args_fields:
        raise ModelFormatError(
            f"{label}: scales its rotary embedding, which mlx-lm's '{config['model_type']}' model cannot; {FIX_OTHER}"
        )
    return out


def _longrope(info: GGUFInfo, dims: int, config: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's per-frequency long and short factors (mlx-lm's ``SuScaledRoPE``)."""
    long = _float_tensor(info, "rope_factors_long.weight")
    short = _float_tensor(info, "rope_factors_short.weight") if "rope_factors_short.weight" in info.tensors else long
    if len(long) != dims // 2 or len(short) != dims // 2:
        raise ModelFormatError(
            f"{info.path.name}: rope factor tensors hold {len(long)} values, the rotary dimension "
            f"{dims} needs {dims // 2} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    if "original_max_position_embeddings" not in out:
        out["original_max_position_embeddings"] = config.get("max_position_embeddings")
    as_list = lambda values: [float(str(np.float32(v))) for v in values]  # noqa: E731
    return {"type": "longrope", "long_factor": as_list(long), "short_factor": as_list(short)}


def llama3_factors(dims: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter: Llama 3's scaling as one factor per frequency (``rope_freqs``)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (context / wavelen - low) / (high - low)
    return np.where(
        wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )


def _llama3(info: GGUFInfo, dims: int, base: float, original: int | None) -> dict[str, Any] | None:
    """Llama 3's scaling recovered from ``rope_freqs``: each stored factor must come back."""
    label = info.path.name
    stored = _float_tensor(info, "rope_freqs.weight")
    if len(stored) != dims // 2:
        raise ModelFormatError(
            f"{label}: tensor 'rope_freqs.weight' holds {len(stored)} values, the rotary dimension {dims} "
            f"needs {dims // 2} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    context = original or _LLAMA3_CONTEXT
    factor = float(stored.max())
    inverse_wavelen = 1 / (2 * math.pi * base ** (np.arange(0, dims, 2) / dims))
    tol = 1e-5
    if factor <= 1 + tol:
        scaling: dict[str, Any] | None = None
    else:
        middle = (stored > 1 + tol) & (stored < factor * (1 - tol))
        if middle.sum() >= 2:
            # smooth = (1/f' - 1/factor) / (1 - 1/factor) is linear in 1/wavelength.
            smooth = (1 / stored[middle] - 1 / factor) / (1 - 1 / factor)
            slope, intercept = np.polyfit(inverse_wavelen[middle], smooth, 1)
            low, high = -intercept / slope * context, (1 - intercept) / slope * context
        else:
            # No ramp: thresholds anywhere between the unscaled and the scaled frequencies.
            ones, scaled = inverse_wavelen[stored <= 1 + tol], inverse_wavelen[stored >= factor * (1 - tol)]
            high = context * (ones.min() * 0.999 if len(ones) else inverse_wavelen.max() * 2)
            low = context * (scaled.max() * 1.001 if len(scaled) else inverse_wavelen.min() / 2)
        scaling = {
            "rope_type": "llama3",
            "factor": float(str(np.float32(factor))),
            "low_freq_factor": float(low),
            "high_freq_factor": float(high),
            "original_max_position_embeddings": context,
        }
    if scaling is None or not 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        ok = scaling is None and np.allclose(stored, 1, rtol=tol)
    else:
        ok = np.allclose(llama3_factors(dims, base, scaling), stored, rtol=1e-4)
    if not ok:
        raise ModelFormatError(
            f"{label}: its rope_freqs factors are not Llama 3's rope scaling, which is all mlx-lm "
            f"can apply; {FIX_OTHER}"
        )
    return scaling
