"""KV memory settings (issue 23): KV bytes, decode speed against mlx-lm, stops with quantized KV.

Usage::

    # NVIDIA H200, random-weight Qwen3-8B shape (bf16, real-size 151,936-token tokenizer), 32k context
    bash benchmarks/device_run.sh python3 -m benchmarks.kv_memory --shape qwen3-8b --build-dir /tmp/build \\
        --context 32768 --decode-tokens 128 --repeats 3 --stop-rounds 20 --budget 0.01 --json $OUT/kv.json
    # CPU smoke run at a tiny scale (same code paths)
    python3 -m benchmarks.kv_memory --shape qwen3-8b --layers 2 --hidden 256 --heads 4 --kv-heads 2 \\
        --head-dim 64 --intermediate 512 --dtype float32 --context 512 --decode-tokens 16 --repeats 1 \\
        --stop-rounds 3 --budget 0.1

For each shape (``--shape``, comma-separated; ``benchmarks.bench.SYNTHETIC``,
sizes overridable for a smoke run), with one ``--context``-token prompt of
random ids, EOS off, greedy:

* **bytes and decode speed**: for the model's own cache (bf16), ``kv_bits=8``
  and ``kv_bits=4`` (``kv_group_size=64``, ``quantized_kv_start=0``), our
  ``mlx_notebook.generate(ids, chat=False, ...)`` and mlx-lm's own
  ``stream_generate(model, tokenizer, ids, max_tokens, kv_bits=..., kv_group_size=64,
  quantized_kv_start=0, prompt_cache=...)`` on the worker's thread, alternated
  (the order flips every repeat), ``--repeats`` times, medians. KV bytes: our
  ``gen.stats.kv_bytes`` and the ``nbytes`` of the cache mlx-lm filled (both at
  ``context + decode_tokens`` tokens, allocation steps included), against the
  exact bytes of that many tokens. Decode tok/s: ``stats.generation_tps`` and
  mlx-lm's ``generation_tps``, and both again from token arrival times.
* **stops with quantized KV**: ``--stop-rounds`` stops in prefill (a random
  moment of the measured prefill time, prompt cache off: every round prefills
  the whole prompt) and in decode (the prompt served from the prefix cache,
  then a random moment of the first ``--decode-window`` seconds of decode),
  budget ``--budget``: ``gen.cancel()`` to ``gen.wait()`` returning (external)
  and the engine's ``stats.stop_latency_s`` (internal), p50/p99, with the
  phase the generation was in when stopped and the longest GIL hold seen.

Writes what is measured so far to ``--json`` after every part (a run cut short
keeps its results) and prints the JSON at the end.

On an H200 with mlx 0.32.4 (``mlx-cuda-13``) and mlx-lm 0.32.2, mlx-lm's own
quantized KV does not run: CUDA's ``quantized_matmul`` refuses keys that are a
slice of the cache's buffer (``[quantized_matmul] No implementation for problem
shape: 1x32769x128x32``). Ours attends over dequantized layers there
(``mlx_notebook.generation.quantized_attention``). ``--probe`` shows which
(keys, chunk) pairs mlx-lm's attention runs; ``--mlx-lm-check`` runs mlx-lm
alone; ``--contiguous-kv`` patches mlx-lm's ``QuantizedKVCache`` to return
contiguous copies in mlx-lm's runs so that they run at all, and
``--mlx-lm-quantized-start`` lets its prefill run at bf16 (its quantized
prefill crawls). Session 13's run (docs/benchmarks.md)::

    bash benchmarks/device_run.sh python3 -m benchmarks.kv_memory --shape qwen3-8b --build-dir /tmp/build \
        --context 32768 --decode-tokens 64 --repeats 3 --stop-rounds 10 --phases decode,prefill \
        --prefill-window 2 --budget 0.01 --contiguous-kv --mlx-lm-quantized-start 32768
"""

from __future__ import annotations

