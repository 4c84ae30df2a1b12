"""Stopping ``gen.save(path)`` and ``mlx_notebook.resume_from(path)`` of a >= 1 GB KV cache, end to end (issue 23).

What a user gets, not kv_file alone (that is benchmarks/kv_file_stops.py):

- a random-weight mlx-lm llama folder whose KV is 64 KB per token (8 layers x
  8 KV heads x 128 dims, float32), and a synthetic save file of ``--tokens``
  tokens of random KV written with ``persist.write`` (no 16k-token prefill on
  this CPU): a real ``gen.save`` file that ``resume_from`` continues;
- load stops: ``--rounds`` resumes, each cancelled (``gen.cancel()``) at a
  random moment inside the expected read of the cache (after the generation
  reports ``prefilling``); latency is ``cancel()`` -> ``wait()`` returns, and
  the handle's own ``stats.stop_latency_s``; each stop is placed before,
  during or after ``kv_file.load`` (timestamps from a wrapper of it);
- save stops: a resumed generation paused with its cache (>= 1 GB), saved
  whole once to ``other.safetensors``, then ``--rounds`` saves to the same path
  interrupted the user's way, a SIGINT to the process while the main thread
  waits in ``gen.save`` (``Worker.run_inline`` cancels the save on the
  ``KeyboardInterrupt``); latency is ``os.kill`` -> ``gen.save`` raises. After
  each round: the old file is intact (size, header, sampled blocks; whole-file
  SHA-256 at the start and the end) and no temporary file is left. At the end
  the paused generation resumes and its tokens equal those of a second resume
  from the file;
- mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` on the same cache, in
  GB/s, against ours (``persist.write``, ``kv_file.load``, a whole ``gen.save``
  and a whole resume to its first token);
- the longest GIL hold during a whole save and a whole resume.

    python -m benchmarks.persist_stops [--rounds 20] [--tokens 16384] [--json out.json]
"""

from __future__ import annotations

import mlx_notebook  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import hashlib
import json
import os
import platform
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from benchmarks.kv_file_stops import GilProbe
from mlx_notebook.control import Cancelled, Pace, unpaced
from mlx_notebook.generation import kv_file, persist
from mlx_notebook.generation.kv_settings import KVSettings
from mlx_notebook.generation.request import GenerationRequest
from testkit.tiny_model import make_tiny_model

# Timestamps of kv_file.load / kv_file.save calls (the product imports them at call time).
CALLS: dict[str, list[dict[str, float]]] = {"load": [], "save": []}
_orig_load, _orig_save = kv_file.load, kv_file.save


