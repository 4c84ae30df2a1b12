"""Does the machine stall on its own? A fixed device workload timed step by step, none of our library in it.

    python -m benchmarks.host_stalls --seconds 5 --step-ms 10 --out host.json

The join's acceptance line (issue 20) bounds the others' longest gap between two
tokens by budget + 2 steps, about 27-44 ms on an H100. Some hosts lent to us
stall by themselves: with no prompt joining, the benchmark's quiet window
(``others_quiet_gaps_ms``) read gaps of 35-56 ms in 10 of 18 one-second windows
(session 55), where session 53's hosts read none. This tells a slow host from
a slow library without the library: three readings, each its own phase.

- ``idle_gpu``: the GPU's reported utilization and the compute processes it
  lists while this process runs nothing on it (another tenant shows here);
- ``sleeps``: 1 ms sleeps on the host, how late each wakes (a descheduled
  thread, e.g. a host whose CPUs are oversubscribed);
- ``steps``: a decode-like step (a chain of matrix products over ``--layers``
  weights, its length calibrated to ``--step-ms``) evaluated one at a time, as
  a decode loop does, and each one timed: a step far past the median with the
  same work in it is the machine's.

Plus ``steal_s``: the CPU time the hypervisor gave to others during the run
(``/proc/stat``'s steal column, where there is one).
"""

from __future__ import annotations

import mlx_notebook  # noqa: F401  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from benchmarks import bench

# A step this many times the median is a stall (a decode step's token gap
# past budget + 2 steps is at least ~3 steps long at budget 0.01).
STALL_FACTOR = 2.5


def steal_seconds() -> float | None:
    """The CPUs' total steal time so far, in seconds (``None`` where ``/proc/stat`` has no steal column)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return None


def idle_gpu(seconds: float) -> dict | None:
    """The GPU's utilization samples (every 100 ms) and listed compute processes while this process leaves it idle."""
    try:
        util = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "100"],
            capture_output=True,
            text=True,
            timeout=seconds,
        )
        out = util.stdout
    except subprocess.TimeoutExpired as timed_out:
        out = timed_out.stdout.decode() if isinstance(timed_out.stdout, bytes) else (timed_out.stdout or "")
    except OSError:
        return None
    samples = [line.split(",") for line in out.splitlines() if line.strip()]
    busy = [int(s[0]) for s in samples if s[0].strip().isdigit()]
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.split("\n")
    return {
        "samples": len(busy),
        "utilization_max": max(busy, default=None),
        "utilization_mean": round(statistics.fmean(busy), 1) if busy else None,
        "memory_used_mib": samples[-1][1].strip() if samples else None,
        "compute_apps": [a.strip() for a in apps if a.strip()],
    }


def sleeps(seconds: float) -> dict:
    """How late 1 ms sleeps wake, in ms: the host's scheduling on its own."""
    late = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        time.sleep(0.001)
        late.append((time.perf_counter() - t0) * 1000 - 1.0)
    late.sort()
    return {"count": len(late), "p50_ms": round(late[len(late) // 2], 3), "max_ms": round(late[-1], 2)}


class Step:
    """A decode-like step: ``x @ W`` through ``layers`` weights, ``repeats`` times, one eval."""

    def __init__(self, dim: int, layers: int, rows: int) -> None:
        dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        scale = dim**-0.5
        self.weights = [(mx.random.normal((dim, dim)) * scale).astype(dtype) for _ in range(layers)]
        self.x = mx.random.normal((rows, dim)).astype(dtype)
        mx.eval(self.weights, self.x)
        self.repeats = 1

    def __call__(self) -> float:
        t0 = time.perf_counter()
        h = self.x
        for _ in range(self.repeats):
            for w in self.weights:
                h = mx.tanh(h @ w)
        mx.eval(h)
        return (time.perf_counter() - t0) * 1000

    def calibrate(self, step_ms: float) -> float:
        """Set ``repeats`` so one step takes about ``step_ms``; the step's median then."""
        for _ in range(3):
            self()  # the kernels' first uses
        # Twice: a step's fixed cost (its eval's round trip) made one scaling land at ~6 of 10 ms (session 55's H100).
        for _ in range(2):
            measured = statistics.median(self() for _ in range(5))
            self.repeats = max(1, round(self.repeats * step_ms / max(measured, 1e-3)))
        return statistics.median(self() for _ in range(5))


def steps(step: Callable[[], float], seconds: float) -> dict:
    """Time ``step`` back to back for ``seconds``; its median, tail and the stalls past ``STALL_FACTOR`` x the median."""
    times, at = [], []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        at.append(now - start)
        step()
        times.append((time.perf_counter() - now) * 1000)  # the wall, so a stall around the step's own clock counts
    median = statistics.median(times)
    stalls = [(round(t, 1), round(a, 2)) for t, a in zip(times, at) if t > STALL_FACTOR * median]
    stalls.sort(reverse=True)
    return {
        "count": len(times),
        "p50_ms": round(median, 2),
        "p99_ms": round(bench.percentile(times, 99), 2),
        "max_ms": round(max(times), 1),
        "stalls": len(stalls),
        "stalls_per_s": round(len(stalls) / seconds, 2),
        "longest_ms_at_s": stalls[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seconds", type=float, default=5.0, help="how long the steps run (the other phases: a fifth each)"
    )
    ap.add_argument("--step-ms", type=float, default=10.0, help="one step's length to calibrate to")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result: dict = {"device": str(mx.default_device()), "gpu_state": bench.gpu_state()}
    steal0 = steal_seconds()
    result["idle_gpu"] = idle_gpu(max(1.0, args.seconds / 5))
    result["sleeps"] = sleeps(max(0.2, args.seconds / 5))
    step = Step(args.dim, args.layers, args.rows)
    result["calibrated_step_ms"] = round(step.calibrate(args.step_ms), 2)
    result["steps"] = steps(step, args.seconds)
    steal1 = steal_seconds()
    result["steal_s"] = None if steal0 is None or steal1 is None else round(steal1 - steal0, 2)
    print(
        f"host: idle GPU {result['idle_gpu']}; sleeps late {result['sleeps']}; steps {result['steps']}; "
        f"steal {result['steal_s']} s",
        flush=True,
    )
    bench.save(result, args.out)


if __name__ == "__main__":
    main()