import mlx_notebook  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import contextlib
import gc
import json
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.bench import SYNTHETIC, GilSampler, percentile, prompt_ids, save
from mlx_notebook.generation.kv_settings import cache_nbytes

GROUP = 64
# Goals of issue 23's acceptance.
GOALS = {"kv_ratio_8": 0.55, "kv_ratio_4": 0.30, "decode_ratio": 0.95}


def code_commit() -> str:
    """The commit measured: a ``COMMIT`` file at the root of an exported copy, else ``git rev-parse``."""
    root = Path(__file__).resolve().parent.parent
    if (root / "COMMIT").exists():
        return (root / "COMMIT").read_text().strip() + " (exported copy)"
    try:
        import subprocess

        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
        return head + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def label(bits: int | None) -> str:
    return "bf16" if bits is None else f"{bits}bit"


def kv_options(bits: int | None, start: int = 0) -> dict[str, Any]:
    """The same KV keywords for our API and mlx-lm's ``generate_step``."""
    if bits is None:
        return {}
    return {"kv_bits": bits, "kv_group_size": GROUP, "quantized_kv_start": start}


def exact_kv_bytes(config: dict, tokens: int, bits: int | None, dtype_bytes: int) -> int:
    """Bytes of keys and values of ``tokens`` tokens, no allocation slack (scales and biases in the model's dtype)."""
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"]
    if bits is None:
        return tokens * per_token * dtype_bytes
    return int(tokens * per_token * (bits / 8 + 2 * dtype_bytes / GROUP))


def decode_tps(times: list[float]) -> float | None:
    """Tokens per second after the first, from arrival times."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def ours(worker, name: str, ids: list[int], bits: int | None, args) -> dict[str, Any]:
    """One generation through our worker (a batch of one)."""
    worker.call(lambda store: mx.reset_peak_memory())
    gen = mlx_notebook.generate(
        ids,
        model=name,
        worker=worker,
        max_tokens=args.decode_tokens,
        stop_budget=args.budget,
        chat=False,
        **kv_options(bits),
    )
    times: list[float] = []

    def listen(event) -> None:
        if event.kind == "tokens" and event.text is not None:
            times.append(time.perf_counter())

    gen.add_listener(listen)
    gen.result()
    if gen.state != "done":
        raise RuntimeError(f"our {label(bits)} run ended {gen.state}: {gen.error}")
    s = gen.stats
    peak = worker.call(lambda store: mx.get_peak_memory())
    return {
        "prefill_tps": s.prompt_tps,
        "prefill_s": s.prompt_tokens / s.prompt_tps if s.prompt_tps else None,
        "decode_tps": s.generation_tps,
        "decode_tps_arrivals": decode_tps(times),
        "generated": s.generated_tokens,
        "kv_bytes": s.kv_bytes,
        "kv": s.kv,
        "prefill_chunks": s.prefill_chunks,
        "decode_in_flight": s.decode_in_flight,
        "decode_pieces": s.decode_pieces,
        "peak_memory_gb": peak / 1e9,
        "tokens": list(gen.tokens),
    }


def mlx_lm(worker, name: str, ids: list[int], bits: int | None, args) -> dict[str, Any]:
    """mlx-lm's ``stream_generate`` with the same settings, on the worker's thread and stream."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_notebook.generation import attention_patch, fused_projections

    def job(store):
        loaded = store.get(name)
        cache = make_prompt_cache(loaded.model)
        mx.reset_peak_memory()
        times, tokens, last = [], [], None
        # mlx-lm's own attention and projections, not our routes (they are module-wide).
        with (
            contiguous_quantized_kv(args.contiguous_kv),
            attention_patch.unpatched(loaded.model),
            fused_projections.unfused(loaded.model),
        ):
            for last in stream_generate(
                loaded.model,
                loaded.tokenizer,
                ids,
                max_tokens=args.decode_tokens,
                prompt_cache=cache,
                **kv_options(bits, args.mlx_lm_quantized_start),
            ):
                times.append(time.perf_counter())
                tokens.append(last.token)
        nbytes = cache_nbytes(cache)
        kinds = sorted({type(c).__name__ for c in cache})
        peak = mx.get_peak_memory()
        del cache
        gc.collect()
        mx.clear_cache()
        return {
            "prefill_tps": last.prompt_tps,
            "decode_tps": last.generation_tps,
            "decode_tps_arrivals": decode_tps(times),
            "generated": last.generation_tokens,
            "kv_bytes": nbytes,
            "cache_types": kinds,
            "peak_memory_gb": peak / 1e9,
            "tokens": tokens,
        }

    return worker.call(job)


