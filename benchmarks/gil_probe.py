"""GIL-hold probe: how long can a stop wait for the GIL while a tokenizer loads?

A sampling thread sleeps 1 ms at a time and records every gap between two
wake-ups: a gap of G ms means some thread held the GIL for about G - 1 ms.
Gaps are attributed to the phase that was running (load, free, stop...).

For a real-size tokenizer folder (``testkit.real_tokenizer``; Qwen3 151,936
tokens by default) it reports:

- plain ``mlx_lm.utils.load_tokenizer`` on a helper thread (what
  ``store._load`` does today) vs. ``mlx_notebook.loading.tokenizer.load_tokenizer``:
  total time, longest GIL hold while loading and while freeing the result;
- stop latency when ``wait()`` raises ``Cancelled`` at a random moment of the
  load (20 rounds): from the planned stop moment to the exception reaching the
  caller (p50/p99/max), and the longest GIL hold in the second after the stop;
- with ``--attribute``: which native calls and garbage collections of the
  plain load hold the GIL longest (``sys.setprofile`` c_call/c_return on the
  loading thread, ``gc.callbacks``, and the loading thread's stack around each
  long gap).

Usage (repo root)::

    python3 -m benchmarks.gil_probe [--arch qwen3|llama] [--rounds 20]
        [--attribute] [--out results.json]
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

try:  # binds MLX's CPU BLAS before mlx is imported (not needed for tokenizers)
    import mlx_notebook  # noqa: F401
except ImportError as exc:  # pragma: no cover - during refactors
    print(f"note: import mlx_notebook failed ({exc}); continuing", file=sys.stderr)

from mlx_notebook.control import Cancelled
from mlx_notebook.loading.tokenizer import load_tokenizer
from testkit.real_tokenizer import PRESETS, make_real_tokenizer

SLEEP_S = 0.001

# The same 1 ms sampling loop in a separate process: a gap seen there too is
# the machine stalling (a VM's vCPU descheduled, a page-fault storm while
# another process maps memory), not a GIL hold in this one.
_CONTROL = r"""
import array, sys, threading, time
stop = []
threading.Thread(target=lambda: (sys.stdin.read(), stop.append(1)), daemon=True).start()
out = array.array("d")
pc = time.perf_counter
last = pc()
while not stop:
    time.sleep(0.001)
    now = pc()
    if now - last > 0.003:
        out.extend((last, now))
    last = now
