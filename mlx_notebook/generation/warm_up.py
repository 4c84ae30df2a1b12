"""A loaded model's first forward, run on the worker's thread while it has nothing to do (CUDA).

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
first long prompt. A generation submitted meanwhile waits for it (its first token
no later than it would have been, since it would pay the same) and is
stopped at once while it waits (a queued generation's stop is immediate).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ..loading.store import LoadedModel
from . import small_attention
from .chunks import FIRST_PREFILL_CHUNK, builds_kernels_per_shape

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
        ids = mx.arange(1, FIRST_PREFILL_CHUNK + 1, dtype=mx.uint32)[None]
        mx.eval(model(ids, cache=cache))
        mx.eval(model(ids[:, -1:], cache=cache))
        # The first fused attention of a process starts cuDNN (60-90 ms; 680 ms
        # on a machine's first process, which compiles its kernels): small
        # chunks go unfused (see small_attention), so without this it landed
        # in the first long prompt's first big chunk, and a join stalled the
        # others' tokens for 780 ms.
        one = mx.ones((1, 1, FIRST_PREFILL_CHUNK, 128), dtype=mx.bfloat16)
        mx.eval(mx.fast.scaled_dot_product_attention(one, one, one, scale=1.0, mask="causal"))
        mx.synchronize()
    except Exception:  # the generation that meets it reports it
        log.debug("warm-up of %s failed", loaded.source.key, exc_info=True)


__all__ = ["wanted", "warm"]
