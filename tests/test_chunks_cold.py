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

import mlx_notebook
from testkit.fault_rounds import TINY_PREFILL
from testkit.waiting import held, wait_prefill_chunks

ROOT = Path(__file__).resolve().parents[1]

FRESH = r"""
import json, sys
import mlx_notebook
from testkit.waiting import held, in_prefill
w = mlx_notebook.Worker(prompt_cache_gb=0)
w.load_model(sys.argv[1])
fed = []
with held(w):  # the listeners see the first chunk
    gen = mlx_notebook.generate([16 + i % 300 for i in range(4000)], model=sys.argv[1], max_tokens=1, worker=w)
    gen.add_listener(lambda e: e.kind == "progress" and e.phase == "prefill" and fed.append(e.done))
    in_prefill(gen, gen.cancel, chunks=4)
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


def test_the_next_prompt_opens_with_a_chunk_no_larger_than_the_last_prompt_ran(tiny_model: str) -> None:
    # The fault campaign's prefill stops of 0.4-0.8 s at budget 0.05 (session 38): the first prompt's fit put
    # its late chunks' cost into the context part and carried a per-token part of 0, and the next prompt opened
    # with a 2,048-token chunk. It now starts from the last prompt's chunks, their measured cost per token included.
    first = TINY_PREFILL  # the campaign's (~2,700 tokens); the same again, no prompt cache to restore it from
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        fed: list[int] = []
        with held(worker):  # the listeners see the first chunks
            gen = mlx_notebook.generate(first, model=tiny_model, max_tokens=1, worker=worker, stop_budget=0.05)
            gen.add_listener(lambda e: e.kind == "progress" and e.phase == "prefill" and fed.append(e.done))
        gen.result(timeout=300)
        ran = [b - a for a, b in zip(fed, fed[1:]) if b > a]
        fed_next: list[int] = []
        with held(worker):
            nxt = mlx_notebook.generate(first, model=tiny_model, max_tokens=1, worker=worker, stop_budget=0.05)
            nxt.add_listener(lambda e: e.kind == "progress" and e.phase == "prefill" and fed_next.append(e.done))
        wait_prefill_chunks(nxt, 2, timeout=120)
        nxt.cancel()
        assert nxt.wait(60) and nxt.state == "stopped"
        opened = [b - a for a, b in zip(fed_next, fed_next[1:]) if b > a][0]
        assert opened <= max(ran), (opened, ran)
        print(f"next prompt: first chunk {opened} (the last prompt's {ran}); stop {nxt.stats.stop_latency_s:.3f} s")
    finally:
        assert worker.shutdown(timeout=60)
