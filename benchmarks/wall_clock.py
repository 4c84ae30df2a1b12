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

Each check runs ``--rounds`` times; the worst round is held against the limit,
and every round's figures go to the JSON with the machine's load, the BLAS and
the commit.

Usage::

    /work/bin/quiet python -m benchmarks.wall_clock [--model default] [--rounds 3] [--out results.json]

Exits 1 when a limit is exceeded, or a check did not measure what it says
(the stop missed the prefill or the import, the kernel needed a signal to exit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
import sys, threading, time
import mlx_notebook
assert "mlx_lm.utils" not in sys.modules
gen = mlx_notebook.generate("hi", model=sys.argv[1], max_tokens=1000)
while gen.state != "loading" and not gen.finished:
    time.sleep(0.001)
gen.cancel()
t0 = time.perf_counter()
assert gen.wait(30)
seconds = time.perf_counter() - t0
importing = any(t.name == "mlx-notebook-import" and t.is_alive() for t in threading.enumerate())
print("RESULT", gen.state, seconds, importing)
"""


def background_cell_and_shutdown(model: str) -> dict[str, Any]:
    """Seconds for a background cell to return, and for a shutdown mid-generation to end the kernel."""
    session = start_kernel(model, text=True)
    try:
        assert session.execute(f"%%mlxgen -n 4 --wait\n{PROMPT}", timeout=600).ok  # loaded
        reply = session.execute(f"%%mlxgen -n 400 -o g\n{PROMPT}")
        assert reply.ok, reply.content
        wait_decoding(session, reply.msg_id)
        start = time.monotonic()
        session.km.shutdown_kernel(now=False)
        code = session.process.wait(timeout=10)
        # 0: it exited by itself; negative: jupyter_client had to signal it.
        return {"background_cell": reply.seconds, "shutdown": time.monotonic() - start, "shutdown_exit_code": code}
    finally:
        session.close()


def prefill_stop() -> dict[str, Any]:
    """Seconds from a stop in a long prefill on the 4-bit default model to ``wait()`` returning."""
    os.environ["MLX_NOTEBOOK_CPU_DEQUANTIZE"] = "0"
    worker = mlx_notebook.Worker()
    try:
        gen = mlx_notebook.generate(LONG, max_tokens=8, worker=worker)
        wait_prefill_chunks(gen, 3, timeout=600)
        chunks_at_stop = gen.stats.prefill_chunks
        t0 = time.perf_counter()
        gen.cancel()
        assert gen.wait(120) and gen.state == "stopped", gen.state
        seconds = time.perf_counter() - t0
        return {
            "prefill_stop": seconds,
            "prompt_tokens": gen.stats.prompt_tokens,
            "prefill_chunks_at_stop": chunks_at_stop,
            "prefill_chunks_at_end": gen.stats.prefill_chunks,
            "generated_tokens": gen.stats.generated_tokens,  # 0: the stop landed in the prefill
            "stop_latency_s": gen.stats.stop_latency_s,
            "load_s": gen.stats.load_s,
        }
    finally:
        del os.environ["MLX_NOTEBOOK_CPU_DEQUANTIZE"]
        worker.shutdown()


def first_import_stop(tiny: str) -> dict[str, Any]:
    """Seconds from a stop during the first import of mlx-lm (in a fresh process) to ``wait()`` returning."""
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT, tiny], capture_output=True, text=True, timeout=300, cwd=str(REPO)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, state, seconds, importing = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT")).split()
    assert state == "stopped", proc.stdout
    # Still importing when wait() returned: the stop landed in the import, not after it.
    return {"first_import_stop": float(seconds), "import_still_running": importing == "True"}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=str(REPO))
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=str(REPO)
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="model of the kernel and prefill checks (default: default)")
    ap.add_argument("--rounds", type=int, default=3, help="times each check runs; the worst is held (default: 3)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    began = time.monotonic()
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(make_tiny_model(Path(tmp) / "tiny"))
        os.environ.setdefault("MLX_NOTEBOOK_CACHE", str(Path(tmp) / "cache"))
        for _ in range(args.rounds):
            figures = background_cell_and_shutdown(args.model)
            if args.model == "default":
                figures.update(prefill_stop())
            figures.update(first_import_stop(tiny))
            figures["loadavg_1m"] = os.getloadavg()[0]
            rounds.append(figures)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}, flush=True)
    worst = {name: max(r[name] for r in rounds) for name in LIMITS_S if name in rounds[0]}
    over = {k: v for k, v in worst.items() if v > LIMITS_S[k]}
    # A check that did not measure what it says fails too.
    wrong = [f"round {i}: {problem}" for i, r in enumerate(rounds) for problem in _not_measured(r)]
    for name, value in worst.items():
        print(
            f"{name:18s} {value:7.3f} s worst of {len(rounds)}  (limit {LIMITS_S[name]} s){'  OVER' if name in over else ''}"
        )
    for line in wrong:
        print(f"NOT MEASURED: {line}")
    if args.out:
        result = {
            "command": "python -m benchmarks.wall_clock " + " ".join(sys.argv[1:]),
            "commit": _commit(),
            "model": args.model,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "mlx": _mlx_version(),
            "blas": mlx_notebook.active_blas(),
            "loadavg_1m_before": load_before[0],
            "wall_s": time.monotonic() - began,
            "worst_s": worst,
            "limits_s": LIMITS_S,
            "over": sorted(over),
            "not_measured": wrong,
            "rounds": rounds,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(1 if over or wrong else 0)


def _not_measured(figures: dict[str, Any]) -> list[str]:
    """What a round's figures say it did not measure (the limit it was checked against would lie)."""
    problems = []
    if figures["shutdown_exit_code"] != 0:
        problems.append(f"the kernel needed a signal to exit (exit code {figures['shutdown_exit_code']})")
    if figures.get("generated_tokens", 0):
        problems.append("the stop did not land in the prefill")
    if not figures["import_still_running"]:
        problems.append("the mlx-lm import had ended before the stop")
    return problems


def _mlx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("mlx", "mlx-cpu"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return ""


if __name__ == "__main__":
    main()
