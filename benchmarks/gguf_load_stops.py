"""Stopping a load while a K-quant GGUF file is being dequantized (issue 24).

Writes a qwen3-shaped file of llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for the
embedding, attn_v and ffn_down; random valid blocks), then, per round, loads it
through a worker with an empty conversion cache (so the block-by-block
conversion runs), stops the generation at a random moment of the
"converting GGUF" step, and measures stop -> generation finished. Also reports
how long each block took (the time between progress reports).

    python -m benchmarks.gguf_load_stops --rounds 20
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlx_notebook
from mlx_notebook.generation.handle import GenerationEvent
from mlx_notebook.loading.store import ModelStore
from testkit import gguf_writer as gw

STEP = "load: converting GGUF"
MIX = {"embed_tokens": "Q6_K", "v_proj": "Q6_K", "down_proj": "Q6_K", "*": "Q4_K"}


def write_file(path: Path, *, hidden: int, layers: int, intermediate: int, vocab: int) -> Path:
    config, weights = gw.family_weights(
        "qwen3", hidden=hidden, layers=layers, intermediate=intermediate, vocab=vocab, head_dim=hidden // 4
    )
    blocks = {}
    for i, (name, array) in enumerate(weights.items()):
        if array.ndim == 2:
            kind = next((t for key, t in MIX.items() if key in name), MIX["*"])
            blocks[name] = (kind, gw.random_blocks(array.shape, kind, seed=i))
    return gw.write_family_gguf(path, "qwen3", config, weights, blocks=blocks)


def one_round(path: Path, cache: Path, budget: float, rng: random.Random) -> dict[str, Any]:
    worker = mlx_notebook.Worker(ModelStore(cache))
    times: list[float] = []
    last = [0, 1]
    converting = threading.Event()

    def listen(event: GenerationEvent) -> None:
        if event.kind == "progress" and event.phase == STEP:
            times.append(time.perf_counter())
            last[:] = [event.done, event.total]
            if event.done > 0:
                converting.set()

    try:
        gen = mlx_notebook.generate("Hi", model=str(path), max_tokens=1, stop_budget=budget, worker=worker)
        gen.add_listener(listen)
        if not converting.wait(120):
            raise RuntimeError("the conversion never reported progress")
        time.sleep(rng.uniform(0.0, 0.5))
        during = len(times)
        unfinished = last[0] < last[1]
        t0 = time.perf_counter()
        gen.cancel()
        if not gen.wait(60):
            raise RuntimeError("the stop did not finish in 60 s")
        latency = time.perf_counter() - t0
        blocks = np.diff(times).tolist()
        return {
            "latency_s": latency,
            "state": str(gen.state),
            "during_conversion": unfinished and str(gen.state) == "stopped",
            "blocks_before_stop": during,
            "block_s": blocks,
        }
    finally:
        worker.shutdown(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--budget", type=float, default=0.1, help="stop budget in seconds (default 0.1)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_file(
            Path(tmp) / "qwen3-q4_k_m.gguf",
            hidden=args.hidden,
            layers=args.layers,
            intermediate=args.intermediate,
            vocab=args.vocab,
        )
        size = path.stat().st_size
        rounds = [one_round(path, Path(tmp) / f"cache{i}", args.budget, rng) for i in range(args.rounds)]
    # Only stops that landed while blocks remained count (a round whose conversion ended first does not).
    latencies = np.array([r["latency_s"] for r in rounds if r["during_conversion"]] or [np.nan])
    blocks = np.array([b for r in rounds for b in r["block_s"]])
    summary = {
        "file_mb": round(size / 1e6, 1),
        "budget_s": args.budget,
        "rounds": args.rounds,
        "stops_during_conversion": sum(r["during_conversion"] for r in rounds),
        "states": sorted({r["state"] for r in rounds}),
        "stop_p50_s": float(np.percentile(latencies, 50)),
        "stop_p95_s": float(np.percentile(latencies, 95)),
        "stop_max_s": float(latencies.max()),
        "block_p50_s": float(np.percentile(blocks, 50)) if len(blocks) else None,
        "block_p95_s": float(np.percentile(blocks, 95)) if len(blocks) else None,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
