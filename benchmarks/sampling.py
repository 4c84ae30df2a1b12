"""Decode throughput with each sampling option against mlx-lm with the same sampler, in one run.

Usage::

    python -m benchmarks.sampling --model default --out benchmarks/results/cpu_sampling_default.json
    python -m benchmarks.sampling --synthetic llama-tiny,qwen3-tiny   # real-size vocabularies, CPU
    bash benchmarks/device_run.sh python3 -m benchmarks.sampling --synthetic llama3-8b,qwen3-8b \
        --build-dir /tmp/build --decode-tokens 128 --prompt-length 512 --out h200_sampling.json

For every option (greedy, temperature, top-p, top-k, min-p, repetition
penalty, logit bias, a stop string that never occurs, log-probabilities on and
off), on the same loaded model, the same token prompt and ``max_tokens``:
``mlx_notebook.generate`` (one generation through the worker) and plain
``mlx_lm.stream_generate`` with the sampler and logits processors of
``mlx_lm.sample_utils.make_sampler`` / ``make_logits_processors``, on the
worker's thread, alternated, ``--repeats`` times after one warm-up each.
EOS is off (``bench.open_model``), so both decode every token.

Decode tok/s is (tokens - 1) / (last token time - first token time) for both
(mlx-lm's own ``generation_tps`` counts one token more), clocked as each token
reaches Python; beside it this process's CPU time per token, which other
processes' load on a shared machine disturbs far less than wall time. Options mlx-lm's
``stream_generate`` lacks are done the way its user would: a stop string by
searching the streamed text, log-probabilities by taking the top ids from each
response's ``logprobs`` vector. Prints one line per run and a table per model;
the JSON keeps every run.
"""

from __future__ import annotations

# mlx_notebook before mlx: it binds MLX's CPU matmuls to OpenBLAS (see chat_ttft.py).
import mlx_notebook  # isort: skip

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.bench import SYNTHETIC, open_model, prompt_ids, save
from mlx_notebook.generation import fused_projections

SEED = 0
NEVER = "<|never seen stop|>"
TOP_LOGPROBS = 5
SAMPLED = dict(temperature=0.8, seed=SEED)


@dataclass
class Option:
    """One sampling configuration, as our request fields and as mlx-lm's arguments."""

    name: str
    ours: dict[str, Any]
    sampler: dict[str, Any] = field(default_factory=dict)  # make_sampler(**)
    processors: dict[str, Any] = field(default_factory=dict)  # make_logits_processors(**)
    stop: list[str] | None = None
    logprobs: int = 0


