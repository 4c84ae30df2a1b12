"""Stopping the save and the load of a ~1 GB KV cache file (issue 23, generation/kv_file.py).

Builds a bf16 ``KVCache`` of ``--layers`` layers (default 24 x 8 heads x 11008
tokens x 128 dims, keys and values: 1.08 GB), then:

- throughput: ``kv_file.save`` / ``kv_file.load`` against ``mx.save_safetensors``
  / ``mx.load`` (evaluated) of the same arrays, best of ``--repeats``, in GB/s,
  and ours / theirs;
- stops: ``--rounds`` saves and ``--rounds`` loads, each stopped from another
  thread at a uniformly random moment of its expected duration; latency is
  stop request -> ``Cancelled`` reaching the caller (p50/p95/max); a round that
  finished before its stop does not count;
- the longest GIL hold during our save and load: a thread sleeps 1 ms at a
  time and records the largest gap between wake-ups (minus the 1 ms).

    python -m benchmarks.kv_file_stops [--rounds 20] [--budget 0.1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

import mlx_notebook  # noqa: F401  (OpenBLAS before mlx)
from mlx_notebook.control import Cancelled, CancelToken, Pace, unpaced
from mlx_notebook.generation import kv_file


def big_cache(layers: int, heads: int, tokens: int, dim: int) -> list[KVCache]:
    cache = []
    for i in range(layers):
        base = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        c = KVCache()
        c.state = (base, (base * 0.5).astype(mx.bfloat16), tokens)
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


class GilProbe:
    """Largest gap between 1 ms sleeps of a helper thread, i.e. the longest GIL hold (plus scheduling)."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last - 0.001)
            last = now

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def stop_round(work: Callable[[Pace], object], expected_s: float, budget: float, rng: random.Random) -> dict[str, Any]:
    """Run ``work`` and stop it from another thread at a random moment; return when and how it ended."""
    token = CancelToken()
    delay = rng.uniform(0.0, 0.6 * expected_s)  # warm runs beat the timed ones: stay inside them
    requested: list[float] = []

    def stop() -> None:
        requested.append(time.perf_counter())
        token.cancel()

    timer = threading.Timer(delay, stop)
    timer.start()
    try:
        work(Pace(token, budget))
        ended = time.perf_counter()
        stopped = False
    except Cancelled:
        ended = time.perf_counter()
        stopped = True
    finally:
        timer.cancel()
        timer.join(10)
    # A stop that landed after the last checkpoint (the save's final replace) counts too:
    # the caller waited from its request to the return all the same.
    return {
        "delay_s": delay,
        "stopped": stopped,
        "latency_s": ended - requested[0] if requested and requested[0] <= ended else None,
    }


def until_stopped(one: Callable[[], dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """Rounds until ``rounds`` stops landed before the work returned (at most 3x as many rounds)."""
    out: list[dict[str, Any]] = []
    while sum(r["latency_s"] is not None for r in out) < rounds and len(out) < 3 * rounds:
        out.append(one())
    return out


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    lat = np.array([r["latency_s"] for r in rounds if r["latency_s"] is not None] or [np.nan])
    return {
        "stopped": sum(r["stopped"] for r in rounds),
        "finished_after_stop": sum(not r["stopped"] and r["latency_s"] is not None for r in rounds),
        "finished_before_stop": sum(r["latency_s"] is None for r in rounds),
        "p50_s": round(float(np.percentile(lat, 50)), 4),
        "p95_s": round(float(np.percentile(lat, 95)), 4),
        "max_s": round(float(lat.max()), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.1, help="stop budget in seconds (default 0.1)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=11008)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, help="folder for the files (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cache = big_cache(args.layers, args.heads, args.tokens, args.dim)
    nbytes = kv_file.cache_nbytes(cache)
    flat = {f"{i}.{j}": a for i, c in enumerate(cache) for j, a in enumerate((c.keys, c.values))}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ours, theirs = Path(tmp) / "ours.safetensors", Path(tmp) / "theirs.safetensors"

        def load_theirs() -> None:
            arrays = mx.load(str(theirs))
            mx.eval(arrays)

        save_ours = best_of(args.repeats, lambda: kv_file.save(ours, cache, {"m": "x"}, unpaced(args.budget)))
        save_theirs = best_of(args.repeats, lambda: mx.save_safetensors(str(theirs), flat))
        load_ours = best_of(args.repeats, lambda: kv_file.load(ours, unpaced(args.budget)))
        load_theirs_s = best_of(args.repeats, load_theirs)
        with GilProbe() as probe_save:
            kv_file.save(ours, cache, {"m": "x"}, unpaced(args.budget))
        with GilProbe() as probe_load:
            loaded = kv_file.load(ours, unpaced(args.budget))
        del loaded
        target = Path(tmp) / "stopped.safetensors"
        saves = until_stopped(
            lambda: stop_round(lambda p: kv_file.save(target, cache, {"m": "x"}, p), save_ours, args.budget, rng),
            args.rounds,
        )
        leftovers = sorted(p.name for p in Path(tmp).iterdir() if p.name not in {ours.name, theirs.name, target.name})
        loads = until_stopped(
            lambda: stop_round(lambda p: kv_file.load(ours, p), load_ours, args.budget, rng), args.rounds
        )
        size = ours.stat().st_size
    gb = nbytes / 1e9
    result = {
        "cache_gb": round(gb, 3),
        "file_bytes": size,
        "budget_s": args.budget,
        "rounds": args.rounds,
        "save_gbps": round(gb / save_ours, 2),
        "save_mx_safetensors_gbps": round(gb / save_theirs, 2),
        "save_ratio": round(save_theirs / save_ours, 2),
        "load_gbps": round(gb / load_ours, 2),
        "load_mx_load_gbps": round(gb / load_theirs_s, 2),
        "load_ratio": round(load_theirs_s / load_ours, 2),
        "longest_gil_hold_save_s": round(probe_save.max_gap, 4),
        "longest_gil_hold_load_s": round(probe_load.max_gap, 4),
        "save_stops": summary(saves),
        "load_stops": summary(loads),
        "files_left_by_stopped_saves": leftovers,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"summary": result, "saves": saves, "loads": loads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
