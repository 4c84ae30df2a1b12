"""Probe: what does reading a big safetensors weight in row blocks cost, per backend?

Compares, for one large bf16 tensor: MLX's own lazy Load evaluated whole; row
blocks read with numpy then copied into MLX arrays; row blocks read by MLX from
a file-like window; and the join (concatenate) plus a first matmul on the result.

    python3 benchmarks/load_blocks_probe.py --rows 128256 --cols 4096 --block-mb 32
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import tempfile
import time

import numpy as np

import mlx.core as mx


class Window(io.RawIOBase):
    """A file-like view that presents rows [r0, r1) of one tensor as a one-tensor safetensors file."""

    def __init__(self, f, data_offset: int, nbytes: int, dtype: str, shape):
        super().__init__()
        header = json.dumps({"w": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]}}).encode()
        header += b" " * (-len(header) % 8)
        self.head = struct.pack("<Q", len(header)) + header
        self.f, self.data_offset, self.size = f, data_offset, len(self.head) + nbytes
        self.pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buf):
        mv = memoryview(buf).cast("B")
        n = 0
        if self.pos < len(self.head):
            k = min(len(mv), len(self.head) - self.pos)
            mv[:k] = self.head[self.pos:self.pos + k]
            n, self.pos = k, self.pos + k
        if n < len(mv):
            got = os.preadv(self.f.fileno(), [mv[n:]], self.data_offset + self.pos - len(self.head))
            n += got
            self.pos += got
        return n



def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--block-mb", type=float, default=32)
    ap.add_argument("--x-rows", type=int, default=256)
    args = ap.parse_args()
    print(mx.__version__, mx.default_device(), flush=True)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "w.safetensors")
    w = (mx.random.normal((args.rows, args.cols)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((args.x_rows, args.cols)).astype(mx.bfloat16)
    mx.save_safetensors(path, {"w": w, "x": x})
    ref = mx.sum((x @ w.T).astype(mx.float32)).item()
    del w
    mx.clear_cache()
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(hlen))
    start = 8 + hlen + meta["w"]["data_offsets"][0]
    row_bytes = args.cols * 2
    step = max(1, int(args.block_mb * 2**20) // row_bytes)
    os.system(f"cat {path} > /dev/null")  # page cache warm, like a second load

    for rep in range(2):
        lazy = mx.load(path)["w"]
        _, t_whole = timed(lambda: mx.eval(lazy))
        y, t_mm = timed(lambda: mx.eval(mx.sum((x @ lazy.T).astype(mx.float32))))
        print(f"[{rep}] mlx Load whole: {t_whole:.1f} ms; first matmul {t_mm:.1f} ms", flush=True)
        del lazy
        mx.clear_cache()

        times = []
        blocks = []
        with open(path, "rb", buffering=0) as f:
            for r0 in range(0, args.rows, step):
                n = min(step, args.rows - r0)
                def one():
                    buf = np.empty(n * row_bytes, np.uint8)
                    os.preadv(f.fileno(), [buf], start + r0 * row_bytes)
                    b = mx.array(buf).view(mx.bfloat16).reshape(n, args.cols)
                    mx.eval(b)
                    return b
                b, t = timed(one)
                blocks.append(b)
                times.append(t)
        joined, t_join = timed(lambda: mx.eval(mx.concatenate(blocks)) or None)
        joined = mx.concatenate(blocks)
        mx.eval(joined)
        del blocks
        s, t_mm = timed(lambda: mx.sum((x @ joined.T).astype(mx.float32)).item())
        print(f"[{rep}] numpy blocks ({step} rows): n={len(times)} sum {sum(times):.1f} ms, max {max(times):.1f}, "
              f"p50 {sorted(times)[len(times)//2]:.1f}; join {t_join:.1f} ms; first matmul {t_mm:.1f} ms; "
              f"same={abs(s-ref) < 1e-3 * abs(ref) + 1e-3}", flush=True)
        del joined
        mx.clear_cache()

        times = []
        blocks = []
        with open(path, "rb", buffering=0) as f:
            for r0 in range(0, args.rows, step):
                n = min(step, args.rows - r0)
                win = Window(f, start + r0 * row_bytes, n * row_bytes, "BF16", (n, args.cols))
                def one():
                    b = mx.load(win, format="safetensors")["w"]
                    mx.eval(b)
                    return b
                b, t = timed(one)
                blocks.append(b)
                times.append(t)
        joined = mx.concatenate(blocks)
        _, t_join = timed(lambda: mx.eval(joined))
        del blocks
        s, t_mm = timed(lambda: mx.sum((x @ joined.T).astype(mx.float32)).item())
        print(f"[{rep}] window blocks: n={len(times)} sum {sum(times):.1f} ms, max {max(times):.1f}, "
              f"p50 {sorted(times)[len(times)//2]:.1f}; join {t_join:.1f} ms; first matmul {t_mm:.1f} ms; "
              f"same={abs(s-ref) < 1e-3 * abs(ref) + 1e-3}", flush=True)
        del joined
        mx.clear_cache()

        # In-place assembly: a zero tensor, block slice-updates evaluated one by one.
        out = mx.zeros((args.rows, args.cols), mx.bfloat16)
        _, t_zero = timed(lambda: mx.eval(out))
        times = []
        with open(path, "rb", buffering=0) as f:
            for r0 in range(0, args.rows, step):
                n = min(step, args.rows - r0)
                def one():
                    buf = np.empty(n * row_bytes, np.uint8)
                    os.preadv(f.fileno(), [buf], start + r0 * row_bytes)
                    out[r0:r0 + n] = mx.array(buf).view(mx.bfloat16).reshape(n, args.cols)
                    mx.eval(out)
                _, t = timed(one)
                times.append(t)
        s, t_mm = timed(lambda: mx.sum((x @ out.T).astype(mx.float32)).item())
        print(f"[{rep}] in-place blocks: zeros {t_zero:.1f} ms; n={len(times)} sum {sum(times):.1f} ms, "
              f"max {max(times):.1f}, p50 {sorted(times)[len(times)//2]:.1f}; first matmul {t_mm:.1f} ms; "
              f"same={abs(s-ref) < 1e-3 * abs(ref) + 1e-3}", flush=True)
        del out
        mx.clear_cache()


if __name__ == "__main__":
    main()
