"""A linear layer's product for 2-8 rows on tensor cores, without cuBLASLt's per-call host work (CUDA).

MLX's CUDA backend (0.32) sends a matmul of one row to its own gemv kernel
and every other to cuBLASLt, building the descriptors and asking
``cublasLtMatmulAlgoGetHeuristic`` again on every call. That is host time:
a chain of 256x256 products costs 11.7 us a call for one row and 26.3 us
for eight. A decode step of an 8B model makes ~250 such calls, and its
step is bound by host time, so an 8-row step cost ~2x a 1-row one (Qwen3-8B
shape, plain mlx-lm: 12.4-17.7 ms against 5.7-10.5 ms; H200, session 27,
``benchmarks/results/h200_skinny_matmul_session27.log``).

Here the product ``y[M, N] = x[M, K] @ w[N, K].T`` for ``2 <= M <= 8`` is one
``mma.sync.m16n8k16`` kernel: a warp owns 16 of ``w``'s rows (output
columns) and takes every second 64-element slice of ``K`` (split-K over the
block's two warps, summed in shared memory); ``x``'s rows are the MMA's 8
columns, zero past ``M``. Each lane loads 16 contiguous bytes of its two
``w`` rows and of its ``x`` row per slice: the order of ``k`` inside an
MMA is permuted alike for both operands, which a dot product allows, so
the loads are whole 16-byte words. Accumulation is float32, as cuBLAS's.
Measured per call on the H200 (chained, so host time counts): 21 us for a
4096x4096 weight (cuBLASLt 34, gemv of one row 17), 33-36 us at 12288x4096
(35-38, 28-30); an 8-row decode step of plain mlx-lm 10.8-16.4 ms against
15.6-20.8 (Qwen3-8B shape) and 11.6-14.0 against 15.1-17.7 (Llama-3-8B).

Only on MLX's CUDA backend, for bfloat16 and float16 weights of plain
``nn.Linear`` layers (quantized layers have their own kernels); one row,
more than eight, other dtypes and ``K`` not a multiple of 64 go to the
layer's own call. This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..loading.policy import env_switch
from .chunks import builds_kernels_per_shape

log = logging.getLogger(__name__)

MAX_ROWS = 8  # the MMA's n
SPLIT = 2  # warps per block, each taking every SPLIT-th slice of K
UNROLL = 2  # 32-element slices a lane loads before its MMAs (memory-level parallelism)
SLICE = 32 * UNROLL  # K per warp iteration
_PTX = {mx.bfloat16: "bf16", mx.float16: "f16"}

_SOURCE = r"""
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;  // the MMA's group and thread in group
    const int n0 = blockIdx.x * 16;
    // Rows past N (never written) read row N - 1; rows of x past M read zeros.
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)min(n0 + g, N - 1) * K);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)min(n0 + g + 8, N - 1) * K);
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)min(g, M - 1) * K);
    const bool x_row = g < M;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = warp * 32 * UNROLL; k < K; k += SPLIT * 32 * UNROLL) {
        uint4 a[UNROLL], b[UNROLL], v[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            // Lane (g, t) takes elements [8t, 8t + 8) of this 32-element slice: two MMAs' worth.
            const int q = ((k + 32 * u) >> 3) + t;
            a[u] = w0[q];
            b[u] = w1[q];
            v[u] = x_row ? xr[q] : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.PTX.PTX.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(a[u].x), "r"(b[u].x), "r"(a[u].y), "r"(b[u].y), "r"(v[u].x), "r"(v[u].y));
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.PTX.PTX.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(a[u].z), "r"(b[u].z), "r"(a[u].w), "r"(b[u].w), "r"(v[u].z), "r"(v[u].w));
        }
    }
    __shared__ float partial[SPLIT][32][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][i] = c[i];
    __syncthreads();
    if (warp != 0) return;
    for (int s = 1; s < SPLIT; ++s)
        #pragma unroll
        for (int i = 0; i < 4; ++i) c[i] += partial[s][lane][i];
    // c[0], c[1]: output column n0 + g, rows 2t and 2t + 1; c[2], c[3]: column n0 + g + 8.
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int col = n0 + g + (i >= 2 ? 8 : 0), row = 2 * t + (i & 1);
        if (row < M && col < N) y[(size_t)row * N + col] = static_cast<T>(c[i]);
    }