def options(vocab: int) -> list[Option]:
    """Every option measured; the logit bias names a few token ids of a ``vocab``-token vocabulary."""
    bias = {16: 5.0, vocab // 3: -5.0, vocab // 2: -100.0, vocab - 1: 1.5}
    return [
        Option("greedy", {}),
        Option("temp 0.8", dict(SAMPLED), sampler=dict(temp=0.8)),
        Option("top_p 0.9", dict(SAMPLED, top_p=0.9), sampler=dict(temp=0.8, top_p=0.9)),
        Option("top_k 40", dict(SAMPLED, top_k=40), sampler=dict(temp=0.8, top_k=40)),
        Option("min_p 0.05", dict(SAMPLED, min_p=0.05), sampler=dict(temp=0.8, min_p=0.05)),
        Option(
            "repetition_penalty 1.1",
            dict(repetition_penalty=1.1, repetition_context=20),
            processors=dict(repetition_penalty=1.1, repetition_context_size=20),
        ),
        Option("logit_bias", dict(logit_bias=bias), processors=dict(logit_bias=bias)),
        Option("stop string", dict(stop=[NEVER]), stop=[NEVER]),
        Option(f"logprobs {TOP_LOGPROBS}", dict(logprobs=TOP_LOGPROBS), logprobs=TOP_LOGPROBS),
        Option("logprobs 0 (off)", dict(logprobs=0)),
    ]


class Clock:
    """When each token arrived: wall time and this process's CPU time (a listener, on the worker thread)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def __call__(self, event) -> None:
        if event.kind == "tokens" and len(event.generation.tokens) > len(self.wall):
            self.tick()

    def rates(self, t0: float) -> dict[str, Any]:
        """Decode tok/s over the tokens after the first, CPU ms per such token, time to the first."""
        n = len(self.wall)
        return {
            "decode_tps": (n - 1) / (self.wall[-1] - self.wall[0]),
            "cpu_ms_per_token": 1000 * (self.cpu[-1] - self.cpu[0]) / (n - 1),
            "ttft_s": self.wall[0] - t0,
            "tokens": n,
        }


def ours(worker, name: str, ids: list[int], max_tokens: int, option: Option, budget: float) -> dict[str, Any]:
    clock = Clock()
    t0 = time.perf_counter()
    gen = mlx_notebook.generate(
        ids, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget, max_batch=1, **option.ours
    )
    gen.add_listener(clock)  # before the first token: a prefill takes far longer than this
    gen.result()
    s = gen.stats
    assert len(clock.wall) == s.generated_tokens, "a token was not clocked"
    if option.logprobs:
        assert len(gen.logprobs) == s.generated_tokens, "a token without its log-probabilities"
    return dict(clock.rates(t0), stats_decode_tps=s.generation_tps, stats_ttft_s=s.ttft_s)


def mlx_lm(worker, name: str, ids: list[int], max_tokens: int, option: Option) -> dict[str, Any]:
    """``mlx_lm.stream_generate`` with the option's sampler, on the worker's thread (its stream rules)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    def job(store):
        loaded = store.get(name)
        mx.random.seed(SEED)
        sampler = make_sampler(**option.sampler)
        processors = make_logits_processors(**option.processors) if option.processors else None
        clock, text = Clock(), ""
        t0 = time.perf_counter()
        # mlx-lm's own model: separate projections where the worker fused them.
        with fused_projections.unfused(loaded.model):
            for response in stream_generate(
                loaded.model,
                loaded.tokenizer,
                ids,
                max_tokens=max_tokens,
                sampler=sampler,
                logits_processors=processors,
            ):
                clock.tick()
                if option.stop:
                    text += response.text
                    if any(stop in text[-len(stop) - len(response.text) :] for stop in option.stop):
                        break
                if option.logprobs:
                    lp = response.logprobs
                    top = mx.argpartition(-lp, option.logprobs - 1)[: option.logprobs]
                    [a.tolist() for a in (lp[response.token], top, lp[top])]
        return clock.rates(t0)

    return worker.call(job)


def measure(worker, name, ids, option: Option, args) -> dict[str, Any]:
    """Both, alternated, after one short warm-up each; medians and the ratio ours / mlx-lm."""
    ours(worker, name, ids, 4, option, args.budget)
    mlx_lm(worker, name, ids, 4, option)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "mlx_lm": []}
    for r in range(args.repeats):
        for who in ["ours", "mlx_lm"] if r % 2 == 0 else ["mlx_lm", "ours"]:
            if who == "ours":
                run = ours(worker, name, ids, args.decode_tokens, option, args.budget)
            else:
                run = mlx_lm(worker, name, ids, args.decode_tokens, option)
            runs[who].append(run)
            print(
                f"  {option.name:24s} {who:6s} {run['decode_tps']:8.2f} tok/s  {run['cpu_ms_per_token']:7.1f} CPU ms/token  "
                f"ttft {1000 * run['ttft_s']:7.1f} ms  {run['tokens']} tokens",
                flush=True,
            )
    med = {
        who: {k: statistics.median(r[k] for r in rows) for k in ("decode_tps", "cpu_ms_per_token", "ttft_s")}
        for who, rows in runs.items()
    }
    return {
        "ours": runs["ours"],
        "mlx_lm": runs["mlx_lm"],
        "ours_decode_tps": med["ours"]["decode_tps"],
        "mlx_lm_decode_tps": med["mlx_lm"]["decode_tps"],
        "ratio": med["ours"]["decode_tps"] / med["mlx_lm"]["decode_tps"],
        # Runs next to each other share the machine's load: the median of their ratios drifts less.
        "pair_ratio": statistics.median(
            a["decode_tps"] / b["decode_tps"] for a, b in zip(runs["ours"], runs["mlx_lm"])
        ),
        # The fastest run of each is the one other processes disturbed least.
        "best_ratio": max(r["decode_tps"] for r in runs["ours"]) / max(r["decode_tps"] for r in runs["mlx_lm"]),
        "ours_cpu_ms_per_token": med["ours"]["cpu_ms_per_token"],
        "mlx_lm_cpu_ms_per_token": med["mlx_lm"]["cpu_ms_per_token"],
        # CPU time per token counts this process's work only (not other processes' load): mlx-lm's / ours.
        "cpu_ratio": med["mlx_lm"]["cpu_ms_per_token"] / med["ours"]["cpu_ms_per_token"],
        "ours_ttft_s": med["ours"]["ttft_s"],
        "mlx_lm_ttft_s": med["mlx_lm"]["ttft_s"],
        "tokens": sorted({r["tokens"] for rows in runs.values() for r in rows}),
    }


