"""A constrained row's matcher: which tokens may come next, as a mask on the row's logits.

Each constrained row of a decode batch carries one :class:`RowMatcher` next to
its sampler. After the row's token is read, :meth:`RowMatcher.advance` feeds
it to llguidance; :meth:`RowMatcher.allowed` then says which tokens the next
step may pick, and the batch masks the row's logits to ``-inf`` elsewhere
inside the step's graph (:func:`mask_logits`). The matcher's state is a
function of the tokens it was fed: a parked row keeps its matcher, so resume
continues from exactly the state it left.

llguidance itself runs in a child process (:mod:`.grammar_process`), one per
loaded model (:func:`ll_tokenizer`), which builds its view of the tokenizer
from the model folder's ``tokenizer.json``: that build holds the GIL for
0.6-1.1 s on a 152k vocabulary, so in this process it delayed a stop that
long. While it builds, the row that needs it waits at its pace's checkpoints.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import InvalidArgumentError
from .constraints import Constraint, llguidance_module
from .grammar_process import GrammarProcess
from .reasoning import ThinkTags, TokenChannels, opens_thinking, think_tags

# One llguidance process per loaded model (keyed by the model's tokenizer object).
_PROCESSES: weakref.WeakKeyDictionary[Any, GrammarProcess] = weakref.WeakKeyDictionary()
_PROCESSES_LOCK = threading.Lock()


def start_grammar_process(loaded: Any) -> GrammarProcess:
    """Start the llguidance process of ``loaded`` if it is not running, without waiting for its tokenizer.

    The session calls it as soon as a constrained generation's model is
    loaded, so that the build (~1.2 s for a 152k vocabulary) runs in the
    child while the prompt is prefilled.

    Raises:
        InvalidArgumentError: The ``structured`` extra is not installed.
    """
    tokenizer = loaded.tokenizer
    with _PROCESSES_LOCK:
        process = _PROCESSES.get(tokenizer)
        if process is None:
            llguidance_module()  # a missing extra is one line here, not a child's traceback
            process = GrammarProcess(_tokenizer_source(loaded), sorted(set(tokenizer.eos_token_ids)))
            _PROCESSES[tokenizer] = process
    return process


def ll_tokenizer(loaded: Any, wait: Callable[[], None] | None = None) -> GrammarProcess:
    """The llguidance process of ``loaded`` (a ``LoadedModel``), started on first use, its tokenizer built.

    Args:
        loaded: The model.
        wait: Called at least every 5 ms while the tokenizer builds (a pace's
          checkpoint: it raises on a stop, blocks on a pause). Default: ``None``.

    Raises:
        InvalidArgumentError: The model has no fast tokenizer llguidance can read.
    """
    process = start_grammar_process(loaded)
    try:
        process.wait_ready(wait)
    except RuntimeError as exc:
        raise InvalidArgumentError(str(exc)) from None
    return process


def _tokenizer_source(loaded: Any) -> str:
    """What the child builds llguidance's tokenizer from: the folder's ``tokenizer.json``, else its text."""
    folder = getattr(loaded, "folder", None)
    source = folder / "tokenizer.json" if folder is not None else None
    if source is not None and source.exists():
        return str(source)
    # No folder file: a Hugging Face fast tokenizer in this process, serialized as
    # llguidance.hf.from_tokenizer does (added tokens included, no padding or truncation).
    from copy import copy

    hf = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise InvalidArgumentError(
            "structured output needs a fast Hugging Face tokenizer (a tokenizer.json in the model folder)"
        )
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


# Whitespace tokens allowed between a reasoning block's end tag and the answer (a weak
# model could otherwise write newlines until max_tokens).
SPACES_AFTER_REASONING = 4


class RowMatcher:
    """One row's grammar state and its next-token mask.

    With a reasoning model the grammar holds the answer, after the reasoning:
    while the row thinks every token may come (its logits processors, such as
    the thinking budget, still apply) and nothing is fed to the grammar; after
    the end tag whitespace may come (the template's ``\\n\\n``) until the answer
    starts. The phase follows from the tokens fed, so a parked row resumes exactly.

    Args:
        constraint: What the row's answer must be.
        tokenizer: The model's llguidance process (:func:`ll_tokenizer`).
        tags: The model's reasoning tags (:func:`.reasoning.think_tags`). Default: ``None``.
        reasoning: Whether the prompt opened a reasoning block. Default: ``False``.
    """

    def __init__(
        self,
        constraint: Constraint,
        tokenizer: GrammarProcess,
        *,
        tags: ThinkTags | None = None,
        reasoning: bool = False,
    ) -> None:
        self.constraint = constraint
        self.vocab = tokenizer.vocab_size
        self._process = tokenizer
        self._row = tokenizer.new_matcher(constraint.grammar)
        weakref.finalize(self, tokenizer.free, self._row)
        self._channel = TokenChannels(tags, reasoning) if tags is not None and reasoning else None
        self._after_reasoning = False  # an end tag came, the answer not yet
        self._spaces = 0  # whitespace tokens since the end tag

    @classmethod
    def for_row(cls, constraint: Constraint, loaded: Any, prompt: list[int], wait: Callable[[], None]) -> RowMatcher:
        """The matcher of a row of ``loaded`` whose prompt is ``prompt`` (``wait``: see :func:`ll_tokenizer`)."""
        tags = think_tags(loaded.tokenizer)
        process = ll_tokenizer(loaded, wait=wait)
        return cls(constraint, process, tags=tags, reasoning=opens_thinking(tags, prompt))

    @property
    def thinking(self) -> bool:
        """Whether the row is inside its reasoning block (the grammar waits)."""
        return self._channel is not None and self._channel.reasoning

    @property
    def done(self) -> bool:
        """Whether the grammar is complete: no token but EOS may follow."""
        return not self.thinking and self._process.done(self._row)

    def advance(self, token: int) -> None:
        """Feed the row's read token (the mask allowed it, so this never fails but on a bug).

        Returns at once: the next mask is computed meanwhile, in the child.
        """
        if self._for_grammar(token):
            self._process.advance(self._row, token)

    @staticmethod
    def advance_all(pairs: list[tuple[RowMatcher, int]]) -> None:
        """Feed each row its read token, one request per llguidance process (a batch step: see ``advance_many``)."""
        by_process: dict[int, tuple[GrammarProcess, list[tuple[int, int]]]] = {}
        for matcher, token in pairs:
            if matcher._for_grammar(token):
                process = matcher._process
                by_process.setdefault(id(process), (process, []))[1].append((matcher._row, token))
        for process, rows in by_process.values():
            process.advance_many(rows)

    def _for_grammar(self, token: int) -> bool:
        """Follow the reasoning phase; whether the grammar itself must consume ``token``."""
        if self._channel is not None and self._channel.reasoning:
            self._channel.feed(token)
            self._after_reasoning = not self._channel.reasoning
            return False
        if self._after_reasoning and self._bit(self._process.whitespace, token):
            self._spaces += 1  # what the template writes after the end tag, before the answer
            self._after_reasoning = self._spaces < SPACES_AFTER_REASONING
            return False
        self._after_reasoning = False
        return True

    @staticmethod
    def _bit(mask: bytes, token: int) -> bool:
        return token // 8 < len(mask) and bool(mask[token // 8] >> (token % 8) & 1)

    def allowed(self, width: int) -> np.ndarray:
        """A ``bool`` vector of ``width`` (the logits' last axis): which tokens the next step may pick."""
        if self.thinking:
            return np.ones(width, dtype=bool)
        bits = np.frombuffer(self._process.mask(self._row), dtype=np.uint8)
        if self._after_reasoning:
            bits = bits | np.frombuffer(self._process.whitespace, dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
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
