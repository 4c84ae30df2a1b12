"""One decode step's attention read straight from a quantized KV cache: a fused CUDA kernel.

Dequantizing a layer's whole cache and then running the fused attention
(:mod:`.quantized_attention`'s general route) writes and reads a bf16 copy of
every key and value at every step: at 32k positions on an H200 that is
0.34-0.50 ms per layer, against 0.17 ms for attention over a bf16 cache, and
it makes a quantized decode step longer than a 10 ms stop budget.

Here one query position per head attends in two kernels (split-K, as
"flash-decoding"):

1. ``partials``: each block takes one KV head and one slice of the positions.
   Each warp walks positions; its 32 lanes unpack one key row (``D / 32``
   elements each), dot it with the head group's queries (shuffle reduction),
   and fold the value row into a running softmax (running max, sum and
   weighted values, in float32). The block's warps are merged in shared
   memory and written as one partial per (query head, slice).
2. ``combine``: one block per query head rescales the slices' partials to a
   common max and normalizes.

Keys and values are read packed (``2`` or ``4`` bytes of weights per 8/4-bit
word's share, plus the group's scale and bias), which is the point: the
cache's bytes are read once, nothing full-precision is written. Inputs are
taken with their strides, so the cache's ``[..., :offset, :]`` slices are
read in place (no contiguous copy). The unpacking is MLX's affine format
(``w = q * scale + bias``; element ``i`` of a ``uint32`` in bits
``[i * bits, (i + 1) * bits)``), the layout ``mx.quantize`` writes.

Only on MLX's CUDA backend (``mx.fast.cuda_kernel``); the CPU and Metal
never reach this module. It never imports IPython or ipywidgets.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import Any

import mlx.core as mx

from .chunks import builds_kernels_per_shape

WARPS = 4  # warps per block in the first kernel
POSITIONS = 2  # positions a warp loads at once (memory-level parallelism)
LANES = 32
# Positions per block are chosen so that ~512 blocks cover the cache: enough
# to fill an H200's 132 SMs several times over, few enough that the combine
# (one pass over every slice's partial) stays small.
TARGET_BLOCKS = 512
MIN_SLICE = 128
MAX_SLICES = 1024  # the combine keeps one weight per slice in shared memory
LANES_PER_ROW = 16  # lanes that read one key row together (the rest of the warp reads others)

_PARTIALS = r"""
    constexpr int EPL = D / LPR;              // elements of a row per lane
    constexpr int RPW = 32 / LPR;             // rows a warp reads at once
    constexpr int PER_WORD = 32 / BITS;       // elements per uint32
    constexpr unsigned MASK = (1u << BITS) - 1u;
    __shared__ float qs[REP][D];
    __shared__ float wm[WARPS][REP];
    __shared__ float wl[WARPS][REP];
    __shared__ float wacc[WARPS][REP][D];

    const int hkv = kw_shape[1];
    const int length = kw_shape[2];
    const int slices = gridDim.x;
    const int slice = blockIdx.x;
    const int bh = blockIdx.y;                // b * hkv + kv head
    const int b = bh / hkv;
    const int kvh = bh % hkv;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int grp = lane / LPR;               // which of the warp's rows
    const int li = lane % LPR;                // which part of that row
    const int per_slice = (length + slices - 1) / slices;
    const int start = slice * per_slice;
    const int stop = min(start + per_slice, length);
    const float sc = scale[0];

    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        const int h = kvh * REP + r;
        qs[r][d] = static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + d * q_strides[3]]) * sc;
    }
    __syncthreads();

    const int first = li * EPL;
    const int g = first / G;                  // a lane's elements share one group
    float qr[REP][EPL];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        #pragma unroll
        for (int e = 0; e < EPL; ++e) qr[r][e] = qs[r][first + e];
    }

    float m[REP], l[REP], acc[REP][EPL];
    #pragma unroll
    for (int r = 0; r < REP; ++r) {
        m[r] = NEG_INF; l[r] = 0.f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) acc[r][e] = 0.f;
    }

    // Row pointers of this (row, KV head); positions step by the strides
    // (32-bit offsets: one head's slice of a cache is far below 2^31 elements).
    const uint32_t* kws = kw + b * kw_strides[0] + kvh * kw_strides[1];
    const uint32_t* vws = vw + b * vw_strides[0] + kvh * vw_strides[1];
    const T* kss = ks + b * ks_strides[0] + kvh * ks_strides[1];
    const T* kbs = kb + b * kb_strides[0] + kvh * kb_strides[1];
    const T* vss = vs + b * vs_strides[0] + kvh * vs_strides[1];
    const T* vbs = vb + b * vb_strides[0] + kvh * vb_strides[1];
    const int kw_step = kw_strides[2], vw_step = vw_strides[2];
    const int ks_step = ks_strides[2], kb_step = kb_strides[2];
    const int vs_step = vs_strides[2], vb_step = vb_strides[2];

    // A pass reads P rows per lane group, their loads issued together. The
    // loop bound is the warp's, not the group's: every lane must reach the
    // shuffles, so rows past the end take part as -inf scores.
    for (int wbase = start + warp * RPW; wbase < stop; wbase += WARPS * RPW * P) {
        float s[P][REP];
        float v[P][EPL];
        #pragma unroll
        for (int i = 0; i < P; ++i) {
            const int pos = wbase + grp + i * WARPS * RPW;
            if (pos < stop) {
                const float ksc = static_cast<float>(kss[pos * ks_step + g]);
                const float kbi = static_cast<float>(kbs[pos * kb_step + g]);
                const float vsc = static_cast<float>(vss[pos * vs_step + g]);
                const float vbi = static_cast<float>(vbs[pos * vb_step + g]);
                float k[EPL];
                #pragma unroll
                for (int e = 0; e < EPL; ++e) {
                    const uint32_t kword = kws[pos * kw_step + (first + e) / PER_WORD];
                    const uint32_t vword = vws[pos * vw_step + (first + e) / PER_WORD];
                    const int shift = ((first + e) % PER_WORD) * BITS;
                    // q as a float without the int->float unit: 2^23 + q has q
                    // in its mantissa bits, exactly (q < 2^8).
                    const float kq = __uint_as_float(0x4B000000u | ((kword >> shift) & MASK)) - 8388608.f;
                    const float vq = __uint_as_float(0x4B000000u | ((vword >> shift) & MASK)) - 8388608.f;
                    k[e] = kq * ksc + kbi;
                    v[i][e] = vq * vsc + vbi;
                }
                #pragma unroll
                for (int r = 0; r < REP; ++r) {
                    float t = 0.f;
                    #pragma unroll
                    for (int e = 0; e < EPL; ++e) t += qr[r][e] * k[e];
                    s[i][r] = t;
                }
            } else {
                #pragma unroll
                for (int e = 0; e < EPL; ++e) v[i][e] = 0.f;
                #pragma unroll
                for (int r = 0; r < REP; ++r) s[i][r] = 0.f;
            }
        }
        #pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) {
            #pragma unroll
            for (int i = 0; i < P; ++i) {
                #pragma unroll
                for (int r = 0; r < REP; ++r) s[i][r] += __shfl_xor_sync(0xffffffff, s[i][r], o);
            }
        }
        #pragma unroll
        for (int i = 0; i < P; ++i) {
            if (wbase + grp + i * WARPS * RPW >= stop) {
                #pragma unroll
                for (int r = 0; r < REP; ++r) s[i][r] = NEG_INF;
            }
        }
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            float mn = m[r];
            #pragma unroll
            for (int i = 0; i < P; ++i) mn = fmaxf(mn, s[i][r]);
            if (mn == NEG_INF) continue;      // this group had no rows yet
            const float c = __expf(m[r] - mn);
            l[r] *= c;
            #pragma unroll
            for (int e = 0; e < EPL; ++e) acc[r][e] *= c;
            #pragma unroll
            for (int i = 0; i < P; ++i) {
                const float p = __expf(s[i][r] - mn);
                l[r] += p;
                #pragma unroll
                for (int e = 0; e < EPL; ++e) acc[r][e] += p * v[i][e];
            }
            m[r] = mn;
        }
    }

    // Merge the warp's row groups (lanes LPR apart hold the same elements).
    #pragma unroll
    for (int o = LPR; o < 32; o <<= 1) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            const float mo = __shfl_xor_sync(0xffffffff, m[r], o);
            const float lo = __shfl_xor_sync(0xffffffff, l[r], o);
            const float mn = fmaxf(m[r], mo);
            const float ca = (m[r] == NEG_INF) ? 0.f : __expf(m[r] - mn);
            const float cb = (mo == NEG_INF) ? 0.f : __expf(mo - mn);
            l[r] = l[r] * ca + lo * cb;
            #pragma unroll
            for (int e = 0; e < EPL; ++e) {
                const float ao = __shfl_xor_sync(0xffffffff, acc[r][e], o);
                acc[r][e] = acc[r][e] * ca + ao * cb;
            }
            m[r] = mn;
        }
    }

    if (grp == 0) {
        #pragma unroll
        for (int r = 0; r < REP; ++r) {
            if (li == 0) { wm[warp][r] = m[r]; wl[warp][r] = l[r]; }
            #pragma unroll
            for (int e = 0; e < EPL; ++e) wacc[warp][r][first + e] = acc[r][e];
        }
    }
    __syncthreads();

    // Merge the warps: one thread per (query head of the group, element).
    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        float mx_ = NEG_INF;
        for (int w = 0; w < WARPS; ++w) mx_ = fmaxf(mx_, wm[w][r]);
        float sum = 0.f, lsum = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            const float f = (wm[w][r] == NEG_INF) ? 0.f : __expf(wm[w][r] - mx_);
            sum += f * wacc[w][r][d];
            lsum += f * wl[w][r];
        }
        const int row = (bh * REP + r) * slices + slice;
        po[row * D + d] = sum;
        if (d == 0) { pm[row] = mx_; pl[row] = lsum; }
    }
