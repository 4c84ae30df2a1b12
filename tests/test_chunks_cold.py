"""A fresh process's first prefill: the first chunks grow from a small probe, never past what was measured.

The regression test for issue 20 item 4 (cold overshoot): a new process knows
no cost, so the planner's first chunks follow an 8-token probe, each at most 4x
the largest chunk before it, and a stop in those first chunks parks the
generation. Timing is a figure, not a pass mark here (benchmarks/cold_start.py
measures stop latency over many fresh processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FRESH = r"""
import json, sys
import mlx_notebook
from testkit.waiting import wait_prefill_chunks
w = mlx_notebook.Worker(prompt_cache_gb=0)
w.load_model(sys.argv[1])
fed = []
gen = mlx_notebook.generate([16 + i % 300 for i in range(4000)], model=sys.argv[1], max_tokens=1, worker=w)
gen.add_listener(lambda e: e.kind == "progress" and e.phase == "prefill" and fed.append(e.done))
wait_prefill_chunks(gen, 4, timeout=120)
gen.cancel()
stopped = gen.wait(60) and gen.state == "stopped"
print(json.dumps({"stopped": stopped, "fed": fed, "stop_s": gen.stats.stop_latency_s}))
w.shutdown(timeout=60)
"""


def test_a_fresh_process_grows_its_first_chunks_from_a_probe(tiny_model: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, tiny_model], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stopped"], out
    sizes = [b - a for a, b in zip(out["fed"], out["fed"][1:]) if b > a]
    assert sizes and sizes[0] <= 8, sizes
    for i, n in enumerate(sizes[1:], 1):
        assert n <= 4 * max(sizes[:i]), sizes
    # The stop landed in the prefill, with most of the prompt still ahead.
    assert out["fed"][-1] < 4000, out["fed"]
    print(f"fresh process: first chunks {sizes[:6]}, stop {out['stop_s']}")
