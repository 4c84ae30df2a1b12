"""ggml's block types as MLX affine triplets: which bits, and the numpy that gets there.

``mx.load`` reads only F32, F16, BF16, Q4_0, Q4_1 and Q8_0 from a GGUF file; the
files people download are mostly K-quants (Q4_K_M = Q4_K + Q6_K, Q5_K_M, Q6_K)
and IQ types. For those, rows of raw blocks are dequantized with ``gguf``'s own
numpy code (``gguf.quants.dequantize``, llama.cpp's reference dequantizers) and
turned into MLX's affine form (``w = scale * q + bias`` per group of 32, the
group size MLX and these blocks share):

- **exact** where the block is already that form over groups of 32: Q4_0, Q4_1,
  Q8_0 (what ``mx.load`` gives), Q5_0, Q5_1, and the K-quants with 32-value
  sub-blocks, Q4_K -> 4 bits and Q5_K -> 5 bits (scale ``d * sc``, bias
  ``-dmin * m``, from gguf's ``Q4_K.get_scale_min``). The only change is the
  rounding of each group's scale and bias to float16 (MLX's usual dtype; ggml's
  products ``d * sc`` can need 17 bits of mantissa);
- **re-quantized** (per-group min/max fit of gguf's dequantized values) where
  one MLX group would straddle two ggml scales (Q2_K, Q3_K and Q6_K use 16-value
  sub-blocks; MLX's smallest group is 32) or the levels are not evenly spaced
  (IQ types). The bits are chosen so that the added error stays well under the
  file's own step: Q6_K -> 8 (error <= 1/510 of a group's range, about 1/8 of a
  Q6_K step); Q2_K, Q3_K -> 4; IQ4_NL, IQ4_XS -> 6 (16 uneven levels); IQ1/IQ2/
  IQ3 -> 4.

Ternary and FP4 types (TQ1_0, TQ2_0, MXFP4, NVFP4) are refused: no affine grid
of 32 holds them without more bits than a F16 file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GROUP_SIZE", "MLX_READS", "TARGETS", "Target", "affine_rows", "packed_columns"]

GROUP_SIZE = 32
# Types mx.load converts itself (exactly); a file holding only these goes through it.
MLX_READS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class Target:
    """The MLX form of one ggml type.

    Attributes:
        bits: MLX affine bits.
        exact: The triplet holds the block's own grid (only the scale and bias
            rounded to float16); else it is a re-quantization of gguf's values.
    """

    bits: int
    exact: bool


TARGETS: dict[str, Target] = {
    "Q4_0": Target(4, True),
    "Q4_1": Target(4, True),
    "Q5_0": Target(5, True),
    "Q5_1": Target(5, True),
    "Q8_0": Target(8, True),
    "Q4_K": Target(4, True),
    "Q5_K": Target(5, True),
    "Q6_K": Target(8, False),
    "Q2_K": Target(4, False),
    "Q3_K": Target(4, False),
    "IQ4_NL": Target(6, False),
    "IQ4_XS": Target(6, False),
    "IQ3_S": Target(4, False),
    "IQ3_XXS": Target(4, False),
    "IQ2_S": Target(4, False),
    "IQ2_XS": Target(4, False),
    "IQ2_XXS": Target(4, False),
    "IQ1_S": Target(4, False),
    "IQ1_M": Target(4, False),
}


def packed_columns(columns: int, bits: int) -> int:
    """uint32 words per row of ``columns`` values at ``bits`` bits (MLX's packing)."""
    return columns * bits // 32


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing: each row a little-endian bit stream of ``bits``-bit values, as uint32."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.uint8)).view("<u4")
    if bits == 4:
        q8 = q.astype(np.uint8)
        return np.ascontiguousarray(q8[:, 0::2] | (q8[:, 1::2] << 4)).view("<u4")
    planes = (q.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(rows, cols * bits), axis=1, bitorder="little").view("<u4")


def _group_fields(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-32 ``(scale, bias)`` in float32 read from the blocks of an exact type, else ``None``."""
    import gguf

    rows = raw.shape[0]

    def f16(blocks: np.ndarray, at: int) -> np.ndarray:
        return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)[:, 0]

    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
        blocks = raw.reshape(-1, size)
        scale = f16(blocks, 0)
        center = {"Q4_0": -8.0, "Q5_0": -16.0, "Q8_0": -128.0}
        bias = scale * center[type_name] if type_name in center else f16(blocks, 2)
    elif type_name in ("Q4_K", "Q5_K"):
        blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1])
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale = (f16(blocks, 0)[:, None] * sc.astype(np.float32)).reshape(-1)
        bias = -(f16(blocks, 2)[:, None] * m.astype(np.float32)).reshape(-1)
    else:
        return None
    return scale.reshape(rows, -1), bias.reshape(rows, -1)


def affine_rows(raw: np.ndarray, type_name: str, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows of raw ggml blocks as MLX affine ``(weight, scales, biases)``.

    Args:
        raw: ``(rows, bytes per row)`` uint8, whole blocks.
        type_name: A key of :data:`TARGETS`.
        columns: Values per row.

    Returns:
        ``weight`` uint32 ``(rows, packed_columns)``, ``scales`` and ``biases``
        float16 ``(rows, columns / 32)``; ``None`` when the blocks decode to
        non-finite values or to scales beyond float16 (a corrupt file).
    """
    import gguf

    target = TARGETS[type_name]
    # A corrupt block's inf/nan scale is reported below as one error, not as numpy warnings.
    with np.errstate(all="ignore"):
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(raw.shape[0], columns)
        groups = values.reshape(raw.shape[0], -1, GROUP_SIZE)
        if not np.isfinite(values).all():
            return None
        fields = _group_fields(raw, type_name) if target.exact else None
        if fields is None:
            low, high = groups.min(axis=2), groups.max(axis=2)
            scale32, bias32 = (high - low) / (2**target.bits - 1), low
        else:
            scale32, bias32 = fields
        scales, biases = scale32.astype(np.float16), bias32.astype(np.float16)
        if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
            return None
        # q from gguf's values and the stored (rounded) scale and bias: for the exact
        # types this recovers the block's own integers.
        s, b = scales.astype(np.float32)[..., None], biases.astype(np.float32)[..., None]
        q = np.rint(np.divide(groups - b, s, out=np.zeros_like(groups), where=s != 0))
    q = np.clip(q, 0, 2**target.bits - 1).reshape(raw.shape[0], columns)
    return _pack(q, target.bits), scales, biases
