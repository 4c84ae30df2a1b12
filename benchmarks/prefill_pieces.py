"""How long does each prefill piece run against its target? The stop waits for one.

    python -m benchmarks.prefill_pieces --model default --length 4000 --budget 0.1

Runs one generation's prefill with layer-granular pieces and times every wait
of the worker on a layer group (what a stop lands behind), against the group
target (``budget / (max_in_flight + 1)``). Prints the five longest waits,
the chunk count and the prefill speed. ``--model tiny`` builds the small
random-weight model of ``bench.py`` instead.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlx_notebook
from benchmarks import bench
from mlx_notebook.generation import pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    synthetic = "tiny" if args.model == "tiny" else None
    worker, name, vocab, _ = bench.open_model(args.model, synthetic, args.length, Path(tmp.name))
    waits = []
    hook = pieces.LayerRunner._hook

    def timed_hook(self, index, hidden):
        before = len(self._in_flight)
        t0 = time.perf_counter()
        hook(self, index, hidden)
        if len(self._in_flight) <= before:  # it waited on a group
            waits.append(time.perf_counter() - t0)

    pieces.LayerRunner._hook = timed_hook
    try:
        gen = mlx_notebook.generate(
            bench.prompt_ids(args.length, vocab), model=name, max_tokens=1, stop_budget=args.budget, worker=worker
        )
        gen.result()
    finally:
        worker.shutdown()
    target = args.budget / (pieces.LayerRunner.groups_queued() + 1)
    longest = [round(w * 1000, 1) for w in sorted(waits, reverse=True)[:5]]
    print(
        f"{args.length} tokens, {gen.stats.prefill_chunks} chunks, {len(waits)} group waits, "
        f"{gen.stats.prompt_tps:.0f} tok/s; longest waits ms {longest} (target {target * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