def _timed(kind: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = {"start": time.perf_counter()}
        CALLS[kind].append(rec)
        try:
            return fn(*args, **kwargs)
        finally:
            rec["end"] = time.perf_counter()

    return wrapper


kv_file.load = _timed("load", _orig_load)
kv_file.save = _timed("save", _orig_save)

# Where a stop's time goes: spans of kv_file's unsplittable steps, and when a checkpoint raised Cancelled.
SPANS: list[tuple[str, float, float]] = []
RAISES: list[float] = []


def _span(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS.append((name, t0, time.perf_counter()))

    return wrapper


for _name in ("_read_tensor", "_readinto", "_write_all", "_remove_soon"):
    setattr(kv_file, _name, _span(_name, getattr(kv_file, _name)))


class _MxSpans:
    """kv_file's ``mx`` with ``eval`` timed (in a read: a tensor's allocation, then its final view)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    eval = staticmethod(_span("mx.eval", mx.eval))


kv_file.mx = _MxSpans()  # type: ignore[assignment]
kv_file._WriteBehind.wrote = _span("sync_file_range", kv_file._WriteBehind.wrote)
kv_file._WriteBehind.finish = _span("sync_file_range", kv_file._WriteBehind.finish)
_orig_checkpoint = Pace.checkpoint


def _checkpoint(self: Pace) -> None:
    try:
        _orig_checkpoint(self)
    except Cancelled:
        RAISES.append(time.perf_counter())
        raise


Pace.checkpoint = _checkpoint  # type: ignore[method-assign]


def breakdown(t0: float, returned: float, rec: dict[str, float] | None) -> dict[str, Any]:
    """Stop request at ``t0``, caller back at ``returned``: the steps in between."""
    raised = next((t for t in RAISES if t >= t0), None)
    running = sorted((s for s in SPANS if s[1] <= t0 <= s[2]), key=lambda s: s[2] - s[1])  # innermost first
    out: dict[str, Any] = {
        "running_at_stop": [f"{n} {e - b:.4f}s" for n, b, e in running],
        "stop_to_checkpoint_raise_s": None if raised is None else round(raised - t0, 4),
    }
    if raised is not None and rec is not None and "end" in rec:
        out["raise_to_kv_file_exit_s"] = round(rec["end"] - raised, 4)
        out["kv_file_exit_to_caller_s"] = round(returned - rec["end"], 4)
        out["remove_soon_s"] = round(sum(e - b for n, b, e in SPANS if n == "_remove_soon" and b >= raised), 4)
    return out


def synthetic_cache(layers: int, heads: int, tokens: int, dim: int) -> list[KVCache]:
    cache = []
    for i in range(layers):
        k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(2 * i))
        v = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(2 * i + 1))
        c = KVCache()
        c.state = (k, v, tokens)
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


def pct(values: list[float]) -> dict[str, Any]:
    a = np.array([v for v in values if v is not None] or [np.nan])
    return {
        "n": int(np.isfinite(a).sum()),
        "p50_s": round(float(np.percentile(a, 50)), 4),
        "p95_s": round(float(np.percentile(a, 95)), 4),
        "max_s": round(float(a.max()), 4),
    }


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.0005)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def sampled(path: Path, rng_seed: int = 1, blocks: int = 64, size: int = 64 << 10) -> str:
    """SHA-256 of the first and last MB and ``blocks`` fixed random blocks (a cheap per-round check)."""
    n = path.stat().st_size
    rng = random.Random(rng_seed)
    spots = [0, max(0, n - (1 << 20))] + sorted(rng.randrange(0, max(1, n - size)) for _ in range(blocks))
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for i, at in enumerate(spots):
            f.seek(at)
            h.update(f.read(1 << 20 if i < 2 else size))
    return h.hexdigest()


def join_cleanups(timeout: float) -> float:
    """Wait for kv_file's cleanup threads (deleting a stopped save's temporary file); return the time waited."""
    t0 = time.perf_counter()
    for t in threading.enumerate():
        if t.name.startswith("kv-file-cleanup"):
            t.join(max(0.0, timeout - (time.perf_counter() - t0)))
    return time.perf_counter() - t0


def where(t: float, rec: dict[str, float] | None) -> str:
    if rec is None or t < rec["start"]:
        return "before"
    if t <= rec.get("end", float("inf")):
        return "during"
    return "after"


def resume_timeline(path: Path, worker: mlx_notebook.Worker, max_tokens: int) -> dict[str, Any]:
    """One whole resume: resume_from -> prefilling -> read -> first token; then a stop."""
    n_before = len(CALLS["load"])
    t0 = time.perf_counter()
    gen = mlx_notebook.resume_from(str(path), worker=worker, max_tokens=max_tokens)
    wait_for(lambda: gen.state != "queued" and gen.state != "loading", 600, "prefilling")
    t_prefilling = time.perf_counter()
    wait_for(lambda: len(gen.tokens) >= 1 or gen.finished, 600, "first token")
    t_first = time.perf_counter()
    gen.cancel()
    gen.wait(600)
    rec = CALLS["load"][n_before]
    return {
        "to_prefilling_s": round(t_prefilling - t0, 4),
        "read_s": round(rec["end"] - rec["start"], 4),
        "read_start_after_prefilling_s": round(rec["start"] - t_prefilling, 4),
        "read_end_to_first_token_s": round(t_first - rec["end"], 4),
        "to_first_token_s": round(t_first - t0, 4),
        "state": str(gen.state),
    }


def load_stops(
    path: Path, worker: mlx_notebook.Worker, rounds: int, read_s: float, max_tokens: int, rng: random.Random
) -> list[dict[str, Any]]:
    out = []
    for _ in range(rounds):
        n_before = len(CALLS["load"])
        gen = mlx_notebook.resume_from(str(path), worker=worker, max_tokens=max_tokens)
        wait_for(lambda: gen.state not in ("queued", "loading"), 600, "prefilling")
        delay = rng.uniform(0.0, 0.9 * read_s)
        time.sleep(delay)
        t0 = time.perf_counter()
        gen.cancel()
        gen.wait(600)
        t1 = time.perf_counter()
        rec = CALLS["load"][n_before] if len(CALLS["load"]) > n_before else None
        out.append(
            {
                **breakdown(t0, t1, rec),
                "delay_s": round(delay, 4),
                "latency_s": round(t1 - t0, 4),
                "stop_latency_s": None if gen.stats.stop_latency_s is None else round(gen.stats.stop_latency_s, 4),
                "landed": where(t0, rec),
                "state": str(gen.state),
                "tokens": len(gen.tokens),
                "read_started_after_cancel": rec is not None and rec["start"] > t0,
            }
        )
    return out


class Interrupt:
    """SIGINT handler raising KeyboardInterrupt only while armed (a late signal is recorded, not raised)."""

    def __init__(self) -> None:
        self.armed = False
        self.handled_at: float | None = None
        self.old = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.handled_at = time.perf_counter()
        if self.armed:
            raise KeyboardInterrupt

    def close(self) -> None:
        signal.signal(signal.SIGINT, self.old)


def save_stops(
    gen: mlx_notebook.Generation, other: Path, rounds: int, save_s: float, rng: random.Random, reference: str
) -> list[dict[str, Any]]:
    out = []
    folder = other.parent
    known = {p.name for p in folder.iterdir()}
    intr = Interrupt()
    try:
        for _ in range(rounds):
            before = other.stat()
            n_before = len(CALLS["save"])
            delay = rng.uniform(0.0, 0.9 * save_s)
            sent: list[float] = []

            def fire() -> None:
                sent.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGINT)

            intr.handled_at = None
            timer = threading.Timer(delay, fire)
            outcome = "saved"
            intr.armed = True
            timer.start()
            try:
                gen.save(str(other))
            except KeyboardInterrupt:
                outcome = "interrupted"
            finally:
                intr.armed = False
            returned = time.perf_counter()
            timer.cancel()
            timer.join(10)
            time.sleep(0.005)  # a signal sent after the save returned is handled here
            rec = CALLS["save"][n_before] if len(CALLS["save"]) > n_before else None
            left_now = sorted(p.name for p in folder.iterdir() if p.name not in known)
            join_cleanups(5.0)
            left_later = sorted(p.name for p in folder.iterdir() if p.name not in known)
            after = other.stat()
            t_sent = sent[0] if sent else None
            out.append(
                {
                    "delay_s": round(delay, 4),
                    "outcome": outcome,
                    "latency_s": round(returned - t_sent, 4) if t_sent is not None and t_sent <= returned else None,
                    "signal_to_handler_s": (
                        round(intr.handled_at - t_sent, 4) if t_sent is not None and intr.handled_at else None
                    ),
                    "landed": where(t_sent, rec) if t_sent is not None else "never sent",
                    **(breakdown(t_sent, returned, rec) if t_sent is not None else {}),
                    "file_replaced": after.st_ino != before.st_ino,
                    "old_file_intact": after.st_size == before.st_size and sampled(other) == reference,
                    "left_at_return": left_now,
                    "left_after_cleanup": left_later,
                }
            )
    finally:
        intr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384, help="cached tokens (64 KB each: 16384 -> 1.07 GB)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=8, help="max_tokens of the saved request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, help="folder for the model and files (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    head_dim = args.hidden // args.kv_heads
    n = args.tokens
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_s:
        tmp = Path(tmp_s)
        folder = str(
            make_tiny_model(
                tmp / "model",
                hidden=args.hidden,
                heads=args.kv_heads,
                kv_heads=args.kv_heads,
                layers=args.layers,
                intermediate=256,
                dtype="float32",
            )
        )
        worker = mlx_notebook.Worker()
        key = worker.store.resolve(folder).key
        fingerprint = worker.call(lambda store: persist.fingerprint(store.get(folder)))
        vocab = worker.call(lambda store: store.get(folder).tokenizer.vocab_size)
        # -- the synthetic save file ---------------------------------------------------------
        cache = synthetic_cache(args.layers, args.kv_heads, n, head_dim)
        nbytes = kv_file.cache_nbytes(cache)
        gb = nbytes / 1e9
        prng = random.Random(args.seed + 1)
        prompt = [prng.randrange(vocab) for _ in range(n + 1)]
        request = GenerationRequest("synthetic", model=folder, max_tokens=args.new_tokens)
        data = persist.generation_json(
            request, prompt, [], kv_tokens=n, key=None, model=key, fingerprint=fingerprint, kv=KVSettings().as_dict()
        )
        path = tmp / "gen.safetensors"
        write_times = []
        for _ in range(2):
            t0 = time.perf_counter()
            persist.write(path, cache, data, unpaced(0.1))
            write_times.append(time.perf_counter() - t0)
            join_cleanups(10.0)
        write_s = min(write_times)
        t0 = time.perf_counter()
        loaded, _ = kv_file.load(path, unpaced(0.1))
        our_load_s = time.perf_counter() - t0
        del loaded
        # -- mlx-lm on the same cache ------------------------------------------------------
        theirs = tmp / "mlx_lm.safetensors"
        t0 = time.perf_counter()
        save_prompt_cache(str(theirs), cache, {persist.META_KEY: json.dumps(data)})
        mlx_lm_save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = load_prompt_cache(str(theirs))
        mx.eval([c.state for c in got])
        mlx_lm_load_s = time.perf_counter() - t0
        del got
        theirs.unlink()
        # The unsplittable steps of a read: one tensor's allocation (zeros + eval), and freeing all of them.
        per = cache[0].keys.nbytes // 4
        allocs, bufs = [], []
        for _ in range(2 * args.layers):
            t0 = time.perf_counter()
            b = mx.zeros((per,), mx.uint32)
            mx.eval(b)
            allocs.append(time.perf_counter() - t0)
            bufs.append(b)
        t0 = time.perf_counter()
        bufs.clear()
        free_all_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.clear_cache()
        clear_cache_s = time.perf_counter() - t0
        del cache
        mx.clear_cache()
        # -- one whole resume (warm-up, then timed), then the load stops -------------------------
        resume_timeline(path, worker, args.new_tokens)
        first_span = len(SPANS)
        with GilProbe() as gil_resume:
            whole = resume_timeline(path, worker, args.new_tokens)
        steps: dict[str, list[float]] = {}
        for name, b, e in SPANS[first_span:]:
            steps.setdefault(name, []).append(e - b)
        whole["read_steps"] = {k: {"count": len(v), **pct(v)} for k, v in steps.items()}
        loads = load_stops(path, worker, args.rounds, whole["read_s"], args.new_tokens, rng)
        # -- a paused generation with its cache; whole saves, then the save stops ------------------------
        gen = mlx_notebook.resume_from(str(path), worker=worker)
        wait_for(lambda: len(gen.tokens) >= 1 or gen.finished, 600, "first token")
        gen.pause()
        wait_for(lambda: gen.state == "paused" or gen.finished, 600, "paused")
        assert gen.state == "paused", (gen.state, gen.error)
        other = tmp / "other.safetensors"
        save_times = []
        for i in range(3):
            if i == 2:
                with GilProbe() as gil_save:
                    t0 = time.perf_counter()
                    file_bytes = gen.save(str(other))
            else:
                t0 = time.perf_counter()
                file_bytes = gen.save(str(other))
            save_times.append(time.perf_counter() - t0)
        join_cleanups(10.0)
        rec = CALLS["save"][-1]
        save_inner_s = rec["end"] - rec["start"]
        full_hash = sha256(other)
        reference = sampled(other)
        saves = save_stops(gen, other, args.rounds, min(save_times), rng, reference)
        join_cleanups(10.0)
        intact_at_end = sha256(other) == full_hash
        # -- the paused generation still resumes exactly ---------------------------------------------
        paused_tokens = gen.tokens
        gen.resume()
        gen.result(timeout=600)
        again = mlx_notebook.resume_from(str(other), worker=worker)
        again.result(timeout=600)
        exact = {
            "paused_at_tokens": len(paused_tokens),
            "continued_state": str(gen.state),
            "second_resume_state": str(again.state),
            "tokens_continued": gen.tokens,
            "tokens_second_resume": again.tokens,
            "equal": gen.tokens == again.tokens and gen.tokens[: len(paused_tokens)] == paused_tokens,
        }
        assert worker.shutdown(timeout=60)
    load_lat = [r["latency_s"] for r in loads]
    save_lat = [r["latency_s"] for r in saves if r["latency_s"] is not None]
    save_during = [r["latency_s"] for r in saves if r["landed"] == "during" and r["latency_s"] is not None]
    load_during = [r["latency_s"] for r in loads if r["landed"] == "during"]
    whole_save_s = min(save_times)
    result = {
        "cache_gb": round(gb, 3),
        "cached_tokens": n,
        "kv_bytes_per_token": nbytes // n,
        "model": f"random llama, {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads x {head_dim}, float32",
        "file_bytes": file_bytes,
        "budget_s": 0.1,
        "rounds": args.rounds,
        "throughput": {
            "persist_write_gbps": round(gb / write_s, 2),
            "kv_file_load_gbps": round(gb / our_load_s, 2),
            "mlx_lm_save_prompt_cache_gbps": round(gb / mlx_lm_save_s, 2),
            "mlx_lm_load_prompt_cache_gbps": round(gb / mlx_lm_load_s, 2),
            "gen_save_whole_s": round(whole_save_s, 3),
            "gen_save_whole_gbps": round(gb / whole_save_s, 2),
            "gen_save_kv_file_part_s": round(save_inner_s, 3),
            "resume_whole_to_first_token_s": whole["to_first_token_s"],
            "resume_read_s": whole["read_s"],
            "save_ratio_mlx_lm_over_gen_save": round(mlx_lm_save_s / whole_save_s, 2),
            "load_ratio_mlx_lm_over_resume_read": round(mlx_lm_load_s / whole["read_s"], 2),
            "load_ratio_mlx_lm_over_resume_to_first_token": round(mlx_lm_load_s / whole["to_first_token_s"], 2),
        },
        "resume_timeline": whole,
        "one_tensor_alloc_s": {"bytes": per * 4, **pct(allocs)},
        "free_all_tensors_s": round(free_all_s, 4),
        "mx_clear_cache_after_s": round(clear_cache_s, 4),
        "longest_gil_hold_whole_resume_s": round(gil_resume.max_gap, 4),
        "longest_gil_hold_whole_save_s": round(gil_save.max_gap, 4),
        "load_stops": {
            "cancel_to_wait_returns": pct(load_lat),
            "stats_stop_latency": pct([r["stop_latency_s"] for r in loads]),
            "during_read_only": pct(load_during),
            "landed": {k: sum(r["landed"] == k for r in loads) for k in ("before", "during", "after")},
            "states": sorted({r["state"] for r in loads}),
            "slow_rounds": [r for r in loads if r["latency_s"] > 0.15],
        },
        "save_stops": {
            "sigint_to_save_returns": pct(save_lat),
            "during_write_only": pct(save_during),
            "signal_to_handler": pct([r["signal_to_handler_s"] for r in saves]),
            "landed": {k: sum(r["landed"] == k for r in saves) for k in ("before", "during", "after")},
            "interrupted": sum(r["outcome"] == "interrupted" for r in saves),
            "completed_anyway": sum(r["outcome"] == "saved" for r in saves),
            "old_file_intact_every_round": all(r["old_file_intact"] for r in saves),
            "old_file_sha256_same_at_end": intact_at_end,
            "slow_rounds": [
                {k: v for k, v in r.items() if not k.startswith("left_")}
                for r in saves
                if r["latency_s"] is not None and r["latency_s"] > 0.15
            ],
            "files_left_at_return": sorted({f for r in saves for f in r["left_at_return"]}),
            "files_left_after_cleanup": sorted({f for r in saves for f in r["left_after_cleanup"]}),
        },
        "exact_resume_after_save_stops": {k: v for k, v in exact.items() if not k.startswith("tokens_")},
        "acceptance_p95_le_0.15": {
            "load": pct(load_lat)["p95_s"] <= 0.15,
            "save": pct(save_lat)["p95_s"] <= 0.15,
        },
        "mlx": mx.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "wall_s": round(time.perf_counter() - started, 1),
        "command": "python -m benchmarks.persist_stops --json benchmarks/results/cpu_persist_stops.json",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        full = {"summary": result, "loads": loads, "saves": saves, "exact": exact}
        args.json.write_text(json.dumps(full, indent=1) + "\n")


if __name__ == "__main__":
    main()
