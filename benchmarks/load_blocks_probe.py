"""Probe: what does reading a big safetensors weight in row blocks cost, per backend?

Compares, for one large bf16 tensor: MLX's own lazy Load evaluated whole; row
blocks read with numpy then copied into MLX arrays; row blocks read by MLX from
a file-like window (``mlx_notebook.loading.weight_blocks``, what loading uses); and the
assembly of the blocks (a join, or in-place updates of a zero tensor) plus a
first matmul on the result.

    python3 -m benchmarks.load_blocks_probe --rows 128256 --cols 4096 --block-mb 32
"""

from __future__ import annotations

import mlx_notebook  # noqa: F401  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_notebook.loading import weight_blocks


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def numpy_rows(fd: int, stored: weight_blocks.StoredTensor, first: int, count: int) -> mx.array:
    """Rows read into a numpy buffer, then copied into an MLX array (two copies)."""
    buf = np.empty(count * stored.row_bytes, np.uint8)
    os.preadv(fd, [buf], stored.offset + first * stored.row_bytes)
    block = mx.array(buf).view(mx.bfloat16).reshape(count, *stored.shape[1:])
    mx.eval(block)
    return block


def read_in_blocks(stored, step: int, read):
    """Each block read with ``read(fd, stored, first, count)``; returns (blocks, ms per block)."""
    blocks, times = [], []
    fd = os.open(stored.path, os.O_RDONLY)
    try:
        for first in range(0, stored.shape[0], step):
            block, ms = timed(lambda: read(fd, stored, first, min(step, stored.shape[0] - first)))
            blocks.append(block)
            times.append(ms)
    finally:
        os.close(fd)
    return blocks, times


def spread(times) -> str:
    return f"n={len(times)} sum {sum(times):.1f} ms, max {max(times):.1f}, p50 {sorted(times)[len(times) // 2]:.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--block-mb", type=float, default=32)
    ap.add_argument("--x-rows", type=int, default=256)
    args = ap.parse_args()
    print(mx.__version__, mx.default_device(), flush=True)
    path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    w = (mx.random.normal((args.rows, args.cols)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((args.x_rows, args.cols)).astype(mx.bfloat16)
    mx.save_safetensors(path, {"w": w, "x": x})
    ref = mx.sum((x @ w.T).astype(mx.float32)).item()
    del w
    mx.clear_cache()
    stored = weight_blocks.index_folder(Path(path).parent)["w"]
    step = max(1, int(args.block_mb * 2**20) // stored.row_bytes)
    os.system(f"cat {path} > /dev/null")  # page cache warm, like a second load

    def first_matmul(weight) -> str:
        s, ms = timed(lambda: mx.sum((x @ weight.T).astype(mx.float32)).item())
        return f"first matmul {ms:.1f} ms; same={abs(s - ref) < 1e-3 * abs(ref) + 1e-3}"

    for rep in range(2):
        lazy = mx.load(path)["w"]
        _, t_whole = timed(lambda: mx.eval(lazy))
        print(f"[{rep}] mlx Load whole: {t_whole:.1f} ms; {first_matmul(lazy)}", flush=True)
        del lazy
        mx.clear_cache()

        for label, read in (("numpy blocks", numpy_rows), ("window blocks", weight_blocks.read_rows)):
            blocks, times = read_in_blocks(stored, step, read)
            joined = mx.concatenate(blocks)
            _, t_join = timed(lambda: mx.eval(joined))
            del blocks
            print(
                f"[{rep}] {label} ({step} rows): {spread(times)}; join {t_join:.1f} ms; {first_matmul(joined)}",
                flush=True,
            )
            del joined
            mx.clear_cache()

        # In-place assembly: a zero tensor, block slice-updates evaluated one by one.
        out = mx.zeros(stored.shape, mx.bfloat16)
        _, t_zero = timed(lambda: mx.eval(out))

        def update(fd, stored, first, count):
            out[first : first + count] = numpy_rows(fd, stored, first, count)
            mx.eval(out)

        _, times = read_in_blocks(stored, step, update)
        print(f"[{rep}] in-place blocks: zeros {t_zero:.1f} ms; {spread(times)}; {first_matmul(out)}", flush=True)
        del out
        mx.clear_cache()


if __name__ == "__main__":
    main()