"""

_HEADER = "#define NEG_INF __int_as_float(0xff800000)\n"

# One block of D threads per query head: the slices' maxima and weights are
# reduced across the block first (each thread a share of the slices), so the
# weighted sum over slices reads each partial once, its loads independent.
_COMBINE = r"""
    __shared__ float weight[MAX_SLICES];
    __shared__ float red[32];
    const int slices = pm_shape[1];
    const int row = blockIdx.x;               // b * hq + query head
    const int d = threadIdx.x;
    const int warps = blockDim.x / 32;

    float mx_ = NEG_INF;
    for (int s = d; s < slices; s += blockDim.x) mx_ = fmaxf(mx_, pm[row * slices + s]);
    for (int o = 16; o > 0; o >>= 1) mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffff, mx_, o));
    if (d % 32 == 0) red[d / 32] = mx_;
    __syncthreads();
    mx_ = NEG_INF;
    for (int w = 0; w < warps; ++w) mx_ = fmaxf(mx_, red[w]);
    __syncthreads();

    float lsum = 0.f;
    for (int s = d; s < slices; s += blockDim.x) {
        const float m = pm[row * slices + s];
        const float f = (m == NEG_INF) ? 0.f : __expf(m - mx_);
        weight[s] = f;
        lsum += f * pl[row * slices + s];
    }
    for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffff, lsum, o);
    if (d % 32 == 0) red[d / 32] = lsum;
    __syncthreads();
    lsum = 0.f;
    for (int w = 0; w < warps; ++w) lsum += red[w];

    float sum = 0.f;
    #pragma unroll 8
    for (int s = 0; s < slices; ++s) sum += weight[s] * po[(row * slices + s) * D + d];
    out[row * D + d] = static_cast<T>(sum / lsum);
