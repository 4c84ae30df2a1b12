"""Where does a stop's wait go? Each stop split into its parts.

    python -m benchmarks.stop_breakdown --synthetic llama3-8b --lengths 512,32768 --rounds 8 --budget 0.01

For each prompt length and phase (prefill, decode), ``--rounds`` stops at a random
moment; each is split, in ms, into:

* ``piece``: from ``cancel()`` to the worker's checkpoint raising ``Cancelled``:
  the worker was waiting for the piece of device work it was on (a decode step's
  ``.item()``, or the layer group being evaluated), plus Python between checkpoints;
* ``queued``: the worker's ``mx.synchronize`` after that: device work already
  queued behind that piece (the next decode step, the next layer group);
* ``finish``: from the end of that synchronize to the generation's "stopped" state;
* ``wake``: from there to ``wait()`` returning in the caller's thread.

Benchmark-only instrumentation: it wraps ``CancelToken.checkpoint`` and
``Worker._synchronize_quietly`` of this process to take the timestamps.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import mlx_notebook
from benchmarks import bench
from mlx_notebook import control
from mlx_notebook.generation import worker as worker_module

marks: dict = {}


def _instrument() -> None:
    checkpoint = control.CancelToken.checkpoint
    synchronize = worker_module.Worker._synchronize_quietly

    def timed_checkpoint(self, *args, **kwargs):
        try:
            return checkpoint(self, *args, **kwargs)
        except control.Cancelled:
            marks.setdefault("raised", time.perf_counter())
            raise

    def timed_synchronize(self):
        start = time.perf_counter()
        synchronize(self)
        if "raised" in marks and "synced" not in marks:
            marks["sync_start"], marks["synced"] = start, time.perf_counter()

    control.CancelToken.checkpoint = timed_checkpoint
    worker_module.Worker._synchronize_quietly = timed_synchronize


def stop_once(worker, name, ids, phase, budget, rng, window_s):
    gen = mlx_notebook.generate(
        ids, model=name, max_tokens=100000 if phase == "decode" else 2, stop_budget=budget, worker=worker
    )
    wanted = {"prefill": "prefilling", "decode": "decoding"}[phase]

    def on_event(event):
        if event.kind == "state" and event.state == "stopped":
            marks["finished"] = time.perf_counter()

    gen.add_listener(on_event)
    while gen.state != wanted and not gen.finished:
        time.sleep(0.0002)
    time.sleep(rng.uniform(0, window_s))
    state = gen.state
    marks.clear()
    t0 = time.perf_counter()
    gen.cancel()
    gen.wait()
    t1 = time.perf_counter()
    if state != wanted or gen.state != "stopped" or not {"raised", "synced", "finished"} <= marks.keys():
        return None
    ms = lambda a, b: round((b - a) * 1000, 2)  # noqa: E731
    return {
        "total": ms(t0, t1),
        "piece": ms(t0, marks["raised"]),
        "between": ms(marks["raised"], marks["sync_start"]),
        "queued": ms(marks["sync_start"], marks["synced"]),
        "finish": ms(marks["synced"], marks["finished"]),
        "wake": ms(marks["finished"], t1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--synthetic", choices=sorted(bench.SYNTHETIC))
    ap.add_argument("--lengths", default="512")
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument("--window", type=float, default=0.5, help="the random stop moment's cap, seconds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    _instrument()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = tempfile.TemporaryDirectory()
    worker, name, vocab, _ = bench.open_model(args.model, args.synthetic, max(lengths), Path(tmp.name))
    rng = random.Random(0)
    results = []
    try:
        for length in lengths:
            ids = bench.prompt_ids(length, vocab, seed=length)
            # Warm-up, as for a user's later runs of a prompt: the first run measures the
            # cost (small first chunks), the second plans from it; both compile their shapes.
            for _ in range(2):
                mlx_notebook.generate(ids, model=name, max_tokens=4, stop_budget=args.budget, worker=worker).result()
            for phase in args.phases.split(","):
                rows = [
                    r
                    for r in (
                        stop_once(worker, name, ids, phase, args.budget, rng, args.window) for _ in range(args.rounds)
                    )
                    if r
                ]
                for part in ("total", "piece", "between", "queued", "finish", "wake"):
                    values = [r[part] for r in rows]
                    s = bench.summary(values)
                    print(f"{length:6d} {phase:8s} {part:8s} n={s['n']} p50={s['p50']} max={s['max']}", flush=True)
                results.append({"length": length, "phase": phase, "rounds": rows})
    finally:
        worker.shutdown()
    if args.out:
        args.out.write_text(
            json.dumps({"command": " ".join(sys.argv), "budget": args.budget, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
