"""Cold start: the first prompt a fresh process prefills, stopped at a random moment.

    /work/bin/quiet python -m benchmarks.cold_start --models tiny,qwen256x6,default --rounds 6 \\
        --out benchmarks/results/cpu_cold_start.json

Each round is a new Python process: it loads the model (outside the clock),
submits a ``--length``-token prompt, waits a random ``[0, --window]`` seconds
after the prefill starts and stops it; the stop latency is from ``cancel()``
to ``wait()`` returning. The planner knows nothing in such a process: its
first chunks follow a small probe, and a stop must still land within the
budget + 50 ms. Models: ``tiny`` (testkit's random llama), ``qwen256x6`` (a
random qwen3, hidden 256, 6 layers, real-size tokenizer), ``default``
(SmolLM2-135M), or a shape of ``benchmarks.bench`` (``llama3-8b``, ``qwen3-8b``:
random weights, real-size tokenizers), built into ``--build-dir``::

    bash benchmarks/device_run.sh python3 -m benchmarks.cold_start --models qwen3-8b,llama3-8b \\
        --build-dir /tmp/build --rounds 8 --length 8192 --window 0.5 --budget 0.01 --out $OUT/h200_cold_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx_notebook
from benchmarks import bench

ROUND = r"""
import json, sys
import mlx_notebook
from benchmarks import bench
from benchmarks.prefill_load import stop_round
name, length, delay, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
w = mlx_notebook.Worker(prompt_cache_gb=0)
w.load_model(name)
vocab = w.call(lambda s: s.get(name).config.get("vocab_size", 30000))
print(json.dumps(stop_round(w, name, bench.prompt_ids(length, vocab), budget, delay)))
w.shutdown(timeout=60)
"""


def model_name(label: str, folder: Path) -> str:
    if label == "tiny":
        from testkit.tiny_model import make_tiny_model

        return str(make_tiny_model(folder / "tiny"))
    if label == "qwen256x6":
        from testkit.real_tokenizer import make_real_model

        return str(make_real_model(folder / "qwen256x6", hidden=256, layers=6))
    if label in bench.SYNTHETIC:  # the 8B shapes on an NVIDIA machine
        return bench.build_synthetic(label, folder / label)
    return label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,qwen256x6,default")
    ap.add_argument("--rounds", type=int, default=6, help="fresh processes per model")
    ap.add_argument("--length", type=int, default=3500)
    ap.add_argument("--window", type=float, default=1.5, help="stop moments uniform in [0, window] s of prefill")
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument("--build-dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="mlxnb-cold-")
    folder = args.build_dir or Path(tmp.name)
    rng = random.Random(args.seed)
    # The repository first, then what the caller had (the device's mlx install).
    path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    result: dict[str, Any] = {"command": " ".join(sys.argv), "budget_s": args.budget, "models": {}}
    for label in args.models.split(","):
        name = model_name(label, folder)
        rounds = []
        for _ in range(args.rounds):
            delay = rng.uniform(0, args.window)
            proc = subprocess.run(
                [sys.executable, "-c", ROUND, name, str(args.length), str(delay), str(args.budget)],
                capture_output=True,
                text=True,
                timeout=600,
                env=env,
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not lines:
                raise RuntimeError(f"round failed: {proc.stderr[-2000:]}")
            one = json.loads(lines[-1])
            if one is None:
                print(f"{label} stop at {delay:.2f} s: the prefill had ended", flush=True)
                continue
            rounds.append(one)
            print(
                f"{label} stop at {delay:.2f} s: {one['latency_s'] * 1e3:.0f} ms, first chunks {one['first_chunks'][:6]}",
                flush=True,
            )
        hits = [r["latency_s"] for r in rounds]
        result["models"][label] = {
            "rounds": rounds,
            "stop_latency_s": bench.summary(hits),
            "within_budget_plus_50ms": sum(x <= args.budget + 0.05 for x in hits),
            "in_prefill": len(hits),
            "rounds_total": args.rounds,
        }
        s = result["models"][label]["stop_latency_s"]
        if s["n"]:
            print(f"{label}: n={s['n']} p50={s['p50'] * 1e3:.0f} ms max={s['max'] * 1e3:.0f} ms", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