"""


def wanted() -> bool:
    """Whether linear layers take this kernel: only with ``MLX_NOTEBOOK_SKINNY_MATMUL=1``, on MLX's CUDA backend.

    Off by default since session 35: with q/k/v and gate/up fused
    (:mod:`.fused_projections`, on by default on CUDA) a step makes four
    products a layer, and MLX's own matmul ran them faster than this kernel.
    Llama-3-8B shape, 8 rows, H100, the library's batching benchmark, one
    process an arm, alternated: fused with MLX's products 837 and 759 tok/s,
    this kernel without fusing 580 and 615, both 606; the kernel is slower on
    the fused layers' wide outputs (plain mlx-lm 8-row steps 13.6 against
    12.5 ms; ``benchmarks/results/h100_*_session35.*``). ``1`` does not force
    it where there is no CUDA.
    """
    return env_switch("MLX_NOTEBOOK_SKINNY_MATMUL") == "on" and builds_kernels_per_shape()


@cache
def _kernel(dtype: mx.Dtype) -> Any:
    ptx = _PTX[dtype]
    source = f"    constexpr int SPLIT = {SPLIT}, UNROLL = {UNROLL};\n" + _SOURCE.replace(".PTX.PTX.", f".{ptx}.{ptx}.")
    return mx.fast.cuda_kernel(
        name=f"mlxnb_skinny_matmul_{ptx}", input_names=["x", "w"], output_names=["y"], source=source
    )


def supports(x: mx.array, w: mx.array) -> bool:
    """Whether ``x @ w.T`` fits the kernel: ``x`` of 2-8 rows, both bf16 or fp16, ``K`` a multiple of 64."""
    return (
        x.ndim == 2
        and 2 <= x.shape[0] <= MAX_ROWS
        and w.ndim == 2
        and x.dtype == w.dtype
        and x.dtype in _PTX
        and x.shape[1] == w.shape[1]
        and x.shape[1] % SLICE == 0
    )


def product(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for ``x`` of shape ``(M, K)`` and ``w`` of ``(N, K)`` (see :func:`supports`)."""
    m, n = x.shape[0], w.shape[0]
    blocks = (n + 15) // 16
    return _kernel(x.dtype)(
        inputs=[x, w],
        template=[("T", x.dtype)],
        grid=(blocks * 32 * SPLIT, 1, 1),
        threadgroup=(32 * SPLIT, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )[0]


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose products of 2-8 rows take :func:`product` (installed by class swap, see :func:`install`)."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        rows = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
        if not supports(rows, weight):
            return super().__call__(x)
        y = product(rows, weight)
        if "bias" in self:
            y = y + self["bias"]
        return y.reshape(*x.shape[:-1], weight.shape[0])


def install(model: nn.Module) -> int:
    """Make ``model``'s plain linear layers :class:`SkinnyLinear`; compile the kernel now; the layers swapped.

    Idempotent. The kernel is compiled here (NVRTC) for the weights' dtype
    and not inside a step: a kernel compiled while another thread decodes
    stalled that thread for seconds (session 25). The worker calls this in
    its warm-up, while nothing is queued (:mod:`.warm_up`): the compile takes
    2.1-2.3 s in every process on an H200 (``cuda_kernel`` modules are not
    kept on disk by MLX 0.32), which no stop could cut inside a job. The
    compile comes first: if it raises, no layer was swapped.
    """
    plain = [module for _, module in model.named_modules() if type(module) is nn.Linear]
    for dtype in {m["weight"].dtype for m in plain} & set(_PTX):
        t0 = time.perf_counter()
        mx.eval(product(mx.zeros((2, SLICE), dtype=dtype), mx.zeros((16, SLICE), dtype=dtype)))
        log.debug("skinny matmul for %s ready in %.3f s", dtype, time.perf_counter() - t0)
    for module in plain:
        module.__class__ = SkinnyLinear
    return len(plain)


@contextmanager
def unpatched(model: nn.Module) -> Iterator[None]:
    """While inside, ``model``'s linear layers are mlx-lm's own (a benchmark's mlx-lm side measures MLX's matmul)."""
    swapped: list[nn.Module] = [m for _, m in model.named_modules() if type(m) is SkinnyLinear]
    for module in swapped:
        module.__class__ = nn.Linear
    try:
        yield
    finally:
        for module in swapped:
            module.__class__ = SkinnyLinear


__all__ = ["SkinnyLinear", "install", "product", "supports", "unpatched", "wanted"]