"""


@cache
def _kernels() -> tuple[Any, Any]:
    partials = mx.fast.cuda_kernel(
        name="mlxnb_qattn_partials",
        input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "scale"],
        output_names=["po", "pm", "pl"],
        source=_PARTIALS,
        header=_HEADER,
        ensure_row_contiguous=False,
    )
    combine = mx.fast.cuda_kernel(
        name="mlxnb_qattn_combine",
        input_names=["po", "pm", "pl"],
        output_names=["out"],
        source=_COMBINE,
        header=_HEADER,
    )
    return partials, combine


@lru_cache(maxsize=64)
def _scale_array(scale: float) -> mx.array:
    # One small array per model's scale, not one per layer and step.
    return mx.array([scale], dtype=mx.float32)


def available() -> bool:
    """Whether this device runs the kernel: MLX's CUDA backend."""
    return builds_kernels_per_shape()


def supports(queries: mx.array, keys: Any, values: Any, bits: int, group: int) -> bool:
    """Whether one decode step's attention fits the kernel (else the caller dequantizes)."""
    if queries.ndim != 4 or queries.shape[2] != 1:
        return False
    dim = queries.shape[3]
    if bits not in (4, 8) or dim % LANES or dim > 256 or dim % group or group % (dim // LANES):
        return False
    if any(packed[0].shape[-1] * (32 // bits) != dim for packed in (keys, values)):
        return False
    heads, kv_heads = queries.shape[1], keys[0].shape[1]
    return kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 8


def lanes_per_row(dim: int, group: int) -> int:
    """Lanes that share one key row: LANES_PER_ROW, more where a lane's elements would straddle two groups."""
    lanes = LANES_PER_ROW
    while lanes < LANES and (dim % lanes or group % (dim // lanes)):
        lanes *= 2
    return lanes


def slices_for(length: int, kv_rows: int) -> int:
    """How many position slices split one (row, KV head): ~TARGET_BLOCKS blocks, slices of >= MIN_SLICE."""
    wanted = max(1, math.ceil(TARGET_BLOCKS / max(1, kv_rows)))
    return max(1, min(wanted, MAX_SLICES, math.ceil(length / MIN_SLICE)))


def attend(queries: mx.array, keys: Any, values: Any, scale: float, group: int, bits: int) -> mx.array:
    """Attention of ``queries`` (``[B, H, 1, D]``) over packed ``(data, scales, biases)`` keys and values."""
    return combined(queries, *partial_attention(queries, keys, values, scale, group, bits))


def partial_attention(
    queries: mx.array, keys: Any, values: Any, scale: float, group: int, bits: int
) -> tuple[mx.array, mx.array, mx.array]:
    """The first kernel: per (query head, slice of positions) the weighted values, the max score, the weights' sum."""
    partials, _ = _kernels()
    batch, heads, _, dim = queries.shape
    kv_heads, length = keys[0].shape[1], keys[0].shape[2]
    rep = heads // kv_heads
    lanes = lanes_per_row(dim, group)
    slices = slices_for(length, batch * kv_heads)
    rows = batch * heads
    template = [
        ("T", queries.dtype),
        ("BITS", bits),
        ("G", group),
        ("D", dim),
        ("REP", rep),
        ("WARPS", WARPS),
        ("P", POSITIONS),
        ("LPR", lanes),
    ]
    po, pm, pl = partials(
        inputs=[queries, *keys, *values, _scale_array(float(scale))],
        template=template,
        grid=(slices * WARPS * LANES, batch * kv_heads, 1),
        threadgroup=(WARPS * LANES, 1, 1),
        output_shapes=[(rows * slices, dim), (rows, slices), (rows, slices)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return po, pm, pl


def combined(queries: mx.array, po: mx.array, pm: mx.array, pl: mx.array) -> mx.array:
    """The second kernel: the slices' partials rescaled to one max and normalized, in ``queries``' shape and dtype."""
    _, combine = _kernels()
    batch, heads, _, dim = queries.shape
    (out,) = combine(
        inputs=[po, pm, pl],
        template=[("T", queries.dtype), ("D", dim), ("MAX_SLICES", MAX_SLICES)],
        grid=(batch * heads * dim, 1, 1),
        threadgroup=(dim, 1, 1),
        output_shapes=[(batch, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )
    return out


__all__ = ["attend", "available", "combined", "partial_attention", "slices_for", "supports"]
