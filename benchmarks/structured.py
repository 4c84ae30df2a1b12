"""Structured output on a real model: how many answers parse, decode speed with a schema, mask time.

Usage::

    python -m benchmarks.structured --out benchmarks/results/cpu_structured_default.json
    python -m benchmarks.structured --synthetic qwen3-tiny --build-dir /tmp/sbuild --rows 8 \
        --repeats 2 --stop-rounds 6 --out /tmp/structured_tiny.json          # the 8B path, small, on a CPU
    bash benchmarks/device_run.sh python3 -m benchmarks.structured --synthetic qwen3-8b \
        --build-dir /tmp/build --budget 0.01 --rows 8 --repeats 3 --stop-rounds 20 \
        --json "$OUT/h200_structured_qwen3-8b.json"                        # on an NVIDIA machine

On the default model (CPU unless MLX says otherwise), or with ``--synthetic`` on a
random-weight model of a real shape with a real-size tokenizer (``benchmarks.bench``'s
shapes, e.g. ``qwen3-8b``: 151,936 tokens), built into ``--build-dir`` first:

* **extraction** (not with ``--synthetic``: random weights write junk, so the parse
  rate is the default model's figure): 24 short sentences, each asking for ``{"city": str, "year": int}``,
  submitted with ``generate_many(..., schema=Record)``: how many parse and validate;
  the same prompts unconstrained (asked for JSON in words): how many parse.
* **decode** (EOS off): decode tok/s (``stats.generation_tps``: tokens after the
  first over their time) of one generation with a JSON schema whose value is long
  (an array of short strings) against the same prompt unconstrained with
  ``max_tokens`` set to the constrained run's length, alternated ``--repeats``
  times; and the same with ``--rows`` generations decoding together (the rows'
  mean ``generation_tps``; aggregate tokens / wall time beside it).
* **mask**: the constrained run's tokens replayed through a
  :class:`~mlx_notebook.generation.constraint_matcher.RowMatcher` on this thread:
  milliseconds per mask (the host work a constrained step adds; in the step it
  overlaps the device's forward).
* **stop** (``--stop-rounds N``): N rounds in which ``--rows`` constrained rows decode
  (a schema whose value is at least 256 strings long) and one row, chosen at random, is
  cancelled 0-0.2 s after all of them decode: ``cancel()`` to ``wait()`` on this thread,
  p50 / p99 / max ms against ``--budget`` (``benchmarks.batching.stop_one_rounds``).

Every generation runs with ``stop_budget=--budget`` (default: the library's default).
It needs llguidance (and jsonschema for the extraction part), not pydantic.
"""

from __future__ import annotations

# mlx_notebook before mlx: it binds MLX's CPU matmuls to OpenBLAS.
import mlx_notebook  # isort: skip

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.batching import stop_one_rounds
from benchmarks.bench import SYNTHETIC, GilSampler, build_synthetic, percentile, save, summary
from mlx_notebook.generation.constraint_matcher import RowMatcher, ll_tokenizer
from mlx_notebook.generation.request import GenerationRequest

