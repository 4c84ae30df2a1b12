"""Structured output's tokenizer build and a stop: in this process (before) vs in a child (now).

llguidance builds its view of a model's tokenizer once per model, when the
first constrained row starts; that one native call holds the GIL throughout.

- ``in-process``: ``llguidance.LLTokenizer(tokenizer.json)`` on a helper thread
  (what the worker did before :mod:`mlx_notebook.generation.grammar_process`),
  a 1 ms sampling loop on the main thread: the build's time, the longest GIL
  hold, and the delay a stop asked at a random moment of the build waits for
  the GIL (p50/p99/max);
- ``decode``: the same model, constrained decode tok/s (``stats.generation_tps``)
  with the matchers in this process (the former ``RowMatcher``, patched in) and
  in the child, alternated, 1 row and 4 rows (a tiny model: steps of a few ms,
  where the per-token pipe round trip weighs most);
- ``child``: a real worker and a real-size model (``testkit.real_tokenizer``,
  random weights), a ``schema=`` generation stopped at a random moment while
  the child builds (the model's llguidance process is dropped before each
  round): ``cancel()`` -> ``wait()`` returning, the engine's
  ``stats.stop_latency_s``, and the longest GIL gap the sampling loop saw
  meanwhile; also the child's build time (start to ready).

Usage (repo root; run under /work/bin/quiet on the shared machine)::

    python -m benchmarks.grammar_gil [--arch qwen3|llama] [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlx_notebook
from mlx_notebook.generation import constraint_matcher
from mlx_notebook.generation.grammar_process import GrammarProcess
from testkit.real_tokenizer import make_real_model

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["city", "year"],
}


class GapSampler:
    """A thread that sleeps 1 ms at a time: a gap of G ms means the GIL was held ~G - 1 ms."""

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []  # (end time, gap)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append((now, now - last))
            last = now

    def __enter__(self) -> GapSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def longest(self, start: float, end: float) -> float:
        return max((gap for at, gap in self.gaps if start <= at <= end + 0.5), default=0.0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 4),
        "p99": round(pct(values, 0.99), 4),
        "max": round(max(values), 4),
    }


def in_process(tokenizer_json: Path, eos: list[int], rounds: int, rng: random.Random) -> dict[str, Any]:
    import llguidance

    builds, holds, delays = [], [], []
    for _ in range(rounds):
        done = threading.Event()
        span: list[float] = []

        def build() -> None:
            time.sleep(0.05)  # so that the main thread is asleep when the build takes the GIL
            span.append(time.perf_counter())
            llguidance.LLTokenizer(str(tokenizer_json), eos_token=eos)
            span.append(time.perf_counter())
            done.set()

        with GapSampler() as sampler:
            time.sleep(0.05)
            thread = threading.Thread(target=build)
            # A stop asked at a random moment of the build (it takes 0.7-1.5 s here):
            # when does this thread run again?
            target = time.perf_counter() + 0.05 + rng.uniform(0.0, 0.7)
            thread.start()
            time.sleep(max(0.0, target - time.perf_counter()))
            delays.append(max(0.0, time.perf_counter() - target))
            done.wait()
            thread.join()
        builds.append(span[1] - span[0])
        holds.append(sampler.longest(span[0], span[1]))
    return {
        "build_s": summary(builds),
        "longest_gil_hold_s": summary(holds),
        "stop_wait_s": summary(delays),
    }


def child(folder: Path, rounds: int, rng: random.Random) -> dict[str, Any]:
    worker = mlx_notebook.Worker()
    model = str(folder)
    try:
        # Load the model (and its tokenizer) once, unconstrained.
        mlx_notebook.generate("Hi", model=model, worker=worker, max_tokens=2).result(timeout=300)
        builds = []
        for _ in range(3):  # the child's build alone, start to ready
            start = time.perf_counter()
            process = GrammarProcess(str(folder / "tokenizer.json"), [0])
            process.wait_ready()
            builds.append(time.perf_counter() - start)
            process.close()
        walls, engine, gaps, during = [], [], [], 0
        for _ in range(rounds):
            _drop_processes()
            with GapSampler() as sampler:
                gen = mlx_notebook.generate(
                    "Once upon a time", model=model, worker=worker, schema=SCHEMA, max_tokens=40
                )
                time.sleep(rng.uniform(0.05, 1.2))
                processes = list(constraint_matcher._PROCESSES.values())
                building = bool(processes) and not processes[0].ready
                during += building
                asked = time.perf_counter()
                gen.cancel()
                gen.wait(timeout=60)
                returned = time.perf_counter()
            walls.append(returned - asked)
            if gen.stats.stop_latency_s is not None:
                engine.append(gen.stats.stop_latency_s)
            gaps.append(sampler.longest(asked - 1.5, returned))
        return {
            "child_build_s": summary(builds),
            "stops_during_build": during,
            "cancel_to_wait_s": summary(walls),
            "engine_stop_latency_s": summary(engine) if engine else None,
            "longest_gil_gap_s": summary(gaps),
        }
    finally:
        _drop_processes()
        worker.shutdown(timeout=60)


def _drop_processes() -> None:
    with constraint_matcher._PROCESSES_LOCK:
        for process in list(constraint_matcher._PROCESSES.values()):
            process.close()
        constraint_matcher._PROCESSES.clear()


LIST = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 12, "maxItems": 12}
    },
    "required": ["tags"],
}


class InProcessMatcher:
    """The former RowMatcher: llguidance in this process (for the decode comparison)."""

    tokenizer: Any = None  # llguidance.LLTokenizer, set by decode()

    @classmethod
    def for_row(cls, constraint: Any, loaded: Any, prompt: list[int], wait: Any) -> InProcessMatcher:
        return cls(constraint, cls.tokenizer)

    def __init__(self, constraint: Any, tokenizer: Any) -> None:
        import llguidance
        import llguidance.numpy

        self._fill = llguidance.numpy.fill_next_token_bitmask
        self.constraint = constraint
        self.vocab = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(tokenizer, constraint.grammar)
        self._bits = llguidance.numpy.allocate_token_bitmask(1, self.vocab)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    def allowed(self, width: int) -> Any:
        import numpy as np

        self._fill(self.matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        if allowed.shape[0] >= width:
            return allowed[:width]
        return np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])


def decode(folder: Path, repeats: int) -> dict[str, Any]:
    import llguidance

    from mlx_notebook.generation import decode_batch

    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    model = str(folder)
    InProcessMatcher.tokenizer = llguidance.LLTokenizer(str(folder / "tokenizer.json"), eos_token=[0])
    original = decode_batch.RowMatcher
    prompts = ["Once upon a time", "Tell me about the sea", "Hi", "The quick brown fox"]
    runs: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for _ in range(repeats):
            for where in ("in_process", "child"):
                patched = InProcessMatcher if where == "in_process" else original
                decode_batch.RowMatcher = patched  # type: ignore[misc,assignment]
                for rows in (1, 4):
                    batch = mlx_notebook.generate_many(
                        prompts[:rows], model=model, worker=worker, schema=LIST, max_tokens=200
                    )
                    batch.results(timeout=300)
                    key = f"{where}_{rows}_rows"
                    runs.setdefault(key, []).append(statistics.fmean(g.stats.generation_tps or 0.0 for g in batch))
                    tokens.setdefault(key, []).append([len(g.tokens) for g in batch])
    finally:
        decode_batch.RowMatcher = original  # type: ignore[misc]
        worker.shutdown(timeout=60)
    same = all(tokens[f"in_process_{r}_rows"] == tokens[f"child_{r}_rows"] for r in (1, 4))
    return {
        "tok_s_median": {key: round(statistics.median(values), 1) for key, values in runs.items()},
        "tokens": tokens,
        "same_lengths": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()) / "mlx-notebook-grammar-gil")
    args = parser.parse_args()
    rng = random.Random(0)
    folder = make_real_model(args.build_dir / args.arch, arch=args.arch, hidden=64, layers=2, heads=4, kv_heads=2)
    eos = [0]
    result = {
        "arch": args.arch,
        "in_process": in_process(folder / "tokenizer.json", eos, args.rounds, rng),
        "child": child(folder, args.rounds, rng),
        "decode": decode(folder, args.repeats),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