sys.stdout.write(" ".join(map(repr, out)))
"""


class ControlSampler:
    """Runs :data:`_CONTROL` in a child process; ``stalls`` are its gaps (start, end)."""

    def __enter__(self) -> ControlSampler:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CONTROL], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.stalls: list[tuple[float, float]] = []
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate("", timeout=30)
        v = [float(x) for x in out.split()]
        self.stalls = list(zip(v[0::2], v[1::2]))


def explained(a: float, b: float, stalls: list[tuple[float, float]]) -> bool:
    """Whether a machine stall covers at least half of the gap [a, b]."""
    need = 0.5 * (b - a - SLEEP_S)
    return any(min(b, y) - max(a, x) >= need for x, y in stalls if y > a and x < b)


class Sampler:
    """Records wake-up gaps of a thread that sleeps 1 ms at a time, by phase."""

    def __init__(self, watch: Callable[[], int | None] | None = None) -> None:
        # Plain float arrays: a list of tuples here would grow by 1,000 tracked
        # objects a second and make the probe's own full collections long.
        self.starts = array.array("d")
        self.ends = array.array("d")
        self.stacks: dict[int, tuple[list | None, list | None]] = {}
        self.phases: list[tuple[str, float, float]] = []
        self._watch = watch  # returns the ident of a thread whose stack to record
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gil-sampler", daemon=True)
        self.stalls: list[tuple[float, float]] = []  # set from a ControlSampler afterwards

    def _stack(self) -> list | None:
        ident = self._watch() if self._watch else None
        if ident is None:
            return None
        frame = sys._current_frames().get(ident)
        out = []
        while frame is not None and len(out) < 4:
            name = frame.f_code.co_filename.split("site-packages/")[-1]
            out.append(f"{name}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return out

    def _run(self) -> None:
        pc = time.perf_counter
        last = pc()
        before = None
        while not self._stop:
            time.sleep(SLEEP_S)
            now = pc()
            if self._watch:
                after = self._stack()
                if now - last > 0.005:
                    self.stacks[len(self.starts)] = (before, after)
                before = after
            self.starts.append(last)
            self.ends.append(now)
            last = now

    def __enter__(self) -> Sampler:
        self._thread.start()
        time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()

    def phase(self, name: str):
        sampler = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.perf_counter()
                return self

            def __exit__(self, *exc):
                sampler.phases.append((name, self.t0, time.perf_counter()))

        return _Phase()

    def gaps(self, t0: float, t1: float):
        """``(start, end, stack_before, stack_after)`` of the gaps overlapping [t0, t1]."""
        for i, (a, b) in enumerate(zip(self.starts, self.ends)):
            if b > t0 and a < t1:
                yield (a, b) + self.stacks.get(i, (None, None))

    def longest(self, t0: float, t1: float, raw: bool = False) -> float:
        """Longest GIL hold (ms) among gaps that overlap [t0, t1].

        Unless ``raw``, gaps a machine stall explains (see :class:`ControlSampler`)
        are left out.
        """
        holds = [b - a - SLEEP_S for a, b, _, _ in self.gaps(t0, t1) if raw or not explained(a, b, self.stalls)]
        return max(holds, default=0.0) * 1e3

    def by_phase(self, raw: bool = False) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, t0, t1 in self.phases:
            out[name] = max(out.get(name, 0.0), self.longest(t0, t1, raw))
        return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# -- one plain and one new load, with their frees ----------------------------------------


def plain_load(folder: Path):
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    return mlx_load_tokenizer(folder, eos_token_ids=None)


def run_once(folder: Path, which: str, sampler: Sampler) -> dict:
    box: dict = {}
    intervals: list[float] = []

    def wait() -> None:
        now = time.perf_counter()
        if "last" in box:
            intervals.append(now - box["last"])
        box["last"] = now

    def target() -> None:
        t = time.perf_counter()
        if which == "plain":
            box["tok"] = plain_load(folder)
        else:
            box["tok"] = load_tokenizer(folder, None, wait=wait)
        box["load_s"] = time.perf_counter() - t

    with sampler.phase(f"{which}: load"):
        th = threading.Thread(target=target, name="loader")
        th.start()
        th.join()
    time.sleep(0.05)
    with sampler.phase(f"{which}: free"):
        del box["tok"]
        time.sleep(0.3)  # a finalizer's work, if any, lands here
    return {
        "load_s": box["load_s"],
        "max_wait_interval_ms": max(intervals, default=0.0) * 1e3,
    }


# -- stop latency ----------------------------------------------------------------------


def stop_rounds(folder: Path, which: str, rounds: int, span_s: float, sampler: Sampler, seed: int = 0) -> dict:
    """``rounds`` loads stopped at a random moment in ``[0, span_s]``.

    ``plain`` emulates today's ``store._load``: mlx-lm's loader on a helper
    thread, the worker checking every 10 ms, the helper abandoned on a stop.
    ``new`` passes the check as ``wait``.
    """
    rng = random.Random(seed)
    lat, after_stop = [], []
    for _ in range(rounds):
        flag = threading.Event()
        box: dict = {}

        def wait() -> None:
            if flag.is_set():
                raise Cancelled()

        helper = None
        if which == "plain":
            helper = threading.Thread(
                target=lambda: box.setdefault("tok", plain_load(folder)), name="plain-helper", daemon=True
            )

        def worker() -> None:
            try:
                if which == "plain":
                    helper.start()
                    while helper.is_alive():
                        wait()
                        helper.join(0.01)
                    wait()
                else:
                    box["tok"] = load_tokenizer(folder, None, wait=wait)
            except Cancelled:
                box["caught"] = time.perf_counter()

        th = threading.Thread(target=worker, name="worker")
        start = time.perf_counter()
        th.start()
        planned = start + rng.uniform(0.0, span_s)
        time.sleep(max(0.0, planned - time.perf_counter()))
        flag.set()
        th.join()
        seen = time.perf_counter()
        if "caught" in box:
            lat.append((box["caught"] - planned, seen - planned))
            t0 = time.perf_counter()
            time.sleep(1.0)
            after_stop.append((t0, time.perf_counter()))
        box.pop("tok", None)
        if helper is not None:
            helper.join()  # let an abandoned plain load end before the next round
            box.pop("tok", None)
        time.sleep(0.3)
    caught = [a * 1e3 for a, _ in lat]
    seen = [b * 1e3 for _, b in lat]
    return {
        "rounds": rounds,
        "stopped": len(lat),
        "caught_ms": {"p50": statistics.median(caught), "p99": pct(caught, 0.99), "max": max(caught)}
        if caught
        else None,
        "main_sees_ms": {"p50": statistics.median(seen), "p99": pct(seen, 0.99), "max": max(seen)} if seen else None,
        "after_stop_windows": after_stop,
    }


# -- attribution of the plain load -----------------------------------------------------


def attribute(folder: Path, top: int = 12) -> dict:
    """Native calls, garbage collections and long gaps of one plain load."""
    native: list[tuple] = []
    stack: list[tuple] = []

    def prof(frame, event, arg) -> None:
        if event == "c_call":
            stack.append((time.perf_counter(), arg, frame))
        elif event in ("c_return", "c_exception") and stack:
            t, fn, fr = stack.pop()
            d = time.perf_counter() - t
            if d > 0.004:
                where = f"{fr.f_code.co_filename.split('site-packages/')[-1]}:{fr.f_lineno}"
                native.append((d * 1e3, getattr(fn, "__qualname__", repr(fn)), where))

    gcs: list[list] = []

    def on_gc(phase, info) -> None:
        if phase == "start":
            gcs.append([time.perf_counter(), None, info["generation"]])
        elif gcs:
            gcs[-1][1] = time.perf_counter()

    loader = {"ident": None}
    box: dict = {}

    def target() -> None:
        loader["ident"] = threading.get_ident()
        sys.setprofile(prof)
        try:
            box["tok"] = plain_load(folder)
        finally:
            sys.setprofile(None)

    gc.callbacks.append(on_gc)
    try:
        with Sampler(watch=lambda: loader["ident"]) as s:
            t0 = time.perf_counter()
            th = threading.Thread(target=target, name="loader")
            th.start()
            th.join()
            t1 = time.perf_counter()
            time.sleep(0.05)
            t2 = time.perf_counter()
            del box["tok"]
            t3 = time.perf_counter()
            time.sleep(0.1)
    finally:
        gc.callbacks.remove(on_gc)
    gaps = sorted(((b - a - SLEEP_S) * 1e3, a - t0, bef, aft) for a, b, bef, aft in s.gaps(t0, t1))[::-1][:top]
    return {
        "load_s": t1 - t0,
        "free_ms": (t3 - t2) * 1e3,
        "longest_free_hold_ms": s.longest(t2, t3 + 0.05),
        "native_calls": [{"ms": round(d, 1), "call": q, "from": w} for d, q, w in sorted(native, reverse=True)[:top]],
        "gc": [
            {"ms": round((b - a) * 1e3, 1), "gen": g, "at_ms": round((a - t0) * 1e3)}
            for a, b, g in gcs
            if b and a >= t0 - 0.001 and b - a > 0.002
        ],
        "gaps": [
            {
                "hold_ms": round(h, 1),
                "at_ms": round(at * 1e3),
                "before": bef[:2] if bef else None,
                "after": aft[:2] if aft else None,
            }
            for h, at, bef, aft in gaps
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(PRESETS), default="qwen3")
    ap.add_argument("--folder", type=Path, help="tokenizer folder (default: a generated one)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--attribute", action="store_true", help="attribute the plain load's holds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    preset = PRESETS[args.arch]
    folder = args.folder or make_real_tokenizer(
        Path(tempfile.gettempdir()) / "mlx-notebook-real-tokenizer" / args.arch,
        vocab=preset["vocab"],
        n_special=preset["n_special"],
        style=preset["style"],
    )
    import mlx_lm.utils  # noqa: F401 - imports are not part of the measurement
    import transformers  # noqa: F401

    result: dict = {
        "folder": str(folder),
        "arch": args.arch,
        "tokens": preset["vocab"],
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
    }
    plain_load(folder)  # warm the page cache and lazy imports
    if args.attribute:
        result["attribution"] = attribute(folder)
    with ControlSampler() as control, Sampler() as s:
        result["plain"] = run_once(folder, "plain", s)
        result["new"] = run_once(folder, "new", s)
        for which in ("plain", "new"):
            span = 0.9 * result[which]["load_s"]
            result[which]["stop"] = stop_rounds(folder, which, args.rounds, span, s)
    s.stalls = control.stalls
    result["machine_stalls_over_20ms"] = sum(1 for x, y in control.stalls if y - x > 0.021)
    result["longest_machine_stall_ms"] = max((y - x for x, y in control.stalls), default=0) * 1e3
    for raw in (True, False):
        holds = s.by_phase(raw)
        sfx = "_raw" if raw else ""
        for which in ("plain", "new"):
            r = result[which]
            r["longest_hold_load_ms" + sfx] = holds[f"{which}: load"]
            r["longest_hold_free_ms" + sfx] = holds[f"{which}: free"]
            r["stop"]["longest_hold_1s_after_stop_ms" + sfx] = max(
                (s.longest(a, b, raw) for a, b in r["stop"]["after_stop_windows"]), default=0.0
            )

    _print(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


def _print(r: dict) -> None:
    print(
        f"tokenizer: {r['arch']} ({r['tokens']:,} tokens) at {r['folder']}; "
        f"switch interval {r['switch_interval_ms']:.0f} ms"
    )
    if "attribution" in r:
        a = r["attribution"]
        print(
            f"\nplain mlx_lm.utils.load_tokenizer, profiled: {a['load_s']:.2f} s; "
            f"del of the result {a['free_ms']:.1f} ms (hold {a['longest_free_hold_ms']:.1f} ms)"
        )
        print("  native calls > 4 ms (ms, call, caller):")
        for c in a["native_calls"]:
            print(f"    {c['ms']:7.1f}  {c['call']}  <- {c['from']}")
        print("  garbage collections > 2 ms (ms, generation, at ms):")
        for g in a["gc"]:
            print(f"    {g['ms']:7.1f}  gen {g['gen']}  at {g['at_ms']}")
        print("  longest gaps (hold ms, at ms, loader stack before -> after):")
        for g in a["gaps"]:
            print(f"    {g['hold_ms']:7.1f}  at {g['at_ms']:5d}  {g['before']} -> {g['after']}")
    print(
        f"\ncontrol process: {r['machine_stalls_over_20ms']} machine stalls > 20 ms, longest "
        f"{r['longest_machine_stall_ms']:.1f} ms; holds below leave out gaps a stall explains "
        f"(raw: every gap)"
    )
    print(f"{'':30s}{'plain mlx-lm':>14s}{'new loader':>14s}")
    rows = [
        ("load time (s)", lambda x: f"{x['load_s']:.2f}"),
        ("longest GIL hold, load (ms)", lambda x: f"{x['longest_hold_load_ms']:.1f}"),
        ("  raw (ms)", lambda x: f"{x['longest_hold_load_ms_raw']:.1f}"),
        ("longest GIL hold, free (ms)", lambda x: f"{x['longest_hold_free_ms']:.1f}"),
        ("  raw (ms)", lambda x: f"{x['longest_hold_free_ms_raw']:.1f}"),
        (
            "max wait() interval (ms)",
            lambda x: f"{x['max_wait_interval_ms']:.1f}" if x["max_wait_interval_ms"] else "-",
        ),
        ("stops caught / rounds", lambda x: f"{x['stop']['stopped']}/{x['stop']['rounds']}"),
        ("stop p50 (ms)", lambda x: f"{x['stop']['caught_ms']['p50']:.1f}"),
        ("stop p99 (ms)", lambda x: f"{x['stop']['caught_ms']['p99']:.1f}"),
        ("stop max (ms)", lambda x: f"{x['stop']['caught_ms']['max']:.1f}"),
        ("main thread sees, max (ms)", lambda x: f"{x['stop']['main_sees_ms']['max']:.1f}"),
        ("hold in 1 s after stop (ms)", lambda x: f"{x['stop']['longest_hold_1s_after_stop_ms']:.1f}"),
        ("  raw (ms)", lambda x: f"{x['stop']['longest_hold_1s_after_stop_ms_raw']:.1f}"),
    ]
    for name, f in rows:
        print(f"{name:30s}{f(r['plain']):>14s}{f(r['new']):>14s}")


if __name__ == "__main__":
    main()
