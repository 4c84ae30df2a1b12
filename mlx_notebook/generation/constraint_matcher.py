"""A constrained row's matcher: which tokens may come next, as a mask on the row's logits.

Each constrained row of a decode batch carries one :class:`RowMatcher` next to
its sampler. After the row's token is read, :meth:`RowMatcher.advance` feeds
it to llguidance; :meth:`RowMatcher.allowed` then says which tokens the next
step may pick, and the batch masks the row's logits to ``-inf`` elsewhere
inside the step's graph (:func:`mask_logits`). The matcher's state is a
function of the tokens it was fed: a parked row keeps its matcher, so resume
continues from exactly the state it left.

llguidance's view of a model's tokenizer (:func:`ll_tokenizer`) is built once
per loaded model, from the model folder's ``tokenizer.json`` (the in-process
tokenizer may be a proxy to a child process: :mod:`..loading.tokenizer`).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import InvalidArgumentError
from .constraints import Constraint, llguidance_module

# One llguidance tokenizer per loaded model (keyed by the model's tokenizer object).
# Building one holds the GIL throughout (measured on this 2-core CPU: 0.75 s for the
# default model's 49,152 tokens, 2.3 s for Qwen3's 151,936, the same with slices off):
# a stop pressed meanwhile waits that long, once per model. Open: issue 22.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(loaded: Any) -> Any:
    """llguidance's tokenizer for ``loaded`` (a ``LoadedModel``), built on first use."""
    tokenizer = loaded.tokenizer
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(tokenizer)
    if found is not None:
        return found
    llg = llguidance_module()
    eos = sorted(set(tokenizer.eos_token_ids))
    folder = getattr(loaded, "folder", None)
    source = folder / "tokenizer.json" if folder is not None else None
    if source is not None and source.exists():
        built = llg.LLTokenizer(source.read_text(encoding="utf-8"), eos_token=eos)
    else:
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        try:
            built = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        except ValueError:
            raise InvalidArgumentError(
                "structured output needs a fast Hugging Face tokenizer (a tokenizer.json in the model folder)"
            ) from None
    with _TOKENIZERS_LOCK:
        _TOKENIZERS[tokenizer] = built
    return built


class RowMatcher:
    """One row's grammar state and its next-token mask.

    Args:
        constraint: What the row's answer must be.
        tokenizer: llguidance's tokenizer of the model (:func:`ll_tokenizer`).
    """

    def __init__(self, constraint: Constraint, tokenizer: Any) -> None:
        llg = llguidance_module()
        import llguidance.numpy

        self._fill = llguidance.numpy.fill_next_token_bitmask
        self.constraint = constraint
        self.vocab = tokenizer.vocab_size
        self.matcher = llg.LLMatcher(tokenizer, constraint.grammar)
        self._check()
        self._bits = llguidance.numpy.allocate_token_bitmask(1, self.vocab)

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"structured output: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar is complete: no token but EOS may follow."""
        return bool(self.matcher.is_stopped())

    def advance(self, token: int) -> None:
        """Feed the row's read token (the mask allowed it, so this never fails but on a bug)."""
        self.matcher.consume_token(token)
        self._check()

    def allowed(self, width: int) -> np.ndarray:
        """A ``bool`` vector of ``width`` (the logits' last axis): which tokens the next step may pick."""
        self._fill(self.matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        if allowed.shape[0] >= width:
            return allowed[:width]
        # The model's embedding may be wider than the tokenizer: those ids are never text.
        return np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])


def mask_logits(logits: mx.array, matchers: list[RowMatcher | None]) -> mx.array:
    """``logits`` (one row per matcher) with each constrained row's disallowed tokens at ``-inf``."""
    width = logits.shape[-1]
    allowed = np.ones((len(matchers), width), dtype=bool)
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            allowed[i] = matcher.allowed(width)
    return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))


__all__ = ["RowMatcher", "ll_tokenizer", "mask_logits"]
