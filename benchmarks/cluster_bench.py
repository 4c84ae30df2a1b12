"""A sharded model over ranks: mlx-notebook's cluster against mlx-lm's own sharded generation, in one run.

Usage::

    # CPU, this machine: two local ring ranks, a tiny random-weight llama
    python -m benchmarks.cluster_bench --synthetic testkit-tiny --backend ring \\
        --out benchmarks/results/cpu_cluster_tiny.json
    # one host with 2 NVIDIA GPUs: nccl, a random-weight Llama-3-8B shape (built once, reused)
    python -m benchmarks.cluster_bench --synthetic llama3-8b --build-dir /tmp/models --backend nccl \\
        --lengths 512,8192,32768 --budget 0.01 --out benchmarks/results/h200x2_cluster_llama3-8b.json

What it measures, both sides on the same model folder, ranks and backend:

* ours: ``mlx_notebook.cluster.start`` then ``generate(ids, model=...)`` on the
  ranks (tensor parallel, ``sharded_load``): prefill and decode tokens/s
  (medians of ``--repeats``), and the stop latency of ``cancel()`` at a
  random moment of prefill and of decode, from the call to ``wait()``
  returning (p50 / p95 / p99 / max);
* mlx-lm: its sharded generation (the logic of mlx-lm's
  ``examples/sharded_generate.py``: ``sharded_load`` then ``stream_generate``
  on every rank under ``mlx.launch``): prefill and decode tokens/s, the time
  of one 8-byte ``all_sum`` (what our agreement adds per checkpoint), and,
  since mlx-lm has no stop, what stopping costs there: ending the job (SIGTERM
  to the group until every rank is gone) plus loading the model again;
* ours on one process (the local worker, one device), for the ratio ranks / one;
* ratios ours / mlx-lm.

EOS is ignored on both sides, so every run decodes ``--decode-tokens``.
The result is printed as JSON (and written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens in most vocabularies).
    return [rng.randrange(16, min(vocab, 30000)) for _ in range(length)]


def model_folder(args: argparse.Namespace) -> Path:
    """The model folder: ``--model``, or a ``--synthetic`` one built into ``--build-dir`` (reused when there)."""
    if args.model:
        from mlx_notebook.cluster.launch import model_folder as resolve_folder

        return resolve_folder(args.model)
    base = Path(args.build_dir or tempfile.mkdtemp(prefix="cluster-bench-"))
    folder = base / args.synthetic
    if (folder / "config.json").is_file():
        return folder
    t0 = time.perf_counter()
    if args.synthetic == "testkit-tiny":
        from testkit.tiny_model import make_tiny_model

        make_tiny_model(folder, layers=8, hidden=256, heads=8, kv_heads=4, intermediate=512)
    else:
        from benchmarks.bench import build_synthetic

        build_synthetic(args.synthetic, folder)
    print(f"built {args.synthetic} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return folder


def summary(values: list[float]) -> dict[str, float | int | None]:
    from benchmarks.bench import summary as percentiles

    result: dict[str, float | int | None] = percentiles(values)
    return result


# -- ours ----------------------------------------------------------------------------------


def measure_ours(folder: Path, args: argparse.Namespace, lengths: list[int], vocab: int, stops: int) -> dict:
    """Our cluster: start it, measure every length, stop it."""
    from mlx_notebook import cluster

    os.environ["MLX_NOTEBOOK_CLUSTER_IGNORE_EOS"] = "1"
    t0 = time.perf_counter()
    running = cluster.start(str(folder), ranks=args.ranks, backend=args.backend, name="bench")
    result: dict = {"start_s": time.perf_counter() - t0, "load_s": running.load_s}
    try:
        result["lengths"] = measure_lengths("cluster", "bench", None, args, lengths, vocab, stops)
    finally:
        cluster.stop()
    return result


def measure_single(folder: Path, args: argparse.Namespace, lengths: list[int], vocab: int, stops: int) -> dict:
    """The same model on one process (one device): the local worker, prompt cache off, EOS off."""
    import mlx_notebook

    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    name = str(folder)
    worker.load_model(name)
    worker.call(lambda store: setattr(store.get(name).tokenizer, "eos_token_ids", []))
    try:
        return {"lengths": measure_lengths("single", name, worker, args, lengths, vocab, stops)}
    finally:
        worker.shutdown()


def measure_lengths(
    label: str, model: str, worker, args: argparse.Namespace, lengths: list[int], vocab: int, stops_per_phase: int
) -> dict:
    """Throughput (medians of ``--repeats``) and stop latencies of ``generate(model=...)`` per prompt length."""
    import mlx_notebook

    rng = random.Random(1)
    results = {}

    def start(ids: list[int], max_tokens: int):
        return mlx_notebook.generate(ids, model=model, max_tokens=max_tokens, stop_budget=args.budget, worker=worker)

    for length in lengths:
        ids = prompt_ids(length, vocab)
        runs = []
        for _ in range(args.warmup + args.repeats):
            gen = start(ids, args.decode_tokens)
            gen.result(1800)
            runs.append((gen.stats.prompt_tps, gen.stats.generation_tps, gen.stats.decode_in_flight))
        runs = runs[args.warmup :]
        prefill_tps = statistics.median(r[0] for r in runs)
        decode_tps = statistics.median(r[1] for r in runs)
        stops: dict[str, list[float]] = {"prefill": [], "decode": []}
        for phase in ("prefill", "decode"):
            for _ in range(stops_per_phase):
                window = length / prefill_tps if phase == "prefill" else min(1.0, 3 * args.decode_tokens / decode_tps)
                stops[phase].append(stop_once(start(ids, args.decode_tokens * 4), phase, window, rng))
        results[str(length)] = {
            "prefill_tps": prefill_tps,
            "decode_tps": decode_tps,
            "decode_in_flight": runs[-1][2],
            "stop_s": {phase: summary(values) for phase, values in stops.items()},
        }
        print(f"{label} {length}: {json.dumps(results[str(length)])}", file=sys.stderr, flush=True)
    return results


def stop_once(gen, phase: str, window_s: float, rng) -> float:
    """Cancel ``gen`` at a random moment of ``phase``; seconds from ``cancel()`` to ``wait()`` returning."""
    if phase == "prefill":
        while gen.state == "queued" and not gen.finished:
            time.sleep(0.001)
    else:
        while gen.stats.generated_tokens < 1 and not gen.finished:
            time.sleep(0.001)
    time.sleep(rng.uniform(0.0, 0.8 * window_s))
    t0 = time.perf_counter()
    gen.cancel()
    gen.wait(60)
    seconds = time.perf_counter() - t0
    if gen.state != "stopped":
        print(f"a stop in {phase} found the generation {gen.state}", file=sys.stderr)
    return seconds


# -- mlx-lm's sharded generation ------------------------------------------------------------


def launch_reference(folder: Path, args: argparse.Namespace, lengths: list[int], *, hold: bool = False):
    """``mlx.launch`` of this script's ``--reference-rank`` mode (mlx-lm's sharded generation)."""
    from mlx_notebook.cluster.launch import LAUNCH_MAIN  # mlx.launch as our cluster runs it (no spinning)

    cmd = [sys.executable, "-c", LAUNCH_MAIN, "--backend", args.backend, "-n", str(args.ranks)]
    cmd += ["--starting-port", str(random.randrange(30000, 50000)), "--nccl-port", str(random.randrange(50000, 60000))]
    cmd += ["--python", sys.executable, "--", "-m", "benchmarks.cluster_bench", "--reference-rank"]
    cmd += ["--model", str(folder), "--lengths", ",".join(map(str, lengths)), "--backend", args.backend]
    cmd += ["--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if hold:
        cmd.append("--hold")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def measure_reference(folder: Path, args: argparse.Namespace, lengths: list[int], *, end_job: bool) -> dict:
    proc = launch_reference(folder, args, lengths)
    out, _ = proc.communicate(timeout=3600)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"mlx-lm's sharded generation failed ({proc.returncode}):\n{out[-3000:]}")
    result: dict = json.loads(lines[-1])
    if not end_job:
        return result
    # Stopping mlx-lm: end the job mid-decode; continuing means loading the model again.
    proc = launch_reference(folder, args, [lengths[0]], hold=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("decoding"):
            break
    time.sleep(0.2)
    t0 = time.perf_counter()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    while _group_alive(proc.pid):
        time.sleep(0.01)
    result["end_job_s"] = time.perf_counter() - t0
    result["stop_and_reload_s"] = result["end_job_s"] + result["load_s"]
    return result


def merge_rounds(rounds: list[dict]) -> dict:
    """Round 0's result, with each throughput the median over the rounds (the per-round values kept)."""
    merged = json.loads(json.dumps(rounds[0]))
    for length, entry in merged["lengths"].items():
        for key in ("prefill_tps", "decode_tps"):
            values = [r["lengths"][length][key] for r in rounds]
            entry[key] = statistics.median(values)
            entry[key + "_rounds"] = values
    return merged


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def reference_rank(args: argparse.Namespace) -> None:
    """One rank of mlx-lm's sharded generation (mlx-lm's ``examples/sharded_generate.py``, timed)."""
    from mlx_notebook.loading.blas import preload_openblas

    preload_openblas()  # before mlx: MLX's CPU matmuls on OpenBLAS, as on our ranks
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init(backend=args.backend)
    t0 = time.perf_counter()
    model, tokenizer = sharded_load(args.model, tensor_group=group)
    load_s = time.perf_counter() - t0
    tokenizer.eos_token_ids = []
    vocab = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size", 30000)
    small = mx.array([1.0, 2.0])
    times = []
    for _ in range(200):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(small, group=group))
        times.append(time.perf_counter() - t)
    result: dict = {"load_s": load_s, "all_sum_8b_ms": 1000 * statistics.median(times), "lengths": {}}
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = prompt_ids(length, vocab)
        if args.hold:
            for n, _ in enumerate(stream_generate(model, tokenizer, ids, max_tokens=10**6)):
                if n == 2 and group.rank() == 0:
                    print("decoding", flush=True)
            return
        runs = []
        for _ in range(args.warmup + args.repeats):
            last = None
            for last in stream_generate(model, tokenizer, ids, max_tokens=args.decode_tokens):  # noqa: B007
                pass
            assert last is not None
            runs.append((last.prompt_tps, last.generation_tps))
        runs = runs[args.warmup :]
        result["lengths"][str(length)] = {
            "prefill_tps": statistics.median(r[0] for r in runs),
            "decode_tps": statistics.median(r[1] for r in runs),
        }
    if group.rank() == 0:
        print(json.dumps(result), flush=True)


