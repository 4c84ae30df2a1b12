"""Wall-clock limits that used to be assertions in tests: run them on a quiet machine.

A test that asserts "under 3 s" on a shared 2-core CPU fails when a neighbour
is busy, and passes on a fast machine whatever the code does; the tests now
check the order of events instead (the next cell runs before the generation
ends, the stop lands inside the prefill, the import is still running when the
stop takes effect, jupyter_client never had to signal the kernel) and print
the seconds. This script measures the same four things and holds the limits:

* a background ``%%mlxgen`` cell returns within 3 s;
* a stop in the prefill of a 1,200-token prompt on the 4-bit default model
  (a minute of prefill here) lands within 5 s;
* a stop during the first import of mlx-lm lands within 0.5 s;
* a kernel shut down mid-generation exits within 2.5 s (jupyter_client's SIGTERM).

Usage::

    /work/bin/quiet python -m benchmarks.wall_clock [--model default] [--out results.json]

Exits 1 when a limit is exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_notebook
from testkit.kernel_helpers import REPO, start_kernel, wait_decoding
from testkit.tiny_model import make_tiny_model
from testkit.waiting import wait_prefill_chunks

LIMITS_S = {"background_cell": 3.0, "prefill_stop": 5.0, "first_import_stop": 0.5, "shutdown": 2.5}
PROMPT = "Name three rivers."
LONG = "Summarize this text. " + " ".join(
    f"Paragraph {i}: the river flows through the valley and the town grows beside it." for i in range(70)
)
_FIRST_IMPORT = """
import sys, time
import mlx_notebook
gen = mlx_notebook.generate("hi", model=sys.argv[1], max_tokens=1000)
while gen.state != "loading" and not gen.finished:
    time.sleep(0.001)
gen.cancel()
t0 = time.perf_counter()
assert gen.wait(30)
print("RESULT", gen.state, time.perf_counter() - t0)
"""


def background_cell_and_shutdown(model: str) -> dict[str, float]:
    """Seconds for a background cell to return, and for a shutdown mid-generation to end the kernel."""
    session = start_kernel(model, text=True)
    try:
        assert session.execute(f"%%mlxgen -n 4 --wait\n{PROMPT}", timeout=600).ok  # loaded
        reply = session.execute(f"%%mlxgen -n 400 -o g\n{PROMPT}")
        assert reply.ok, reply.content
        wait_decoding(session, reply.msg_id)
        start = time.monotonic()
        session.km.shutdown_kernel(now=False)
        session.process.wait(timeout=10)
        return {"background_cell": reply.seconds, "shutdown": time.monotonic() - start}
    finally:
        session.close()


def prefill_stop() -> float:
    """Seconds from a stop in a long prefill on the 4-bit default model to ``wait()`` returning."""
    os.environ["MLX_NOTEBOOK_CPU_DEQUANTIZE"] = "0"
    worker = mlx_notebook.Worker()
    try:
        gen = mlx_notebook.generate(LONG, max_tokens=8, worker=worker)
        wait_prefill_chunks(gen, 3, timeout=600)
        t0 = time.perf_counter()
        gen.cancel()
        assert gen.wait(120) and gen.state == "stopped", gen.state
        return time.perf_counter() - t0
    finally:
        del os.environ["MLX_NOTEBOOK_CPU_DEQUANTIZE"]
        worker.shutdown()


def first_import_stop(tiny: str) -> float:
    """Seconds from a stop during the first import of mlx-lm (in a fresh process) to ``wait()`` returning."""
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT, tiny], capture_output=True, text=True, timeout=300, cwd=str(REPO)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, state, seconds = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT")).split()
    assert state == "stopped", proc.stdout
    return float(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="model of the kernel and prefill checks (default: default)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(make_tiny_model(Path(tmp) / "tiny"))
        os.environ.setdefault("MLX_NOTEBOOK_CACHE", str(Path(tmp) / "cache"))
        seconds = background_cell_and_shutdown(args.model)
        seconds["prefill_stop"] = prefill_stop() if args.model == "default" else float("nan")
        seconds["first_import_stop"] = first_import_stop(tiny)
    over = {k: v for k, v in seconds.items() if v > LIMITS_S[k]}
    for name, value in seconds.items():
        print(f"{name:18s} {value:7.3f} s  (limit {LIMITS_S[name]} s){'  OVER' if name in over else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps({"seconds": seconds, "limits_s": LIMITS_S}, indent=2) + "\n")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