RECORD = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["city", "year"],
}
EVENTS = [
    ("Lisbon", 1755, "An earthquake destroyed much of Lisbon in 1755."),
    ("Paris", 1889, "The Eiffel Tower opened in Paris in 1889."),
    ("Rome", 1960, "Rome hosted the Summer Olympics in 1960."),
    ("Berlin", 1989, "The Berlin Wall fell in 1989."),
    ("London", 1666, "A great fire burned through London in 1666."),
    ("Tokyo", 1964, "Tokyo held the Olympic Games in 1964."),
    ("Chicago", 1871, "A fire swept across Chicago in 1871."),
    ("Vienna", 1815, "Diplomats met at a congress in Vienna in 1815."),
    ("Madrid", 1992, "Madrid was the European Capital of Culture in 1992."),
    ("Cairo", 1869, "The Suez Canal was celebrated in Cairo in 1869."),
    ("Moscow", 1812, "Napoleon entered Moscow in 1812."),
    ("Sydney", 1973, "The Sydney Opera House opened in 1973."),
    ("Boston", 1773, "Colonists threw tea into Boston harbour in 1773."),
    ("Athens", 1896, "The first modern Olympics took place in Athens in 1896."),
    ("Prague", 1968, "Tanks rolled into Prague in 1968."),
    ("Dublin", 1916, "An uprising began in Dublin in 1916."),
    ("Seoul", 1988, "Seoul hosted the Olympics in 1988."),
    ("Florence", 1504, "Michelangelo finished his David in Florence in 1504."),
    ("Venice", 1797, "The Republic of Venice ended in 1797."),
    ("Mexico City", 1968, "Mexico City welcomed the Olympics in 1968."),
    ("Amsterdam", 1602, "The Dutch East India Company was founded in Amsterdam in 1602."),
    ("Istanbul", 1453, "Constantinople, now Istanbul, fell in 1453."),
    ("San Francisco", 1906, "An earthquake shook San Francisco in 1906."),
    ("Beijing", 2008, "Beijing hosted the Summer Olympics in 2008."),
]
LONG = {
    "type": "object",
    "properties": {
        "ideas": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 12, "maxItems": 12}
    },
    "required": ["ideas"],
}
LONG_PROMPT = "List twelve short ideas for a weekend in the mountains."
# The stop rounds' rows must still decode when one is stopped (up to 0.2 s after all of
# them decode, then the stop): at least 256 strings, hundreds of tokens whatever the model.
ENDLESS = {
    "type": "object",
    "properties": {"ideas": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 256}},
    "required": ["ideas"],
}


def extraction(worker: mlx_notebook.Worker, model: str) -> dict[str, Any]:
    import jsonschema  # only here: the rest runs where jsonschema is not installed

    prompts = [f"Extract the city and the year as JSON with keys city and year.\n{s}" for _, _, s in EVENTS]
    t0 = time.perf_counter()
    batch = mlx_notebook.generate_many(prompts, model=model, worker=worker, schema=RECORD, max_tokens=48)
    assert batch.wait(1800)
    constrained_s = time.perf_counter() - t0
    parsed = [r for r in batch.records() if r["error"] is None]
    valid = 0
    right = 0
    for gen, (city, year, _) in zip(batch, EVENTS):
        try:
            value = gen.parsed
            jsonschema.validate(value, RECORD)
        except Exception:
            continue
        valid += 1
        right += value["city"] == city and value["year"] == year
    t0 = time.perf_counter()
    free = mlx_notebook.generate_many(prompts, model=model, worker=worker, max_tokens=48)
    assert free.wait(1800)
    free_s = time.perf_counter() - t0
    free_valid = 0
    for gen in free:
        try:
            jsonschema.validate(json.loads(gen.text), RECORD)
            free_valid += 1
        except Exception:
            pass
    return {
        "prompts": len(prompts),
        "constrained_parse_and_validate": valid,
        "constrained_parsed_records": len(parsed),
        "constrained_right_values": right,
        "constrained_wall_s": constrained_s,
        "unconstrained_parse_and_validate": free_valid,
        "unconstrained_wall_s": free_s,
        "examples": [g.text for g in batch][:3],
        "unconstrained_examples": [g.text for g in free][:3],
    }