# -- driver -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a local MLX model folder (or a .gguf file, or default)")
    ap.add_argument(
        "--synthetic",
        choices=["testkit-tiny", "llama-tiny", "qwen3-tiny", "llama3-8b", "qwen3-8b"],
        help="build a random-weight model of this shape instead (see benchmarks/bench.py)",
    )
    ap.add_argument("--build-dir", help="where --synthetic models are built (reused when present)")
    ap.add_argument("--backend", default="ring", help="ring (CPU, Macs), nccl (NVIDIA), jaccl, mpi (default ring)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks on this host (default 2)")
    ap.add_argument("--lengths", default="512", help="prompt lengths, comma-separated (default 512)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per length and side (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    ap.add_argument("--stops", type=int, default=10, help="stops per phase and length (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the sides (default 3)")
    ap.add_argument("--budget", type=float, default=0.1, help="our stop budget in seconds (default 0.1)")
    ap.add_argument(
        "--no-single",
        dest="single",
        action="store_false",
        help="skip the single-process run of the same model (ratio ranks / one device)",
    )
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--reference-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_rank:
        reference_rank(args)
        return
    if not args.model and not args.synthetic:
        ap.error("give --model PATH or --synthetic NAME")
    from mlx_notebook.loading.blas import preload_openblas

    preload_openblas()  # before mlx
    import mlx.core as mx

    lengths = [int(x) for x in args.lengths.split(",")]
    folder = model_folder(args)
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size", 30000)
    # Rounds alternate the sides, so that a machine whose load changes (a shared CPU) weighs on both alike.
    runs: dict[str, list[dict]] = {"ours": [], "mlx_lm": [], "single": []}
    for round_ in range(args.rounds):
        stops = args.stops if round_ == 0 else 0
        runs["ours"].append(measure_ours(folder, args, lengths, vocab, stops))
        runs["mlx_lm"].append(measure_reference(folder, args, lengths, end_job=round_ == 0))
        if args.single:
            runs["single"].append(measure_single(folder, args, lengths, vocab, stops))
    ours, ref = merge_rounds(runs["ours"]), merge_rounds(runs["mlx_lm"])
    single = merge_rounds(runs["single"]) if args.single else None
    ratios = {}
    for length in map(str, lengths):
        o, r = ours["lengths"][length], ref["lengths"][length]
        ratios[length] = {
            "prefill_tps": o["prefill_tps"] / r["prefill_tps"],
            "decode_tps": o["decode_tps"] / r["decode_tps"],
            # Our p99 stop against mlx-lm's only stop: end the job and load again.
            "stop_p99_vs_end_and_reload": {
                phase: o["stop_s"][phase]["p99"] / ref["stop_and_reload_s"] for phase in ("prefill", "decode")
            },
        }
    result = {
        "what": "cluster (ours) vs mlx-lm sharded generation, tensor parallel",
        "model": args.synthetic or args.model,
        "folder": str(folder),
        "backend": args.backend,
        "ranks": args.ranks,
        "budget_s": args.budget,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "device": str(mx.default_device()),
        "host": platform.node(),
        "ours": ours,
        "mlx_lm": ref,
        "ratio_ours_over_mlx_lm": ratios,
        "single_process": single,
    }
    if single is not None:
        result["ratio_ranks_over_single"] = {
            length: {
                key: ours["lengths"][length][key] / single["lengths"][length][key]
                for key in ("prefill_tps", "decode_tps")
            }
            for length in map(str, lengths)
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
