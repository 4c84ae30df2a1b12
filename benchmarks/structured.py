"""Structured output on a real model: how many answers parse, decode speed with a schema, mask time.

Usage::

    python -m benchmarks.structured --out benchmarks/results/cpu_structured_default.json

On the default model (CPU unless MLX says otherwise):

* **extraction**: 24 short sentences, each asking for ``{"city": str, "year": int}``,
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
"""

from __future__ import annotations

# mlx_notebook before mlx: it binds MLX's CPU matmuls to OpenBLAS.
import mlx_notebook  # isort: skip

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema

from benchmarks.bench import save, summary
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


def extraction(worker: mlx_notebook.Worker, model: str) -> dict[str, Any]:
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


def decode(worker: mlx_notebook.Worker, model: str, repeats: int, rows: int) -> dict[str, Any]:
    # EOS off (as benchmarks.bench does), so the unconstrained runs make as many tokens as the
    # constrained ones; a constrained row still ends where its value closes (finish "grammar").
    worker.call(lambda store: setattr(store.get(model).tokenizer, "eos_token_ids", []))
    pairs = []
    tokens: list[int] = []
    for _ in range(repeats):
        gen = mlx_notebook.generate(LONG_PROMPT, model=model, worker=worker, schema=LONG, max_tokens=400)
        gen.result(timeout=1800)
        n = gen.stats.generated_tokens
        tokens = gen.tokens
        free = mlx_notebook.generate(LONG_PROMPT, model=model, worker=worker, max_tokens=n)
        free.result(timeout=1800)
        pairs.append(
            {
                "tokens": n,
                "finish": str(gen.stats.finish_reason),
                "constrained_tps": gen.stats.generation_tps,
                "unconstrained_tokens": free.stats.generated_tokens,
                "unconstrained_tps": free.stats.generation_tps,
            }
        )
        print(json.dumps(pairs[-1]), flush=True)
    many = []
    for _ in range(repeats):
        out = {}
        for label, options in (("constrained", {"schema": LONG}), ("unconstrained", {})):
            n = max(p["tokens"] for p in pairs)
            t0 = time.perf_counter()
            batch = mlx_notebook.generate_many(
                [LONG_PROMPT] * rows, model=model, worker=worker, max_tokens=n, temperature=0.7, seed=1, **options
            )
            assert batch.wait(1800)
            wall = time.perf_counter() - t0
            made = sum(g.stats.generated_tokens for g in batch)
            per_row = statistics.fmean(g.stats.generation_tps or 0.0 for g in batch)
            out[label] = {"tokens": made, "wall_s": wall, "tps": made / wall, "row_tps_mean": per_row}
        many.append(out)
        print(json.dumps(out), flush=True)
    ratio = [p["constrained_tps"] / p["unconstrained_tps"] for p in pairs]
    ratio_many = [m["constrained"]["row_tps_mean"] / m["unconstrained"]["row_tps_mean"] for m in many]
    return {
        "pairs": pairs,
        "ratio_median": statistics.median(ratio),
        "rows": rows,
        "batched": many,
        "batched_ratio_median": statistics.median(ratio_many),
        "tokens": tokens,
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--skip-extraction", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    worker.load_model(args.model)
    mlx_notebook.generate("warm up", model=args.model, worker=worker, schema=RECORD, max_tokens=8).result(600)
    result: dict[str, Any] = {"model": args.model, "machine": platform.machine()}
    if not args.skip_extraction:
        result["extraction"] = extraction(worker, args.model)
        print(json.dumps({k: v for k, v in result["extraction"].items() if "examples" not in k}), flush=True)
    result["decode"] = decode(worker, args.model, args.repeats, args.rows)
    result["mask"] = mask_times(worker, args.model, result["decode"].pop("tokens"))
    print(json.dumps(result["mask"]), flush=True)
    print(
        f"decode constrained/unconstrained: {result['decode']['ratio_median']:.2f}x (1 row), "
        f"{result['decode']['batched_ratio_median']:.2f}x ({args.rows} rows); mask "
        f"{result['mask']['mean_ms']:.3f} ms mean, p99 {result['mask']['mask_ms']['p99']:.3f} ms"
    )
    worker.shutdown(timeout=60)
    if args.out:
        save(result, args.out)


if __name__ == "__main__":
    main()