def decode(
    worker: mlx_notebook.Worker,
    model: str,
    repeats: int,
    rows: int,
    *,
    budget: float = mlx_notebook.DEFAULT_STOP_BUDGET_S,
    max_tokens: int = 400,
) -> dict[str, Any]:
    # EOS off (as benchmarks.bench does), so the unconstrained runs make as many tokens as the
    # constrained ones; a constrained row still ends where its value closes (finish "grammar").
    worker.call(lambda store: setattr(store.get(model).tokenizer, "eos_token_ids", []))
    pairs: list[dict[str, Any]] = []
    tokens: list[int] = []
    for _ in range(repeats):
        gen = mlx_notebook.generate(
            LONG_PROMPT, model=model, worker=worker, schema=LONG, max_tokens=max_tokens, stop_budget=budget
        )
        gen.result(timeout=1800)
        n = gen.stats.generated_tokens
        tokens = gen.tokens
        free = mlx_notebook.generate(LONG_PROMPT, model=model, worker=worker, max_tokens=n, stop_budget=budget)
        free.result(timeout=1800)
        pairs.append(
            {
                "tokens": n,
                "finish": str(gen.stats.finish_reason),
                "constrained_tps": gen.stats.generation_tps,
                "unconstrained_tokens": free.stats.generated_tokens,
                "unconstrained_tps": free.stats.generation_tps,
                "constrained_in_flight": gen.stats.decode_in_flight,
                "unconstrained_in_flight": free.stats.decode_in_flight,
            }
        )
        print(json.dumps(pairs[-1]), flush=True)
    many: list[dict[str, Any]] = []
    for _ in range(repeats):
        out = {}
        for label, options in (("constrained", {"schema": LONG}), ("unconstrained", {})):
            n = max(p["tokens"] for p in pairs)
            t0 = time.perf_counter()
            batch = mlx_notebook.generate_many(
                [LONG_PROMPT] * rows,
                model=model,
                worker=worker,
                max_tokens=n,
                temperature=0.7,
                seed=1,
                stop_budget=budget,
                **options,
            )
            assert batch.wait(1800)
            wall = time.perf_counter() - t0
            made = sum(g.stats.generated_tokens for g in batch)
            per_row = statistics.fmean(g.stats.generation_tps or 0.0 for g in batch)
            out[label] = {
                "tokens": made,
                "wall_s": wall,
                "tps": made / wall,
                "row_tps_mean": per_row,
                "largest_batch": max(g.stats.batch_size for g in batch),
            }
        many.append(out)
        print(json.dumps(out), flush=True)
    ratio = [p["constrained_tps"] / p["unconstrained_tps"] for p in pairs]
    ratio_many = [m["constrained"]["row_tps_mean"] / m["unconstrained"]["row_tps_mean"] for m in many]
    ratio_wall = [m["constrained"]["tps"] / m["unconstrained"]["tps"] for m in many]
    return {
        "pairs": pairs,
        "ratio_median": statistics.median(ratio),
        "ratio_of_medians": statistics.median(p["constrained_tps"] for p in pairs)
        / statistics.median(p["unconstrained_tps"] for p in pairs),
        "rows": rows,
        "batched": many,
        "batched_ratio_median": statistics.median(ratio_many),
        "batched_aggregate_ratio_median": statistics.median(ratio_wall),
        "tokens": tokens,
    }


def stops(
    worker: mlx_notebook.Worker, model: str, rows: int, budget: float, rounds: int, seed: int = 0
) -> dict[str, Any]:
    """Stop one of ``rows`` constrained rows while the others decode (``benchmarks.batching``'s method)."""
    prompts = [f"{LONG_PROMPT} ({i + 1})" for i in range(rows)]
    detail: list[dict[str, Any]] = []
    gil = GilSampler()
    try:
        lat, steps, worker_side, early = stop_one_rounds(
            worker,
            model,
            prompts,
            budget,
            rounds,
            random.Random(seed),
            options={"schema": ENDLESS},
            detail=detail,
            gil=gil,
        )
    finally:
        gil.close()
    p99 = 1000 * percentile(lat, 99)
    return {
        "rows": rows,
        "rounds": len(lat),
        "budget_ms": 1000 * budget,
        "p50": 1000 * percentile(lat, 50),
        "p99": p99,
        "max": 1000 * max(lat),
        "p99_within_budget": p99 <= 1000 * budget,
        "batched_step_ms": 1000 * statistics.median(steps),
        "worker_side_p50": 1000 * percentile(worker_side, 50),
        "worker_side_p99": 1000 * percentile(worker_side, 99),
        "reported_before_the_others_next_token": early,
        "rounds_detail": detail,
    }


