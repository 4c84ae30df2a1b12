"""Chat turn-N time to first token with the prompt cache on vs off.

Usage::

    python -m benchmarks.chat_ttft --model default --out benchmarks/results/chat_ttft_cpu_default.json

Runs the same ``--turns``-turn greedy conversation (a :class:`mlx_notebook.Chat`)
on two workers: ``Worker()`` (turn N starts from the KV cache turn N-1 left in
the prompt cache) and ``Worker(prompt_cache_gb=0)`` (every turn prefills the
whole history), alternating, ``--repeats`` times, the cache emptied before each
conversation. Reports turn-N TTFT for both, their ratio, each turn's prompt and
cached tokens, and whether both gave the same answers. Prints the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

# mlx_notebook before mlx: it binds MLX's CPU matmuls to OpenBLAS, which must be
# loaded first (imported after mlx, prefill runs on the reference BLAS, ~10x slower).
import mlx_notebook  # isort: skip

import mlx.core as mx

from benchmarks.bench import save

QUESTIONS = [
    "Name a river in France.",
    "How long is it?",
    "Which cities does it flow through?",
    "Name a river in Germany.",
    "Which one is longer?",
    "What is a delta?",
    "Give an example of a river with a delta.",
    "What lives in rivers?",
    "Why are rivers important for farming?",
    "Summarize our conversation in two sentences.",
]


def conversation(worker: mlx_notebook.Worker, model: str, turns: int, max_tokens: int) -> list[dict[str, Any]]:
    """One greedy conversation; each turn's measurements."""
    # Empty the prompt cache: each conversation starts cold, like a new chat.
    worker.call(lambda store: [m.prompt_cache.clear() for m in store.loaded() if m.prompt_cache is not None])
    chat = mlx_notebook.Chat(model, worker=worker, max_tokens=max_tokens)
    out = []
    for question in (QUESTIONS * (turns // len(QUESTIONS) + 1))[:turns]:
        gen = chat.send(question)
        gen.result(timeout=600)
        stats = gen.stats
        out.append(
            {
                "ttft_s": stats.ttft_s,
                "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens,
                "generated_tokens": stats.generated_tokens,
                "load_s": stats.load_s,
                "tokens": gen.tokens,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    workers = {"cache_on": mlx_notebook.Worker(), "cache_off": mlx_notebook.Worker(prompt_cache_gb=0)}
    runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in workers}
    result: dict[str, Any] = {
        "benchmark": "chat_ttft",
        "model": args.model,
        "device": str(mx.default_device()),
        "blas": mlx_notebook.active_blas(),
        "machine": platform.platform(),
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
    }
    try:
        for worker in workers.values():
            mlx_notebook.load_model(args.model, worker=worker)  # load time stays out of turn 1
        for repeat in range(args.repeats):
            for mode, worker in workers.items():  # alternated: drift in machine load hits both
                runs[mode].append(conversation(worker, args.model, args.turns, args.max_tokens))
                print(
                    f"repeat {repeat + 1} {mode}: turn {args.turns} ttft {runs[mode][-1][-1]['ttft_s']:.3f} s",
                    file=sys.stderr,
                )
            result.update(_summary(runs, args.turns))
            save(result, args.out)  # a run cut short keeps the repeats it finished
    finally:
        for worker in workers.values():
            worker.shutdown(timeout=60)
    print(json.dumps(result, indent=1))


def _summary(runs: dict[str, list[list[dict[str, Any]]]], turns: int) -> dict[str, Any]:
    """Turn-``turns`` TTFT with the cache on and off (medians over the repeats), and each turn of the first run."""
    last = turns - 1
    ttft = {mode: [run[last]["ttft_s"] for run in runs[mode]] for mode in runs}
    on, off = statistics.median(ttft["cache_on"]), statistics.median(ttft["cache_off"])
    return {
        f"turn{turns}_ttft_s": {"cache_on": on, "cache_off": off, "all": ttft},
        f"turn{turns}_ttft_ratio_off_over_on": off / on,
        f"turn{turns}_prompt_tokens": runs["cache_on"][0][last]["prompt_tokens"],
        f"turn{turns}_cached_tokens": [run[last]["cached_tokens"] for run in runs["cache_on"]],
        "per_turn_cache_on": [
            {k: t[k] for k in ("ttft_s", "prompt_tokens", "cached_tokens", "generated_tokens")}
            for t in runs["cache_on"][0]
        ],
        "per_turn_ttft_cache_off": [t["ttft_s"] for t in runs["cache_off"][0]],
        "same_answers": all(
            [t["tokens"] for t in a] == [t["tokens"] for t in b] for a, b in zip(runs["cache_on"], runs["cache_off"])
        ),
    }


if __name__ == "__main__":
    main()
