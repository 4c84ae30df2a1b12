"""Decode stops when one step is longer than the stop budget: steps in groups of layers, against whole steps.

    /work/bin/quiet python -m benchmarks.decode_pieces --budget 0.05 --rounds 20 \\
        --json benchmarks/results/cpu_decode_pieces.json

One process, one model (default: SmolLM2-135M, a decode step ~0.1 s on a
2-core CPU). With ``--budget`` below one step, the engine cuts each decode
step into groups of layers (``gen.stats.decode_pieces``); at ``--whole-budget``
(above a step) it does not. Measured, alternated:

* the decode rate (``stats.generation_tps``) of ``--repeats`` greedy
  generations of ``--tokens`` tokens at each budget;
* ``--rounds`` stops at ``--budget``, each at a random moment of the decode
  (uniform in 0.1-``--window`` s after the first token): ``cancel()`` to
  ``wait()`` returning (external) and ``stats.stop_latency_s`` (internal).

Run it on a checkout from before the change (``PYTHONPATH=<that checkout>``) for
the whole-step figures at the same budget.
"""

from __future__ import annotations

import mlx_notebook  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench import summary
from benchmarks.kv_memory import code_commit

PROMPT = "Write a long story about a lighthouse keeper who counts the ships passing in the night. " * 2


def run_once(model: str, worker: Any, budget: float, tokens: int) -> dict[str, Any]:
    gen = mlx_notebook.generate(PROMPT, model=model, worker=worker, max_tokens=tokens, stop_budget=budget)
    gen.result(timeout=600)
    s = gen.stats
    return {
        "budget_s": budget,
        "decode_tps": s.generation_tps,
        "decode_step_s": s.decode_step_s,
        "decode_pieces": getattr(s, "decode_pieces", 1),
        "tokens": list(gen.tokens),
    }


def stop_once(model: str, worker: Any, budget: float, delay: float) -> dict[str, Any]:
    gen = mlx_notebook.generate(PROMPT, model=model, worker=worker, max_tokens=2000, stop_budget=budget)
    deadline = time.monotonic() + 300
    while not gen.tokens and not gen.finished and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(delay)
    state = str(gen.state)
    t0 = time.perf_counter()
    gen.cancel()
    if not gen.wait(timeout=120):
        raise RuntimeError("no stop within 120 s")
    return {
        "delay_s": delay,
        "state": state,
        "external_s": time.perf_counter() - t0,
        "internal_s": gen.stats.stop_latency_s,
        "decode_pieces": getattr(gen.stats, "decode_pieces", 1),
        "final": str(gen.state),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or name (default: the built-in default model)")
    ap.add_argument("--budget", type=float, default=0.05, help="below one decode step: pieces")
    ap.add_argument("--whole-budget", type=float, default=0.3, help="above one decode step: whole steps")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    worker = mlx_notebook.Worker()
    worker.prompt_cache_gb = 0  # every generation prefills its prompt: no run is served from another's
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "commit": code_commit(),
        "library": mlx_notebook.__file__,
        "platform": platform.platform(),
        "model": args.model,
        "budget_s": args.budget,
        "whole_budget_s": args.whole_budget,
        "runs": [],
        "stops": [],
    }
    try:
        run_once(args.model, worker, args.whole_budget, 4)  # load, warm
        for _ in range(args.repeats):
            for budget in (args.budget, args.whole_budget):
                run = run_once(args.model, worker, budget, args.tokens)
                print(f"budget {budget}: {run['decode_tps']:.2f} tok/s, pieces {run['decode_pieces']}", flush=True)
                result["runs"].append(run)
        for _ in range(args.rounds):
            one = stop_once(args.model, worker, args.budget, rng.uniform(0.1, args.window))
            print(f"stop: {one['external_s'] * 1e3:.1f} ms ({one['state']}, pieces {one['decode_pieces']})", flush=True)
            result["stops"].append(one)
    finally:
        worker.shutdown(timeout=60)
    by = {b: [r for r in result["runs"] if r["budget_s"] == b] for b in (args.budget, args.whole_budget)}
    result["decode_tps_median"] = {str(b): statistics.median(r["decode_tps"] for r in runs) for b, runs in by.items()}
    first = by[args.budget][0]["tokens"] if by[args.budget] else []
    result["same_tokens_both_budgets"] = all(r["tokens"] == first for rs in by.values() for r in rs)
    decoding = [s for s in result["stops"] if s["state"] == "decoding"]
    result["stop_external_ms"] = summary([s["external_s"] * 1e3 for s in decoding])
    result["stop_internal_ms"] = summary([s["internal_s"] * 1e3 for s in decoding if s["internal_s"]])
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("decode_tps_median", "same_tokens_both_budgets", "stop_external_ms", "stop_internal_ms")
            },
            indent=1,
        )
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
