"""The prefill loop: a prompt fed through the model in pieces that each fit the stop budget.

Every prefill runs here: a generation alone, one that joins a decoding batch
(:mod:`.session`, whose pace runs the other rows' steps at the checkpoints, or,
where kernels are built per shape, on the prefill thread beside those steps:
:mod:`.prefill_thread`)
and one on the ranks of a cluster (:mod:`mlx_notebook.cluster.steps`, whose
pace agrees every decision across ranks). The loop asks its pace to *agree*
each chunk size (:meth:`~mlx_notebook.control.Pace.agree`): one process takes
its planner's proposal; ranks take rank 0's, so every rank runs the same
shapes and stops at the same boundary.

The engine never synchronizes on a stop itself: it raises
:class:`~mlx_notebook.control.Cancelled` out of a checkpoint and the worker,
which owns the stream, synchronizes before it reports the generation stopped.
A pause synchronizes in place (the pace's ``on_pause``) and blocks inside the
checkpoint, so the KV cache survives it and resume continues exactly.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import mlx.core as mx

from ..budget import PREFILL_SHARE
from ..control import Pace
from ..loading.store import LoadedModel
from . import batch_cache
from .chunks import ChunkPlanner, builds_kernels_per_shape, padded_to_seen
from .kv_settings import KVSettings
from .pieces import LayerRunner, prefill_runner
from .states import State
from .stats import GenerationStats

# mlx-lm's prefill_step_size: the chunks a quantized or rotating cache is fed in.
ROTATING_PREFILL_CHUNK = 2048

# Whether a prefill on the prefill thread returns MLX's buffer cache after every chunk, as mlx-lm's prefill
# (and this loop elsewhere) does. Not there: that thread runs beside the others' decode steps, and the cache is
# the process's, so each clear takes the buffers their next step would reuse (it allocates them again), and
# on CUDA (mlx 0.32.1's source, read in session 37) the call holds the GIL and the allocator's lock throughout,
# while cudaFree of a cached unified-memory buffer (a token read back lands in one) waits for the whole
# device: the worker can neither build nor queue a step meanwhile. MLX's allocator still hands cached
# memory back when an allocation would pass its limit, and the worker clears it once idle. The join A/B
# (benchmarks/results/join_clear_cache_probe_session36.py.txt, ARM=clear) sets this to measure the old way.
CLEAR_CACHE_ON_SIDE = False


class Sink(Protocol):
    """Where the engine reports what happens (the worker's reporter for one generation, or a rank's)."""

    stats: GenerationStats

    def set_state(self, state: State) -> None: ...

    def progress(self, phase: str, done: int, total: int) -> None: ...

    def emit(self, token_ids: list[int], text: str) -> None: ...


def prefill(
    loaded: LoadedModel,
    cache: list[Any],
    prompt: list[int],
    *,
    pace: Pace,
    sink: Sink,
    start: int = 0,
    kv: KVSettings | None = None,
    last: bool = False,
    side: bool = False,
    turns: bool = False,
) -> mx.array | None:
    """Feed all but the last prompt token through the model in adaptive chunks.

    ``start`` prompt tokens are in ``cache`` already (a prompt-cache hit).
    With ``kv`` quantized settings the cache is quantized before each chunk
    once it is due (:meth:`~.kv_settings.KVSettings.quantize`).

    A :class:`~.chunks.ChunkPlanner` proposes each chunk from the measured cost
    of the recent ones so that one piece of work takes about ``PREFILL_SHARE *
    pace.budget_s``; it starts from the model's last measurement, or small.
    There is a checkpoint before the first chunk, between every two (the one
    that agrees the next size) and after the last.

    With ``last``, a prompt whose tokens all came from the cache but the last
    (``start == len(prompt) - 1``: a cell run again, a resumed generation)
    has that token fed here too, in groups of layers sized from the model's
    last solo decode step, and its logits are returned. That forward over the
    whole cached context is the generation's first, and with nothing before
    it a stop would otherwise wait for all of it (measured on an H200, Qwen3-8B
    shape, 8k cached: stop p99 14.8 ms against a 10 ms budget). Otherwise, and
    where layers cannot be grouped, ``None``: the first decode step feeds it.

    ``side``: this runs on the prefill thread (:mod:`.prefill_thread`), whose
    built shapes are its own. ``turns``: there, its pieces take the device in
    turns with the others' steps (:mod:`.device_turns`).
    """
    total = len(prompt)
    to_process = total - 1
    ids = mx.array(prompt, dtype=mx.uint32)
    runner = prefill_runner(loaded, cache, pace)
    if side and not turns:
        # Beside the others' steps the device interleaves the two streams kernel by kernel: a chunk of
        # many layer groups (chunk_budget_factor) made the others' kernels wait behind long ones (H200,
        # Qwen3-8B shape: their longest gap 53-70 ms, budget + 2 steps 36-45). Chunks that fit the budget
        # whole keep the kernels short; layer groups still bound this prompt's own stop. In turns with their
        # steps no kernel of theirs waits behind the prompt's, and its chunks are cut in layer groups as on the
        # worker: a piece is a group, and a CPU piece's fixed cost (the weights read) is shared by more tokens.
        runner.chunk_budget_factor = 1.0
    sink.stats.prefill_pieces = runner.pieces
    seen = loaded.side_shapes_seen if side else loaded.prefill_shapes_seen
    shapes = seen if builds_kernels_per_shape() else None
    planner = ChunkPlanner(shapes_seen=shapes, history=loaded.prefill_history)
    # A last chunk may be fed padded to a shape built before (padded_to_seen); the pad is cut off the cache after
    # it, which needs plain KVCache layers.
    trimmable = batch_cache.batchable(cache)
    done = start
    sink.progress("prefill", done, total)

    def agreed_chunk() -> int:
        if kv is not None and not kv.plain:
            # What a rotating cache keeps depends on the chunks it is fed in
            # (each chunk's tokens see the window before it, then it wraps),
            # and a quantized one is converted between chunks: fixed chunks,
            # mlx-lm's, make the tokens repeatable (a timed plan differs run to
            # run). Layer groups still bound the stop.
            return pace.agree(min(ROTATING_PREFILL_CHUNK, to_process - done))
        target = pace.budget_s * PREFILL_SHARE * runner.chunk_budget_factor
        n = planner.next_chunk(target, done, to_process - done)
        return pace.agree(padded_to_seen(n, done, to_process - done, shapes if trimmable else None))

    if done < to_process:
        n = agreed_chunk()
        while True:
            if kv is not None:
                kv.quantize(cache)
            real = min(n, to_process - done)
            chunk = ids[None, done : done + real]
            if n > real:  # copies of the chunk's last token, which only the tokens after them would see
                chunk = mx.concatenate([chunk, mx.repeat(chunk[:, -1:], n - real, axis=1)], axis=1)
            t0 = time.perf_counter()
            runner.run(chunk)
            planner.observe(n, time.perf_counter() - t0 - runner.outside_s, start=done)
            if n > real:
                for c in cache:
                    c.trim(n - real)
            sink.stats.prefill_pieces = runner.pieces
            done += real
            sink.stats.prefill_chunks += 1
            sink.progress("prefill", done, total)
            if not side or CLEAR_CACHE_ON_SIDE:
                mx.clear_cache()
            if done >= to_process:
                break
            n = agreed_chunk()
    pace.checkpoint()
    if planner.cost is not None:
        loaded.prefill_history = planner.history
    if not (last and 0 < start == to_process and isinstance(runner, LayerRunner) and (kv is None or kv.plain)):
        return None
    if loaded.step_s is not None:
        runner.seed(loaded.step_s / runner.n_layers)
    logits = runner.logits(ids[None, to_process:])
    pace.checkpoint()
    return logits
