"""Where does time go? Prefill and decode of variants on one synthetic model.

    python -m benchmarks.diagnose_gpu --synthetic llama3-8b --lengths 8192,32768

Variants: plain mlx-lm; ours with layer pieces and with whole-chunk pieces, at
two budgets. Each prints prefill and decode tokens/s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks import bench
from mlx_notebook.generation.pieces import LayerRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="llama3-8b")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    lengths = [int(x) for x in args.lengths.split(",")]
    worker, name, vocab, _ = bench.open_model("", args.synthetic, max(lengths), Path(tmp.name))
    for length in lengths:
        ids = bench.prompt_ids(length, vocab, seed=length)
        for _rep in range(args.repeats):
            for step in (2048, 1000):
                p = bench.plain_mlx_lm(worker, name, ids, args.decode_tokens, prefill_step_size=step)
                print(f"{length} plain step={step} prefill {p[0]:8.0f} decode {p[1]:6.1f}", flush=True)
            for pieces, budget, in_flight in (
                ("layers", 0.2, 1),
                ("layers", 0.01, 1),
                ("layers", 0.01, 2),
                ("chunks", 0.01, 1),
            ):
                if True:
                    LayerRunner.max_in_flight = in_flight
                    t0 = time.perf_counter()
                    o = bench.ours(worker, name, ids, args.decode_tokens, budget, pieces)
                    print(
                        f"{length} {pieces:6s} b={budget:<5} q={in_flight} prefill {o[0]:8.0f} decode {o[1]:6.1f} "
                        f"chunks {o[3]:3d} wall {time.perf_counter() - t0:.2f}s",
                        flush=True,
                    )
    worker.shutdown()


if __name__ == "__main__":
    main()