def table(options: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of one model's options."""
    greedy = options.get("greedy", {}).get("ours_decode_tps")
    lines = [
        "| option | tok/s ours / mlx-lm | ratio | of pairs | of bests | CPU ms/token ours / mlx-lm "
        "| ours / our greedy | TTFT ms ours / mlx-lm |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in options.items():
        own = f"{m['ours_decode_tps'] / greedy:.2f}x" if greedy else "-"
        lines.append(
            f"| {name} | {m['ours_decode_tps']:.1f} / {m['mlx_lm_decode_tps']:.1f} | **{m['ratio']:.2f}x** "
            f"| {m['pair_ratio']:.2f}x | {m['best_ratio']:.2f}x "
            f"| {m['ours_cpu_ms_per_token']:.1f} / {m['mlx_lm_cpu_ms_per_token']:.1f} | {own} "
            f"| {1000 * m['ours_ttft_s']:.0f} / {1000 * m['mlx_lm_ttft_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model name (default: the SmolLM2 GGUF)")
    ap.add_argument("--synthetic", help=f"comma list of random-weight shapes to build instead: {', '.join(SYNTHETIC)}")
    ap.add_argument("--build-dir", help="where --synthetic models are built (reused when present)")
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument(
        "--options", help="comma list of option names to run (default: all): " + "; ".join(o.name for o in options(2))
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = args.synthetic.split(",") if args.synthetic else [None]
    unknown = [s for s in shapes if s is not None and s not in SYNTHETIC]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}; the shapes are: {', '.join(SYNTHETIC)}")
    import mlx_lm

    result: dict[str, Any] = {
        "benchmark": "sampling",
        "device": str(mx.default_device()),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "blas": mlx_notebook.active_blas(),
        "budget_s": args.budget,
        "prompt_length": args.prompt_length,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "command": " ".join(["python -m benchmarks.sampling", *sys.argv[1:]]),
        "models": {},
    }
    tmp = tempfile.TemporaryDirectory(prefix="mlxnb-sampling-")
    folder = Path(args.build_dir) if args.build_dir else Path(tmp.name)
    tables = []
    for shape in shapes:
        t0 = time.perf_counter()
        worker, name, vocab, load_s = open_model(args.model, shape, 0, folder)
        label = shape or args.model
        real_vocab = worker.call(lambda store: len(store.get(name).tokenizer.vocab))
        print(f"{label}: loaded in {load_s:.1f} s, vocabulary {real_vocab} (config {vocab})", flush=True)
        entry = result["models"][label] = {"load_s": load_s, "vocab_size": vocab, "options": {}}
        ids = prompt_ids(args.prompt_length, vocab, seed=1)
        for option in options(vocab):
            if args.options and option.name not in args.options.split(","):
                continue
            m = entry["options"][option.name] = measure(worker, name, ids, option, args)
            print(
                f"{label} {option.name}: ours {m['ours_decode_tps']:.2f} / mlx-lm {m['mlx_lm_decode_tps']:.2f} tok/s "
                f"= {m['ratio']:.3f}x",
                flush=True,
            )
            save(result, args.out)
        worker.shutdown()
        entry["wall_s"] = time.perf_counter() - t0
        tables.append(f"{label} ({entry['wall_s']:.0f} s)\n\n{table(entry['options'])}")
        save(result, args.out)
    print("\n\n".join(tables))
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
