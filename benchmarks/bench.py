"""Stop latency and throughput of mlx-notebook against plain mlx-lm, in one run.

Usage::

    python -m benchmarks.bench --model default --out benchmarks/results/cpu.json
    python -m benchmarks.bench --synthetic llama3-8b --lengths 512,8192,32768 \
        --out benchmarks/results/h200.json          # on an NVIDIA machine

What it measures, per prompt length:

* throughput: prefill and decode tokens/s of ``mlx_notebook.generate`` and of
  plain ``mlx_lm.stream_generate`` (2048-token chunks) on the same model and
  prompt, alternated, medians of ``--repeats``; the ratio ours / plain;
* stop latency: ``cancel()`` at a random moment of each phase (load, prefill,
  decode), measured from the call to ``wait()`` returning, i.e. what the
  person pressing Stop waits for; p50 / p95 / p99 / max;
* the decode step time, since a stop in decode waits for one step.

EOS is ignored in both (so every run decodes the same number of tokens).
"""

from __future__ import annotations

import mlx_notebook  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import array
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from mlx_notebook.generation import fused_projections, warm_up

SYNTHETIC = {
    # Random weights in real shapes, with tokenizers of real size (testkit.real_tokenizer):
    # Llama-3-8B (128,256 tokens) and Qwen3-8B (151,936), bf16, ~16 GB each.
    "llama3-8b": dict(
        arch="llama",
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        arch="qwen3",
        hidden=4096,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=12288,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
    # Qwen3-0.6B's shape (tied embeddings), float32 as the CPU runs it: ~3 GB, a model people load on a laptop.
    "qwen3-0.6b": dict(
        arch="qwen3",
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=3072,
        tie_embeddings=True,
        dtype="float32",
    ),
    # Small enough for a CPU run, with the same full-size tokenizers.
    "llama-tiny": dict(arch="llama", hidden=256, layers=8, heads=8, kv_heads=4, intermediate=512, dtype="float32"),
    "qwen3-tiny": dict(arch="qwen3", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, dtype="float32"),
}


class GilSampler:
    """A thread that sleeps 1 ms at a time: a late wake-up means another thread held the GIL.

    A stop needs the GIL (``cancel()``, the worker's checkpoint, ``wait()``
    returning), so the longest hold while a phase runs bounds its stop latency.
    """

    SLEEP_S = 0.001

    def __init__(self) -> None:
        self.starts = array.array("d")
        self.ends = array.array("d")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="gil-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            time.sleep(self.SLEEP_S)
            now = time.perf_counter()
            self.starts.append(last)
            self.ends.append(now)
            last = now

    def longest_ms(self, t0: float, t1: float) -> float:
        """The longest hold (ms) among the gaps that overlap ``[t0, t1]``."""
        holds = [e - s - self.SLEEP_S for s, e in zip(self.starts, self.ends) if e > t0 and s < t1]
        return max(holds, default=0.0) * 1e3

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(values):
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def build_synthetic(name: str, folder: Path) -> str:
    """Write a random-weight model folder of a real shape, with a tokenizer of real size."""
    from testkit.real_tokenizer import make_real_model

    return str(make_real_model(folder, **SYNTHETIC[name]))


def open_model(model: str, synthetic, context: int, folder: Path):
    """A worker with the model loaded (built first when ``synthetic`` names a shape), EOS off.

    Returns ``(worker, name, vocab_size, load_s)``.
    """
    name = model
    if synthetic:
        t0 = time.perf_counter()
        name = build_synthetic(synthetic, folder / synthetic)
        print(f"built {synthetic} in {time.perf_counter() - t0:.1f} s", flush=True)
    # Repeated prompts must be prefilled each time, not taken from the prompt cache.
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    t0 = time.perf_counter()
    worker.load_model(name)
    load_s = time.perf_counter() - t0

    if warm_up.wanted():
        # What the worker's first idle moment would do (its first forward, the 2-8 row kernel's compile),
        # done now: otherwise it lands between two measurements and the first runs without the kernel.
        def warm(store):
            loaded = store.get(name)
            loaded.warmed = loaded.kernels_installed = True
            warm_up.warm(loaded)
            warm_up.install_kernels(loaded)

        worker.call(warm)

    def no_eos(store):
        store.get(name).tokenizer.eos_token_ids = []

    worker.call(no_eos)
    vocab = worker.call(lambda store: store.get(name).config.get("vocab_size", 30000))
    return worker, name, vocab, load_s


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    # Skip the first ids (special tokens in most vocabularies).
    return [rng.randrange(16, min(vocab, 30000)) for _ in range(length)]


def plain_mlx_lm(worker, name, ids, max_tokens, prefill_step_size=2048):
    """Plain ``mlx_lm.stream_generate`` on the worker thread (its stream rules)."""
    from mlx_lm import stream_generate

    def job(store):
        loaded = store.get(name)
        last = None
        # mlx-lm's own model: separate projections where the worker fused them.
        with fused_projections.unfused(loaded.model):
            for last in stream_generate(  # noqa: B007  (the last response is the one kept)
                loaded.model, loaded.tokenizer, ids, max_tokens=max_tokens, prefill_step_size=prefill_step_size
            ):
                pass
        return last.prompt_tps, last.generation_tps, last.generation_tokens

    return worker.call(job)


def ours(worker, name, ids, max_tokens, budget, pieces):
    worker.call(lambda store: setattr(store.get(name), "layer_pieces", pieces == "layers"))
    gen = mlx_notebook.generate(ids, model=name, max_tokens=max_tokens, stop_budget=budget, worker=worker)
    gen.result()
    s = gen.stats
    return s.prompt_tps, s.generation_tps, s.generated_tokens, s.prefill_chunks


def measure_throughput(worker, name, ids, args, pieces):
    rows = {"plain": [], "ours": []}
    chunks = []
    for r in range(args.repeats):
        order = ["plain", "ours"] if r % 2 == 0 else ["ours", "plain"]
        for who in order:
            if who == "plain":
                rows["plain"].append(plain_mlx_lm(worker, name, ids, args.decode_tokens))
            else:
                p, g, n, c = ours(worker, name, ids, args.decode_tokens, args.budget, pieces)
                rows["ours"].append((p, g, n))
                chunks.append(c)
    med = {k: (statistics.median(v[0] for v in rows[k]), statistics.median(v[1] for v in rows[k])) for k in rows}
    return {
        "plain_prefill_tps": med["plain"][0],
        "plain_decode_tps": med["plain"][1],
        "ours_prefill_tps": med["ours"][0],
        "ours_decode_tps": med["ours"][1],
        "prefill_ratio": med["ours"][0] / med["plain"][0],
        "decode_ratio": med["ours"][1] / med["plain"][1],
        "ours_prefill_chunks": statistics.median(chunks),
        "decode_step_ms": 1000.0 / med["ours"][1],
    }


def stop_once(worker, name, ids, args, phase, window_s, rng, pieces, sampler):
    started = time.perf_counter()
    if phase == "load":
        worker.call(lambda store: store.unload(name))
    else:
        worker.call(lambda store: setattr(store.get(name), "layer_pieces", pieces == "layers"))
    gen = mlx_notebook.generate(
        ids, model=name, max_tokens=100000 if phase == "decode" else 2, stop_budget=args.budget, worker=worker
    )
    wanted = {"load": "loading", "prefill": "prefilling", "decode": "decoding"}[phase]
    while gen.state in ("queued",) or (phase != "load" and gen.state == "loading"):
        time.sleep(0.0002)
    if phase == "decode":
        while gen.state != "decoding" and not gen.finished:
            time.sleep(0.0005)
    time.sleep(rng.uniform(0, window_s))
    state = gen.state
    t0 = time.perf_counter()
    gen.cancel()
    gen.wait()
    latency = time.perf_counter() - t0
    gil_ms = sampler.longest_ms(started, time.perf_counter())
    hit = state == wanted
    if phase == "load":
        worker.call(lambda store: store.get(name))  # reload for the next phase
    return latency, hit, gen.stats.stop_latency_s, gil_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model name (default: the SmolLM2 GGUF)")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="build a random-weight model instead")
    ap.add_argument("--lengths", default="100,1000,4000", help="prompt lengths in tokens")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20, help="stop samples per phase and length")
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument("--pieces", default="layers", help="layers, chunks, or both (compare)")
    ap.add_argument("--max-window", type=float, default=20.0, help="cap of the random stop moment, seconds")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--phases", default="load,prefill,decode", help="comma list; empty for throughput only")
    ap.add_argument("--decode-max-length", type=int, default=None, help="skip decode stops above this length")
    ap.add_argument("--long-rounds", type=int, default=None, help="stop samples per phase for prompts >= 16k")
    ap.add_argument("--build-dir", help="where --synthetic models are built (reused when present)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)

    tmp = tempfile.TemporaryDirectory(prefix="mlxnb-bench-")
    folder = Path(args.build_dir) if args.build_dir else Path(tmp.name)
    worker, name, vocab, load_s = open_model(args.model, args.synthetic, max(lengths), folder)
    sampler = GilSampler()
    result = {
        "device": str(mx.default_device()),
        "device_info": {k: str(v) for k, v in mx.device_info().items()} if hasattr(mx, "device_info") else {},
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "blas": mlx_notebook.active_blas(),
        "model": args.synthetic or args.model,
        "budget_s": args.budget,
        "load_s": load_s,
        "command": " ".join(sys.argv),
        "lengths": {},
        "gpu_state": {"start": gpu_state()},
    }
    pieces_list = ["layers", "chunks"] if args.pieces == "both" else [args.pieces]
    for length in lengths:
        ids = prompt_ids(length, vocab, seed=length)
        entry = result["lengths"][str(length)] = {}
        for pieces in pieces_list:
            part = entry[pieces] = {}
            if not args.skip_throughput:
                part["throughput"] = measure_throughput(worker, name, ids, args, pieces)
                print(length, pieces, json.dumps(part["throughput"]), flush=True)
            prefill_s = length / part.get("throughput", {}).get("ours_prefill_tps", 500.0)
            step_s = part.get("throughput", {}).get("decode_step_ms", 50.0) / 1000
            windows = {
                "load": max(load_s * 0.9, 0.01),
                "prefill": min(prefill_s * 0.95, args.max_window),
                "decode": min(step_s * 50, args.max_window),
            }
            part["stop"] = {}
            rounds = args.rounds if length < 16384 or args.long_rounds is None else args.long_rounds
            for phase, window in windows.items():
                if phase not in args.phases.split(","):
                    continue
                if phase == "decode" and args.decode_max_length and length > args.decode_max_length:
                    continue
                if phase == "load" and (length != lengths[0] or pieces != pieces_list[0]):
                    continue
                lat, internal, gil, hits = [], [], [], 0
                for _ in range(rounds):
                    latency, hit, inner, gil_ms = stop_once(
                        worker, name, ids, args, phase, window, rng, pieces, sampler
                    )
                    if hit:
                        hits += 1
                        lat.append(latency)
                        gil.append(gil_ms)
                        if inner is not None:
                            internal.append(inner)
                part["stop"][phase] = {
                    "external": summary(lat),
                    "internal": summary(internal),
                    "hits": hits,
                    # Longest GIL hold (ms) on any thread in each round, from submit to stopped.
                    "gil_hold_ms": summary(gil),
                }
                s = part["stop"][phase]["external"]
                if s["n"]:
                    print(
                        f"{length} {pieces} stop {phase}: n={s['n']} p50={s['p50'] * 1e3:.1f} ms "
                        f"p95={s['p95'] * 1e3:.1f} ms p99={s['p99'] * 1e3:.1f} ms max={s['max'] * 1e3:.1f} ms "
                        f"longest GIL hold {max(gil):.1f} ms",
                        flush=True,
                    )
                save(result, args.out)
    worker.shutdown()
    sampler.close()
    result["gpu_state"]["end"] = gpu_state()
    save(result, args.out)
    if args.out:
        print(f"wrote {args.out}")


GPU_FIELDS = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state() -> dict | None:
    """The NVIDIA GPU's clocks, power and throttle reasons now (``None`` without ``nvidia-smi``).

    Recorded beside figures that moved up to 2x between calls on the same
    H200 host, so a slow run can be told from a slow change.
    """
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={GPU_FIELDS}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(GPU_FIELDS.split(","), (v.strip() for v in out.split(","))))


def save(result: dict, out) -> None:
    """Write what is measured so far (a run cut short keeps its results)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
