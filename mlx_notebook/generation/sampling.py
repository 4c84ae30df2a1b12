"""Sampling with the generation's own PRNG key.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .request import GenerationRequest


class Sampler:
    """``sample(logprobs) -> token`` with the generation's own PRNG key.

    The key is the generation's own (split once per token) rather than MLX's
    global random state, so other code using ``mx.random`` while a generation
    is paused cannot change what it samples after resume, and rows of a
    decode batch sample exactly as they would alone.
    """

    def __init__(self, request: GenerationRequest) -> None:
        self.greedy = request.temperature == 0
        self.inv_temp = 0.0 if self.greedy else 1.0 / request.temperature
        self.top_p = request.top_p
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed)
        self._before = self.key

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        from mlx_lm.sample_utils import apply_top_p

        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        self._before = self.key
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * self.inv_temp, key=sub)

    def undo(self) -> None:
        """Forget the last call's key split (its token was discarded unread)."""
        self.key = self._before


def make_sampler(request: GenerationRequest) -> Sampler:
    """The sampler of ``request`` (see :class:`Sampler`)."""
    return Sampler(request)
