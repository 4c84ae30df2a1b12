"""Prefill under CPU load: the chunk planner must not collapse when other processes take the cores.

    /work/bin/quiet python -m benchmarks.prefill_load --length 3000 --repeats 2 --stop-rounds 0 \\
        --out benchmarks/results/cpu_prefill_load_throughput.json
    /work/bin/quiet python -m benchmarks.prefill_load --length 3000 --repeats 0 --stop-rounds 20 \\
        --out benchmarks/results/cpu_prefill_load_stops.json

One process, one model (default: SmolLM2-135M), prompts of ``--length``
random tokens (no prompt cache). ``--busy`` busy loops
(``python3 -c 'while True: pass'``, started and ended here) are the load.

* throughput: ``--repeats`` pairs of one prefill with the cores quiet and
  one with the busy loops beside it, alternated (the planner carries its
  cost from one to the next, as in a notebook); the prefill time of each,
  its chunk sizes, and the ratio loaded / quiet of the medians. With
  ``--plain``, plain ``mlx_lm.stream_generate`` (2048-token chunks) the same
  way, for what the machine allows.
* stops: ``--stop-rounds`` generations under load, each stopped at a random
  moment of its prefill (uniform up to ``--window`` seconds); latency from
  ``cancel()`` to ``wait()`` returning: p50 / p95 / max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx_notebook  # before mlx: it loads OpenBLAS (fp32 matmuls ~30x faster than mlx's reference BLAS)
from benchmarks import bench


@contextmanager
def busy_loops(count: int):
    """``count`` busy Python loops beside this process while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0.0)  # let the scheduler see them
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def prefill_once(worker, name: str, ids: list[int], budget: float) -> dict[str, Any]:
    """One generation of one token; its prefill time and chunk sizes."""
    fed: list[int] = []
    gen = mlx_notebook.generate(ids, model=name, max_tokens=1, stop_budget=budget, worker=worker)
    gen.add_listener(lambda e: e.kind == "progress" and e.phase == "prefill" and fed.append(e.done))
    gen.result(timeout=900)
    sizes = [b - a for a, b in zip(fed, fed[1:]) if b > a]
    s = gen.stats
    return {
        "prefill_s": s.prompt_tokens / s.prompt_tps,
        "chunks": s.prefill_chunks,
        "sizes": sizes,
        "load_avg_1m": os.getloadavg()[0],
    }


def plain_once(worker, name: str, ids: list[int]) -> dict[str, Any]:
    prompt_tps, _, _ = bench.plain_mlx_lm(worker, name, ids, 1)
    return {"prefill_s": len(ids) / prompt_tps, "load_avg_1m": os.getloadavg()[0]}


def stop_round(worker, name: str, ids: list[int], budget: float, delay: float) -> dict[str, Any] | None:
    """Stop a generation ``delay`` seconds into its prefill; ``None`` when the prefill had ended by then."""
    fed: list[int] = []
    gen = mlx_notebook.generate(ids, model=name, max_tokens=1, stop_budget=budget, worker=worker)
    gen.add_listener(lambda e: e.kind == "progress" and e.phase == "prefill" and fed.append(e.done))
    deadline = time.monotonic() + 300
    while gen.state in ("queued", "loading") and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(delay)
    state = gen.state
    t0 = time.perf_counter()
    gen.cancel()
    if not gen.wait(timeout=120):
        raise RuntimeError("no stop within 120 s")
    latency = time.perf_counter() - t0
    if state != "prefilling":
        return None
    sizes = [b - a for a, b in zip(fed, fed[1:]) if b > a]
    return {"delay_s": delay, "latency_s": latency, "chunks": gen.stats.prefill_chunks, "first_chunks": sizes[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--length", type=int, default=3000)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the measurement")
    ap.add_argument("--repeats", type=int, default=2, help="quiet/loaded prefill pairs")
    ap.add_argument("--plain", action="store_true", help="also plain mlx-lm, quiet and loaded")
    ap.add_argument("--stop-rounds", type=int, default=20)
    ap.add_argument("--window", type=float, default=15.0, help="stop moments are uniform in [0, window] s")
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import mlx.core as mx

    tmp = tempfile.TemporaryDirectory(prefix="mlxnb-prefill-load-")
    synthetic = args.model if args.model in bench.SYNTHETIC else None
    worker, name, vocab, _ = bench.open_model(args.model, synthetic, args.length, Path(tmp.name))
    ids = bench.prompt_ids(args.length, vocab, seed=args.length)
    rng = random.Random(args.seed)
    result: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mlx": mx.__version__,
        "blas": mlx_notebook.active_blas(),
        "model": args.model,
        "length": args.length,
        "busy_loops": args.busy,
        "budget_s": args.budget,
        "command": " ".join(sys.argv),
        "runs": [],
    }
    try:
        # Warm the model's code paths (and the planner's cost) once, outside the figures.
        prefill_once(worker, name, ids[:256], args.budget)
        for r in range(args.repeats):
            order = ["quiet", "loaded"] if r % 2 == 0 else ["loaded", "quiet"]
            for which in order:
                with busy_loops(args.busy if which == "loaded" else 0):
                    run = {"load": which, "who": "ours", **prefill_once(worker, name, ids, args.budget)}
                    result["runs"].append(run)
                    print(f"{which} ours {run['prefill_s']:.1f} s, {run['chunks']} chunks", flush=True)
                    save(result, args.out)
                    if args.plain:
                        run = {"load": which, "who": "plain", **plain_once(worker, name, ids)}
                        result["runs"].append(run)
                        print(f"{which} plain {run['prefill_s']:.1f} s", flush=True)
                save(result, args.out)
        for who in ("ours", "plain"):
            times = {
                w: [x["prefill_s"] for x in result["runs"] if x["load"] == w and x["who"] == who]
                for w in ("quiet", "loaded")
            }
            if times["quiet"] and times["loaded"]:
                q, ld = statistics.median(times["quiet"]), statistics.median(times["loaded"])
                result[f"{who}_quiet_s"], result[f"{who}_loaded_s"] = q, ld
                result[f"{who}_loaded_over_quiet"] = ld / q
                print(f"{who}: quiet {q:.1f} s, loaded {ld:.1f} s, ratio {ld / q:.2f}", flush=True)
        if args.stop_rounds:
            stops = []
            with busy_loops(args.busy):
                result["stop_load_avg_1m_start"] = os.getloadavg()[0]
                for _ in range(args.stop_rounds):
                    one = stop_round(worker, name, ids, args.budget, rng.uniform(0, args.window))
                    if one is not None:
                        stops.append(one)
                        print(f"stop after {one['delay_s']:.2f} s: {one['latency_s'] * 1e3:.0f} ms", flush=True)
                result["stop_load_avg_1m_end"] = os.getloadavg()[0]
            result["stops"] = stops
            result["stop_latency_s"] = bench.summary([s["latency_s"] for s in stops])
            s = result["stop_latency_s"]
            print(
                f"stops under load: n={s['n']} p50={s['p50'] * 1e3:.0f} ms p95={s['p95'] * 1e3:.0f} ms "
                f"max={s['max'] * 1e3:.0f} ms",
                flush=True,
            )
    finally:
        worker.shutdown()
        save(result, args.out)


def save(result: dict, out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
