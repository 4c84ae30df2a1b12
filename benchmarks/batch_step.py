"""What one batched decode step costs against one row's, on the weights the load gave.

Usage::

    python -m benchmarks.batch_step --model default --batches 1,4,8
    MLX_NOTEBOOK_CPU_DEQUANTIZE=0 python -m benchmarks.batch_step --model default   # quantized on the CPU

Loads the model the way a generation does (``loading/policy``: on the CPU a
quantized model is dequantized to float32 for OpenBLAS when it fits), fills a
``BatchKVCache`` of ``--context`` tokens per row, then times ``--steps``
decode steps (the model's forward on one token per row, evaluated) at each
batch size, medians of the steps. Prints one JSON line per batch size: the
step time and the aggregate rate over one row's. This is the measurement
``loading/policy.batch_decode`` is decided by.
"""

from __future__ import annotations

import mlx_notebook  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import json
import statistics
import time

import mlx.core as mx


def step_times(model, batch: int, context: int, steps: int) -> list[float]:
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_notebook.generation import batch_cache

    caches = []
    for row in range(batch):
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(16, 1000, (1, context + row), key=mx.random.key(row))
        mx.eval(model(prompt, cache=cache))
        caches.append(cache)
    cache, _ = batch_cache.merge(caches) if batch > 1 else (caches[0], [0])
    tokens = mx.zeros((batch, 1), dtype=mx.uint32)
    out = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        tokens = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None].astype(mx.uint32)
        mx.eval(tokens)
        out.append(time.perf_counter() - t0)
    return out[2:]  # the first steps build kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:

        def run(store):
            loaded = store.get(args.model)
            quantized = any(hasattr(m, "scales") for _, m in loaded.model.named_modules())
            one = None
            for batch in map(int, args.batches.split(",")):
                step = statistics.median(step_times(loaded.model, batch, args.context, args.steps))
                one = one if one is not None else step
                print(
                    json.dumps(
                        {
                            "batch": batch,
                            "step_ms": round(1000 * step, 1),
                            "aggregate_over_one": round(batch * one / step, 2),
                            "quantized": quantized,
                            "blas": mlx_notebook.active_blas(),
                            "device": str(mx.default_device()),
                        }
                    ),
                    flush=True,
                )

        worker.call(run)
    finally:
        worker.shutdown()


if __name__ == "__main__":
    main()
