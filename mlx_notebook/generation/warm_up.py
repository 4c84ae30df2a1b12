"""A loaded model's first uses, run on the worker's thread while it has nothing to do (CUDA): its first forward, then its prefill ladder.

On MLX's CUDA backend a process's first forward starts cuBLAS and cuDNN,
makes their handles and loads kernels: one 8B-shaped layer of 8 tokens took
240-310 ms in a fresh process on an H200, against ~1 ms after it
(``benchmarks/results/h200_first_use_threads_session17.*``). Inside a
prefill that cost sits in one piece of work, and a stop waits for it: the
first prompt of a fresh process was stopped within budget + 50 ms in only
3-4 of 8 rounds. MLX keeps those handles and its attention graphs per thread
(``thread_local``): a helper thread's warm-up left 70 ms of it to the worker,
so the worker's own thread runs this, between jobs, and only while nothing
is queued. It also runs one fused attention: small prefill chunks go
unfused (:mod:`.small_attention`), which would leave cuDNN's start to the
first long prompt, and each kind of split decode call a batch makes once a prompt joins
rows of another length (:func:`.row_attention.warm`: ~9 ms of first use on an H100, which
the first join of a process paid in the others' gap), and the cache edits of a row's leave
(:func:`.batch_cache.warm`: a machine's first leave of an 8k prompt held the others 2.1 s).
A generation submitted meanwhile waits for it (its first token
no later than it would have been, since it would pay the same) and is
stopped at once while it waits (a queued generation's stop is immediate).
Next, at an idle moment of its own, each layer's q/k/v and gate/up
projections are fused into one product each (:mod:`.fused_projections`: an
8B step there is bound by host time per kernel call), and where asked for
(``MLX_NOTEBOOK_SKINNY_MATMUL=1``) the 2-8 row products' kernel
(:mod:`.skinny_matmul`) is compiled and the linear layers take it: NVRTC,
2.1-2.3 s in every process on an H200 (MLX keeps no disk cache of
``cuda_kernel`` modules), a wait no stop could cut inside a job. A job
queued during it waits for it.

Then, still only while idle, the *ladder*: every big prefill chunk a prompt
of up to :data:`LADDER_CONTEXT` tokens can be cut into (sizes
:data:`LADDER_SIZES`, each at every start aligned to it: the planner's
shapes there) runs once through the first layer. cuDNN builds an attention
graph per pair of chunk and context length, ~40 ms each on an H200, inside
the piece that meets it: a fresh process's first 32k prompt, stopped at a
random moment, waited up to 268 ms (p99, budget 0.01) where a process that
had prefilled such a prompt once waited 15.5 ms
(``benchmarks/results/h200_prewarm_probe_session22.*``). One layer builds
the graph every layer then uses, over a cache of zeros: no model's worth of
work, a layer's cache of memory. The ladder is given up at the first chunk
a job is queued before (that job waits for one chunk, tens of ms) and taken
up at the next idle moment where it was left.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..loading.store import LoadedModel
from . import batch_cache, fused_projections, persist, row_attention, skinny_matmul, small_attention
from .chunks import FIRST_PREFILL_CHUNK, builds_kernels_per_shape
from .pieces import BuildStopped, MarkedLayers, layer_owner

# The big chunks the planner cuts (powers of two, each ending on a multiple of
# itself): 1024 at budget 0.01 and 2048 at the default 0.1 on an H200 with an
# 8B model, 512 on a device half as fast. Smaller chunks run unfused near
# their start (small_attention) and build nothing.
LADDER_SIZES = (512, 1024, 2048)
# Context the ladder reaches: a 32k prompt's chunks (the model's own limit where lower).
LADDER_CONTEXT = 32768

log = logging.getLogger(__name__)


def wanted() -> bool:
    """Whether a first use costs enough to pay ahead: where kernels are built per shape (the CUDA backend)."""
    return builds_kernels_per_shape()


def warm(loaded: LoadedModel) -> None:
    """Run ``loaded``'s model once over a first chunk's worth of tokens and one decode step, on a scratch cache.

    The attention routes a prefill takes are installed first, so what is
    paid here is what the first prompt would pay. A model whose forward
    fails here is left to fail (or not) in a real generation, with its own
    error: the warm-up only logs it.
    """
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded.model
    if small_attention.wanted():
        small_attention.install(model)
    try:
        cache = make_prompt_cache(model)
        ids = scratch_ids(loaded, 0, FIRST_PREFILL_CHUNK)
        mx.eval(model(ids, cache=cache))
        mx.eval(model(ids[:, -1:], cache=cache))
        # The first fused attention of a process starts cuDNN (60-90 ms; 680 ms
        # on a machine's first process, which compiles its kernels): small
        # chunks go unfused (see small_attention), so without this it landed
        # in the first long prompt's first big chunk, and a join stalled the
        # others' tokens for 780 ms.
        one = mx.ones((1, 1, FIRST_PREFILL_CHUNK, 128), dtype=mx.bfloat16)
        mx.eval(mx.fast.scaled_dot_product_attention(one, one, one, scale=1.0, mask="causal"))
        if cache and isinstance(getattr(cache[0], "keys", None), mx.array):
            _, kv_heads, _, dim = cache[0].keys.shape
            dtype = cache[0].keys.dtype
            if row_attention.wanted():
                # A batch's split step (a prompt joining rows) pays its kernels' first use here, not in the others' gap.
                heads = int(loaded.config.get("num_attention_heads") or kv_heads)
                row_attention.warm(heads, kv_heads, dim, dtype)
            # So does a row's leave (the others' caches kept).
            batch_cache.warm(kv_heads, dim, dtype)
        mx.synchronize()
    except Exception:  # the generation that meets it reports it
        log.debug("warm-up of %s failed", loaded.source.key, exc_info=True)


def install_kernels(loaded: LoadedModel) -> None:
    """Compile the project's own kernels for ``loaded`` and route its layers to them (the 2-8 row products).

    Where wanted, the sibling projections are fused first (:mod:`.fused_projections`), so the
    fused layers take the kernel too.

    Its own idle moment, after :func:`warm`: a job queued during the first
    forward does not wait for this compile too. Without it, batches use
    MLX's products.
    """
    if fused_projections.wanted():
        # The fingerprint a saved generation carries is of the weights as loaded: pinned before the fusion renames them.
        persist.fingerprint(loaded)
        try:
            fused_projections.fuse(loaded.model, loaded.config.get("model_type"))
        except Exception:  # a group is swapped only once joined: the model stays whole, some groups separate
            log.warning("mlx-notebook: fusing the projections failed; they stay separate", exc_info=True)
    if skinny_matmul.wanted():
        try:
            skinny_matmul.install(loaded.model)
        except Exception:  # MLX's products stay; a broken kernel must not cost the model
            log.warning("mlx-notebook: the 2-8 row kernel did not compile; batches use MLX's matmul", exc_info=True)


def ladder(loaded: LoadedModel) -> list[tuple[int, int]]:
    """The ``(start, size)`` chunks the ladder has still to run for ``loaded``, lowest start first."""
    limit = min(LADDER_CONTEXT, int(loaded.config.get("max_position_embeddings") or LADDER_CONTEXT))
    pairs = {(start, size) for size in LADDER_SIZES for start in range(0, limit - size + 1, size)}
    return sorted(pairs - loaded.prefill_shapes_seen)


def warm_ladder(loaded: LoadedModel, keep_going: Callable[[], bool]) -> bool:
    """Run the ladder's chunks through ``loaded``'s first layer while ``keep_going()``; whether it is all done.

    Each chunk runs on a cache of zeros as long as its start, laid out as a
    prefill leaves it (a buffer exactly that long: chunks of 256 tokens or
    more end on mlx-lm's allocation step), so its attention has the shapes
    and strides a prompt's will. A model whose layers this cannot reach (no
    layer list, a cache other than mlx-lm's plain ``KVCache``) has no ladder.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    model = loaded.model
    cache = make_prompt_cache(model)
    owner = layer_owner(model, len(cache))
    if owner is None or type(cache[0]) is not KVCache:
        return True
    start_s, ran = time.perf_counter(), 0
    try:
        # The first layer's cache layout, read off a chunk small enough to run unfused (no graph).
        _first_layer(model, owner, cache, scratch_ids(loaded, 0, FIRST_PREFILL_CHUNK))
        keys, values = cache[0].keys, cache[0].values
        assert keys is not None and values is not None  # filled by that chunk
        for start, size in ladder(loaded):
            if not keep_going():
                return False
            cache = make_prompt_cache(model)
            if start:
                first = cache[0]
                first.keys = mx.zeros((*keys.shape[:2], start, keys.shape[3]), keys.dtype)
                first.values = mx.zeros((*values.shape[:2], start, values.shape[3]), values.dtype)
                first.offset = start
            _first_layer(model, owner, cache, scratch_ids(loaded, start, size))
            loaded.prefill_shapes_seen.add((start, size))
            ran += 1
        log.debug("prefill ladder of %s: %d chunks in %.2f s", loaded.source.key, ran, time.perf_counter() - start_s)
        return True
    except Exception:  # a real prefill meets the same error and reports it
        log.debug("prefill ladder of %s failed", loaded.source.key, exc_info=True)
        return True
    finally:
        mx.clear_cache()


def scratch_ids(loaded: LoadedModel, start: int, size: int) -> mx.array:
    """``size`` token ids for a scratch forward (shape ``(1, size)``): varied, and all inside the model's vocabulary.

    An id past the embedding's rows is not an error in MLX: its gather reads
    past the weights' buffer, garbage on a device and, on the CPU, now and
    then a segfault (CI's of 12-06: the ladder fed ids up to 1000 to a test
    model of 376 tokens). Where the config names no vocabulary, every id is 1.
    """
    vocab = loaded.config.get("vocab_size")
    span = min(1000, vocab - 1) if isinstance(vocab, int) and vocab > 1 else 1
    return (mx.arange(start, start + size, dtype=mx.uint32) % span + 1)[None]


def _first_layer(model: Any, owner: Any, cache: list[Any], ids: mx.array) -> None:
    """Run the tokens ``ids`` through the first layer only (the rest is never built)."""
    with MarkedLayers(owner, per=1, stopped=lambda: True) as marks:
        try:
            model(ids, cache=cache)
        except BuildStopped:
            pass
    mx.eval(marks.marks[0] if marks.marks else cache[0].state)


__all__ = ["LADDER_CONTEXT", "LADDER_SIZES", "ladder", "scratch_ids", "wanted", "warm", "warm_ladder"]