def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def throughput(worker, name, ids, config, dtype_bytes, args, settings) -> dict[str, Any]:
    runs: dict[str, dict[str, list]] = {label(b): {"ours": [], "mlx_lm": []} for b in settings}
    errors: dict[str, str] = {}
    for r in range(args.repeats):
        for bits in settings:
            for who in ("ours", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "ours"):
                fn = ours if who == "ours" else mlx_lm
                t0 = time.perf_counter()
                try:
                    row = fn(worker, name, ids, bits, args)
                except Exception as exc:  # an MLX error: record it, go on with the others
                    msg = str(exc).splitlines()[0][:300]
                    print(f"  repeat {r} {label(bits):5} {who:6} FAILED: {msg}", flush=True)
                    errors.setdefault(f"{label(bits)}_{who}", msg)
                    continue
                print(
                    f"  repeat {r} {label(bits):5} {who:6} prefill {row['prefill_tps']:9.1f} tok/s "
                    f"decode {row['decode_tps']:7.2f} tok/s kv {row['kv_bytes'] / 1e6:9.1f} MB "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
                runs[label(bits)][who].append(row)
    out: dict[str, Any] = {"errors": errors} if errors else {}
    tokens = len(ids) + args.decode_tokens
    for bits in settings:
        lab = label(bits)
        o, m = runs[lab]["ours"], runs[lab]["mlx_lm"]
        if not o or not m:
            out[lab] = {"ours_runs": len(o), "mlx_lm_runs": len(m)}
            continue
        entry = {
            "exact_kv_bytes": exact_kv_bytes(config, tokens, bits, dtype_bytes),
            "ours_kv_bytes": o[-1]["kv_bytes"],
            "mlx_lm_kv_bytes": m[-1]["kv_bytes"],
            "ours_kv_setting": o[-1]["kv"],
            "mlx_lm_cache_types": m[-1]["cache_types"],
            "ours_decode_tps": med(o, "decode_tps"),
            "mlx_lm_decode_tps": med(m, "decode_tps"),
            "ours_decode_tps_arrivals": med(o, "decode_tps_arrivals"),
            "mlx_lm_decode_tps_arrivals": med(m, "decode_tps_arrivals"),
            "ours_prefill_tps": med(o, "prefill_tps"),
            "mlx_lm_prefill_tps": med(m, "prefill_tps"),
            "ours_prefill_s": med(o, "prefill_s"),
            "ours_peak_memory_gb": med(o, "peak_memory_gb"),
            "mlx_lm_peak_memory_gb": med(m, "peak_memory_gb"),
            "ours_prefill_chunks": med(o, "prefill_chunks"),
            "ours_decode_in_flight": o[-1]["decode_in_flight"],
            "ours_decode_pieces": o[-1]["decode_pieces"],
            "generated": [o[-1]["generated"], m[-1]["generated"]],
            "ours_decode_tps_all": [x["decode_tps"] for x in o],
            "mlx_lm_decode_tps_all": [x["decode_tps"] for x in m],
            "greedy_tokens_agreeing_with_mlx_lm": [agreement(x["tokens"], y["tokens"]) for x, y in zip(o, m)],
            "ours_repeatable": all(x["tokens"] == o[0]["tokens"] for x in o),
        }
        entry["decode_ratio"] = entry["ours_decode_tps"] / entry["mlx_lm_decode_tps"]
        if entry["ours_decode_tps_arrivals"] and entry["mlx_lm_decode_tps_arrivals"]:
            entry["decode_ratio_arrivals"] = entry["ours_decode_tps_arrivals"] / entry["mlx_lm_decode_tps_arrivals"]
        entry["prefill_ratio"] = entry["ours_prefill_tps"] / entry["mlx_lm_prefill_tps"]
        out[lab] = entry
    base = out.get("bf16")
    if base and "ours_kv_bytes" in base:
        for bits in settings:
            if bits is not None and "ours_kv_bytes" in out[label(bits)]:
                e = out[label(bits)]
                e["ours_kv_ratio_to_bf16"] = e["ours_kv_bytes"] / base["ours_kv_bytes"]
                e["mlx_lm_kv_ratio_to_bf16"] = e["mlx_lm_kv_bytes"] / base["mlx_lm_kv_bytes"]
                e["exact_kv_ratio_to_bf16"] = e["exact_kv_bytes"] / base["exact_kv_bytes"]
    return out


def stop_round(worker, name, ids, bits, phase, window_s, rng, sampler, args) -> dict[str, Any]:
    started = time.perf_counter()
    gen = mlx_notebook.generate(
        ids,
        model=name,
        worker=worker,
        max_tokens=100_000 if phase == "decode" else 2,
        stop_budget=args.budget,
        chat=False,
        **kv_options(bits),
    )
    while gen.state in ("queued", "loading"):
        time.sleep(0.0002)
    if phase == "decode":
        while gen.state != "decoding" and not gen.finished:
            time.sleep(0.0005)
    time.sleep(rng.uniform(0, window_s))
    state = str(gen.state)
    t0 = time.perf_counter()
    gen.cancel()
    gen.wait()
    external = time.perf_counter() - t0
    return {
        "external_s": external,
        "internal_s": gen.stats.stop_latency_s,
        "state": state,
        "final": str(gen.state),
        "cached_tokens": gen.stats.cached_tokens,
        "generated": gen.stats.generated_tokens,
        "decode_pieces": gen.stats.decode_pieces,
        "gil_ms": sampler.longest_ms(started, time.perf_counter()),
    }


def stops(worker, name, ids, bits, phase, window_s, sampler, args) -> dict[str, Any]:
    rng = random.Random(1000 * (bits or 0) + (phase == "decode"))
    wanted = "prefilling" if phase == "prefill" else "decoding"
    if phase == "decode":
        # Every round's prompt comes from the prefix cache (an entry with the same KV settings).
        worker.prompt_cache_gb = args.prompt_cache_gb
        warm = mlx_notebook.generate(ids, model=name, worker=worker, max_tokens=2, chat=False, **kv_options(bits))
        warm.result()
    else:
        worker.prompt_cache_gb = 0
    rounds = []
    try:
        for i in range(args.stop_rounds):
            rounds.append(stop_round(worker, name, ids, bits, phase, window_s, rng, sampler, args))
            r = rounds[-1]
            print(
                f"  {label(bits)} {phase} stop {i}: {r['external_s'] * 1e3:6.1f} ms external, "
                f"{(r['internal_s'] or 0) * 1e3:6.1f} ms internal, in {r['state']} "
                f"(cached {r['cached_tokens']}, generated {r['generated']}, GIL {r['gil_ms']:.1f} ms)",
                flush=True,
            )
    finally:
        worker.prompt_cache_gb = 0
    ext = [r["external_s"] for r in rounds]
    internal = [r["internal_s"] for r in rounds if r["internal_s"] is not None]
    states: dict[str, int] = {}
    for r in rounds:
        states[r["state"]] = states.get(r["state"], 0) + 1
    in_phase = [r["external_s"] for r in rounds if r["state"] == wanted]
    return {
        "rounds": len(rounds),
        "window_s": window_s,
        "external_ms": {k: 1e3 * percentile(ext, q) for k, q in (("p50", 50), ("p99", 99))} | {"max": 1e3 * max(ext)},
        "internal_ms": {k: 1e3 * percentile(internal, q) for k, q in (("p50", 50), ("p99", 99))}
        | {"max": 1e3 * max(internal, default=0)},
        "external_in_phase_ms": {
            "n": len(in_phase),
            "p50": 1e3 * percentile(in_phase, 50) if in_phase else None,
            "p99": 1e3 * percentile(in_phase, 99) if in_phase else None,
        },
        "state_at_stop": states,
        "final_states": sorted({r["final"] for r in rounds}),
        "cached_tokens_min": min(r["cached_tokens"] for r in rounds),
        "gil_hold_ms_max": max(r["gil_ms"] for r in rounds),
        "gil_hold_ms_p50": percentile([r["gil_ms"] for r in rounds], 50),
        "budget_ms": 1e3 * args.budget,
        "p99_within_budget": percentile(ext, 99) <= args.budget,
        "all_ms": [round(1e3 * x, 2) for x in ext],
    }


def attention_probe(head_dim: int, kv_heads: int, heads: int, dtype, bits_list, lengths, chunks) -> list[dict]:
    """mlx-lm's quantized attention on a real ``QuantizedKVCache`` at given lengths and chunk sizes.

    The cache holds ``n - m`` tokens, a chunk of ``m`` more comes in (so the
    keys span ``n``), and ``quantized_scaled_dot_product_attention`` runs on
    what ``update_and_fetch`` returns, as in a model's attention. Records which
    (n, m) the backend runs and which it refuses.
    """
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    out = []
    for bits in bits_list:
        for n in lengths:
            for m in chunks:
                cache = QuantizedKVCache(group_size=GROUP, bits=bits)
                old = mx.random.normal((1, kv_heads, n - m, head_dim)).astype(dtype)
                cache.update_and_fetch(old, old)
                new = mx.random.normal((1, kv_heads, m, head_dim)).astype(dtype)
                q = mx.random.normal((1, heads, m, head_dim)).astype(dtype)
                row: dict[str, Any] = {"bits": bits, "keys": n, "chunk": m}
                try:
                    keys, values = cache.update_and_fetch(new, new)
                    row["keys_row_contiguous"] = (
                        bool(keys[0].flags.row_contiguous) if hasattr(keys[0], "flags") else None
                    )
                    mx.eval(
                        quantized_scaled_dot_product_attention(
                            q,
                            keys,
                            values,
                            scale=head_dim**-0.5,
                            mask="causal" if m > 1 else None,
                            group_size=GROUP,
                            bits=bits,
                        )
                    )
                    row["ok"] = True
                except Exception as exc:  # the backend refuses the shape
                    row["ok"] = False
                    row["error"] = str(exc).splitlines()[0][:200]
                out.append(row)
                print(f"  probe {bits}-bit keys {n} chunk {m}: {'ok' if row['ok'] else row['error']}", flush=True)
                del cache, old, new, q
                mx.clear_cache()
    return out


def mlx_lm_once(worker, name: str, ids: list[int], bits: int) -> dict[str, Any]:
    """mlx-lm's ``stream_generate`` with quantized KV for two tokens: does it run at this length?"""
    from mlx_lm import stream_generate

    def job(store):
        loaded = store.get(name)
        try:
            for _ in stream_generate(loaded.model, loaded.tokenizer, ids, max_tokens=2, **kv_options(bits)):
                pass
            return {"context": len(ids), "bits": bits, "ok": True}
        except Exception as exc:
            return {"context": len(ids), "bits": bits, "ok": False, "error": str(exc).splitlines()[0][:300]}
        finally:
            gc.collect()
            mx.clear_cache()

    return worker.call(job)


@contextlib.contextmanager
def contiguous_quantized_kv(on: bool = True) -> Iterator[None]:
    """While inside, make mlx-lm's ``QuantizedKVCache`` hand out row-contiguous arrays (a copy per call).

    mlx 0.32.4's CUDA ``quantized_matmul`` refuses keys that are a slice of a
    larger buffer (``[quantized_matmul] No implementation for problem shape``):
    the cache returns ``keys[..., :offset, :]`` of a buffer grown in steps of
    256, which is row-contiguous only when full, so decode fails at its first
    step, in mlx-lm's ``stream_generate`` as in ours (the attention probe and
    ``mlx_lm_check`` in the result show it). With this patch (``--contiguous-kv``)
    both run, at the cost of one copy of the quantized cache per layer per call,
    the same for both. It is the benchmark's, not the product's. Ours reads
    the slices in place on CUDA (``quantized_attention``), so only mlx-lm's
    runs are patched.
    """
    from mlx_lm.models.cache import QuantizedKVCache

    original = QuantizedKVCache.update_and_fetch

    def update_and_fetch(self, keys, values):
        k, v = original(self, keys, values)
        return tuple(mx.contiguous(x) for x in k), tuple(mx.contiguous(x) for x in v)

    if on:
        QuantizedKVCache.update_and_fetch = update_and_fetch
    try:
        yield
    finally:
        QuantizedKVCache.update_and_fetch = original


def cache_bytes_at_size(config: dict, dtype, context: int, decode_tokens: int, bits_list) -> dict[str, Any]:
    """KV bytes of one layer filled the way a generation fills it, times the layers, without a model.

    mlx-lm's own cache classes (what ours keeps too, measured by our
    ``cache_nbytes``): ``context - 1`` prompt tokens in 2048-token chunks,
    then one token per step, converted with ``maybe_quantize_kv_cache``
    (``quantized_kv_start=0``) after each call as mlx-lm does. Every layer of
    a model holds the same, so one layer is filled (cheap on a CPU).
    """
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import KVCache

    shape = (1, config["num_key_value_heads"], 0, config["head_dim"])
    out: dict[str, Any] = {"tokens": context + decode_tokens - 1, "layers": config["num_hidden_layers"]}
    for bits in [None, *bits_list]:
        cache = [KVCache()]
        sizes = [2048] * ((context - 1) // 2048) + ([(context - 1) % 2048] if (context - 1) % 2048 else [])
        sizes += [1] * decode_tokens
        for n in sizes:
            kv = mx.zeros((*shape[:2], n, shape[3]), dtype=dtype)
            cache[0].update_and_fetch(kv, kv)
            maybe_quantize_kv_cache(cache, 0, GROUP, bits)
            mx.eval(cache[0].state)
        out[label(bits)] = cache_nbytes(cache) * config["num_hidden_layers"]
    for bits in bits_list:
        out[f"{label(bits)}_ratio_to_bf16"] = out[label(bits)] / out["bf16"]
    return out


def spec_for(shape: str, args) -> dict[str, Any]:
    spec = dict(SYNTHETIC[shape])
    for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "dtype"):
        value = getattr(args, key)
        if value is not None:
            spec[key] = value
    return spec


def run_shape(shape: str, args, result: dict[str, Any], sampler: GilSampler) -> None:
    from testkit.real_tokenizer import make_real_model

    spec = spec_for(shape, args)
    folder = Path(args.build_dir) / shape
    t0 = time.perf_counter()
    name = str(make_real_model(folder, **spec))
    build_s = time.perf_counter() - t0
    print(f"built {shape} {spec} in {build_s:.1f} s", flush=True)
    config = json.loads((folder / "config.json").read_text())
    dtype_bytes = getattr(mx, config["torch_dtype"]).size
    part: dict[str, Any] = {"spec": spec, "vocab": config["vocab_size"], "build_s": build_s}
    result["shapes"][shape] = part

    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        t0 = time.perf_counter()
        worker.load_model(name)
        part["load_s"] = time.perf_counter() - t0

        def no_eos(store):
            store.get(name).tokenizer.eos_token_ids = []

        worker.call(no_eos)
        ids = prompt_ids(args.context, config["vocab_size"])
        for length in args.mlx_lm_check:
            check = mlx_lm_once(worker, name, prompt_ids(length, config["vocab_size"]), args.bits[0])
            print(f"{shape}: mlx-lm stream_generate at {length} tokens, {args.bits[0]}-bit KV: {check}", flush=True)
            part.setdefault("mlx_lm_check", []).append(check)
            save(result, args.json)
        settings: list[int | None] = [None, *args.bits]
        if not args.skip_throughput:
            print(f"{shape}: throughput and bytes, context {len(ids)}", flush=True)
            part["throughput"] = throughput(worker, name, ids, config, dtype_bytes, args, settings)
            save(result, args.json)
        part["stops"] = {}
        for phase in args.phases:
            for bits in args.bits:
                measured = part.get("throughput", {})
                if phase == "prefill":
                    window = args.prefill_window or measured.get(label(bits), {}).get("ours_prefill_s")
                    window = window or measured.get("bf16", {}).get("ours_prefill_s")
                else:
                    window = args.decode_window
                if window is None:
                    window = args.decode_window  # no measured prefill (the runs failed)
                print(f"{shape}: {label(bits)} stops in {phase} (window {window:.2f} s)", flush=True)
                try:
                    part["stops"][f"{label(bits)}_{phase}"] = stops(
                        worker, name, ids, bits, phase, window, sampler, args
                    )
                except Exception as exc:
                    msg = str(exc).splitlines()[0][:300]
                    print(f"  FAILED: {msg}", flush=True)
                    part["stops"][f"{label(bits)}_{phase}"] = {"error": msg}
                save(result, args.json)
    finally:
        worker.shutdown()
        del worker
        gc.collect()
        mx.clear_cache()
        if args.remove_builds:
            shutil.rmtree(folder, ignore_errors=True)


def table(result: dict[str, Any]) -> str:
    lines = []
    for shape, part in result["shapes"].items():
        tp = part.get("throughput", {})
        for lab, e in tp.items():
            if "ours_decode_tps" not in e:
                continue
            if "ours_kv_ratio_to_bf16" in e:
                goal = GOALS["kv_ratio_8"] if lab == "8bit" else GOALS["kv_ratio_4"]
                lines.append(
                    f"{shape} KV bytes {lab}/bf16: ours {e['ours_kv_ratio_to_bf16']:.3f} "
                    f"mlx-lm {e['mlx_lm_kv_ratio_to_bf16']:.3f} (goal <= {goal})"
                )
            lines.append(
                f"{shape} decode {lab}: ours {e['ours_decode_tps']:.1f} mlx-lm {e['mlx_lm_decode_tps']:.1f} "
                f"ratio {e['decode_ratio']:.3f} (goal >= {GOALS['decode_ratio']})"
            )
        for key, s in part.get("stops", {}).items():
            lines.append(
                f"{shape} stop {key}: external p50 {s['external_ms']['p50']:.1f} p99 {s['external_ms']['p99']:.1f} ms, "
                f"internal p50 {s['internal_ms']['p50']:.1f} p99 {s['internal_ms']['p99']:.1f} ms "
                f"(budget {s['budget_ms']:.0f} ms; states {s['state_at_stop']})"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", help="comma-separated names of benchmarks.bench.SYNTHETIC")
    for key in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate"):
        ap.add_argument(f"--{key}", type=int, help=f"override the shape's {key} (smoke runs)")
    ap.add_argument("--dtype", help="override the shape's dtype (float32 for a CPU smoke run)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--stop-rounds", type=int, default=20)
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--decode-window", type=float, default=0.5, help="seconds of decode the stops fall in")
    ap.add_argument("--prompt-cache-gb", type=float, default=24.0, help="prefix cache bound for the decode stops")
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--build-dir", help="where models are built (reused when present); default: a temp folder")
    ap.add_argument("--remove-builds", action="store_true", help="delete each built model after its part")
    ap.add_argument(
        "--probe",
        default="",
        help="keys lengths for the quantized-attention probe (comma-separated; chunks 1, 2047, 2048), before the models",
    )
    ap.add_argument(
        "--mlx-lm-check",
        default="",
        help="prompt lengths at which mlx-lm's stream_generate runs once with the first --bits (does it run?)",
    )
    ap.add_argument(
        "--contiguous-kv",
        action="store_true",
        help="copy mlx-lm's quantized cache to row-contiguous arrays at every call, in mlx-lm's runs "
        "(mlx 0.32.4's CUDA quantized_matmul refuses the cache's slices: see contiguous_quantized_kv)",
    )
    ap.add_argument(
        "--mlx-lm-quantized-start",
        type=int,
        default=0,
        help="mlx-lm's quantized_kv_start (ours: 0); the context length quantizes its cache after the prompt, "
        "for a prefill at bf16 speed where its quantized prefill crawls (71 tok/s on CUDA)",
    )
    ap.add_argument(
        "--dequantize-decode",
        action="store_true",
        help="ours: decode steps attend over each layer dequantized (session 13's route), "
        "not through the fused quantized-decode kernel",
    )
    ap.add_argument(
        "--skip-throughput", action="store_true", help="only the stops (--prefill-window sets their window)"
    )
    ap.add_argument(
        "--prefill-window", type=float, help="seconds of prefill the prefill stops fall in (default: measured)"
    )
    ap.add_argument(
        "--bytes-only",
        action="store_true",
        help="only the KV bytes at --context of each shape's geometry, from mlx-lm's cache classes (no model, CPU)",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    args.bits = [int(b) for b in args.bits.split(",") if b]
    args.phases = [p for p in args.phases.split(",") if p]
    args.mlx_lm_check = [int(x) for x in args.mlx_lm_check.split(",") if x]
    if args.build_dir is None:
        import tempfile

        args.build_dir = tempfile.mkdtemp(prefix="kv_memory_")

    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "commit": code_commit(),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "device_name": mx.device_info().get("device_name", ""),
        "budget_s": args.budget,
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "kv_group_size": GROUP,
        "quantized_kv_start": 0,
        "goals": GOALS | {"stop_p99_s": args.budget},
        "shapes": {},
    }
    result["contiguous_kv_workaround"] = args.contiguous_kv
    result["fused_quantized_decode"] = not args.dequantize_decode
    if args.dequantize_decode:
        from mlx_notebook.generation import quantized_attention

        quantized_attention.fused_decode = False
    result["mlx_lm_quantized_kv_start"] = args.mlx_lm_quantized_start
    if args.probe:
        lengths = [int(x) for x in args.probe.split(",")]
        spec = spec_for(args.shape.split(",")[0], args)
        result["attention_probe"] = attention_probe(
            spec.get("head_dim") or spec["hidden"] // spec["heads"],
            spec["kv_heads"],
            spec["heads"],
            getattr(mx, spec["dtype"]),
            args.bits,
            lengths,
            [1, 2047, 2048],
        )
        save(result, args.json)
    if args.bytes_only:
        for shape in args.shape.split(","):
            spec = spec_for(shape, args)
            config = {
                "num_key_value_heads": spec["kv_heads"],
                "head_dim": spec.get("head_dim") or spec["hidden"] // spec["heads"],
                "num_hidden_layers": spec["layers"],
            }
            result["shapes"][shape] = {
                "spec": spec,
                "kv_bytes_at_size": cache_bytes_at_size(
                    config, getattr(mx, spec["dtype"]), args.context, args.decode_tokens, args.bits
                ),
            }
        save(result, args.json)
        print(json.dumps(result, indent=2))
        return
    sampler = GilSampler()
    try:
        for shape in args.shape.split(","):
            run_shape(shape, args, result, sampler)
    finally:
        sampler.close()
        save(result, args.json)
    print(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