def mask_times(worker: mlx_notebook.Worker, model: str, tokens: list[int]) -> dict[str, Any]:
    loaded = worker.call(lambda store: store.get(model))
    t0 = time.perf_counter()
    tok = ll_tokenizer(loaded)
    setup_s = time.perf_counter() - t0
    constraint = GenerationRequest("x", schema=LONG).constraint
    assert constraint is not None
    width = loaded.config.get("vocab_size", tok.vocab_size)
    times = []
    for _ in range(3):
        matcher = RowMatcher(constraint, tok)
        for token in tokens:
            t0 = time.perf_counter()
            matcher.allowed(width)
            times.append((time.perf_counter() - t0) * 1e3)
            matcher.advance(token)
    return {"vocab": width, "tokenizer_setup_s": setup_s, "mask_ms": summary(times), "mean_ms": statistics.fmean(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--synthetic", choices=sorted(SYNTHETIC), help="build a random-weight model of this shape instead of --model"
    )
    parser.add_argument(
        "--build-dir", type=Path, help="where --synthetic builds (reused when present); default: a temp folder"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S, help="stop_budget (s)")
    parser.add_argument("--max-tokens", type=int, default=400, help="the constrained decode runs' max_tokens")
    parser.add_argument("--stop-rounds", type=int, default=0, help="rounds of stopping one constrained row of --rows")
    parser.add_argument("--skip-extraction", action="store_true")
    parser.add_argument("--out", "--json", dest="out", type=Path)
    args = parser.parse_args()
    model = args.model
    result: dict[str, Any] = {
        "model": args.synthetic or args.model,
        "machine": platform.machine(),
        "device": str(mx.default_device()),
        "budget": args.budget,
        "command": " ".join(["python -m benchmarks.structured", *sys.argv[1:]]),
    }
    if args.synthetic:
        t0 = time.perf_counter()
        model = build_synthetic(args.synthetic, (args.build_dir or Path(tempfile.mkdtemp())) / args.synthetic)
        result["build_s"] = time.perf_counter() - t0
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    t0 = time.perf_counter()
    worker.load_model(model)
    result["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mlx_notebook.generate(
        "warm up", model=model, worker=worker, schema=RECORD, max_tokens=8, stop_budget=args.budget
    ).result(600)
    result["first_constrained_s"] = time.perf_counter() - t0  # the llguidance tokenizer's build included
    if args.synthetic:
        # The batched step's kernels at every batch size, with and without masks, before anything is timed.
        for options in ({"schema": RECORD}, {}):
            mlx_notebook.generate_many(
                [LONG_PROMPT] * args.rows, model=model, worker=worker, max_tokens=8, stop_budget=args.budget, **options
            ).wait(600)
    print(json.dumps({k: v for k, v in result.items() if k != "command"}), flush=True)
    if not (args.skip_extraction or args.synthetic):
        result["extraction"] = extraction(worker, model)
        print(json.dumps({k: v for k, v in result["extraction"].items() if "examples" not in k}), flush=True)
        save(result, args.out)
    result["decode"] = decode(worker, model, args.repeats, args.rows, budget=args.budget, max_tokens=args.max_tokens)
    tokens = result["decode"].pop("tokens")
    save(result, args.out)
    result["mask"] = mask_times(worker, model, tokens)
    print(json.dumps(result["mask"]), flush=True)
    save(result, args.out)
    if args.stop_rounds:
        result["stop_one_constrained_row_ms"] = stops(worker, model, args.rows, args.budget, args.stop_rounds)
        print(json.dumps(result["stop_one_constrained_row_ms"]), flush=True)
        save(result, args.out)
    print(
        f"decode constrained/unconstrained: {result['decode']['ratio_median']:.2f}x (1 row), "
        f"{result['decode']['batched_ratio_median']:.2f}x ({args.rows} rows); mask "
        f"{result['mask']['mean_ms']:.3f} ms mean, p99 {result['mask']['mask_ms']['p99']:.3f} ms"
    )
    if args.stop_rounds:
        stop = result["stop_one_constrained_row_ms"]
        print(
            f"stop one constrained row of {args.rows}: p50 {stop['p50']:.1f} ms, p99 {stop['p99']:.1f} ms, "
            f"max {stop['max']:.1f} ms (budget {1000 * args.budget:.0f} ms)"
        )
    worker.shutdown(timeout=60)
    save(result, args.out)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
