"""Longest wait between load-progress events of the default model: what a stop during load can wait for.

    python -m benchmarks.load_gaps --loads 3 --budget 0.2

Loads the default model ``--loads`` times on one worker (unloading in between) and
prints, per load, its duration and the four longest gaps between the listener's
``progress`` events of the load phase, in ms, with the event index and MB done/total.
There is a checkpoint after every batch that reports progress, so the longest gap
bounds the wait of a stop that lands during evaluation.
"""

from __future__ import annotations

import argparse
import time

import mlx_notebook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    args = ap.parse_args()
    worker = mlx_notebook.Worker()
    try:
        for _ in range(args.loads):
            stamps = []

            def on_event(event) -> None:
                if event.kind == "progress" and event.phase == "load":
                    stamps.append((time.perf_counter(), event.done, event.total))

            t0 = time.perf_counter()
            gen = mlx_notebook.generate("hi", max_tokens=1, stop_budget=args.budget, worker=worker)
            gen.add_listener(on_event)
            gen.result(timeout=600)
            gaps = sorted(
                ((b[0] - a[0], i, a[1], a[2]) for i, (a, b) in enumerate(zip(stamps, stamps[1:]))),
                reverse=True,
            )
            top = [(round(g * 1000), i, round(d / 1e6), round(t / 1e6)) for g, i, d, t in gaps[:4]]
            print(
                f"load {time.perf_counter() - t0:.2f} s, {len(stamps)} progress events; "
                f"longest gaps (ms, index, MB done, MB total): {top}",
                flush=True,
            )
            worker.call(lambda store: store.unload(None))
    finally:
        worker.shutdown()


if __name__ == "__main__":
    main()
