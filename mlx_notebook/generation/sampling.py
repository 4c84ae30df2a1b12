"""Sampling with the generation's own PRNG key.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

from .request import GenerationRequest

Sampler = Callable[[mx.array], mx.array]


def make_sampler(request: GenerationRequest) -> Sampler:
    """Return ``sample(logprobs) -> token`` with its own PRNG key.

    The key is the generation's own (split once per token) rather than MLX's
    global random state, so other code using ``mx.random`` while a generation
    is paused cannot change what it samples after resume.
    """
    if request.temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    from mlx_lm.sample_utils import apply_top_p

    seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little")
    state = {"key": mx.random.key(seed)}
    inv_temp = 1.0 / request.temperature
    top_p = request.top_p

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample
