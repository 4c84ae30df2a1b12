"""The reasoning channel: where a model's thinking starts and ends, and a budget that closes it.

Reasoning models write ``<think> ... </think>`` (or their own tags) before the
answer. mlx-lm's ``TokenizerWrapper`` infers the tags from the vocabulary
(``think_start``, ``think_end`` and their token ids); a prompt whose chat
template already opened the block (``...<think>\\n``) starts in it, as in
mlx_lm.server. Three readers of the same tags:

* :class:`TextChannels` splits streamed text into reasoning and answer (on the
  text, as mlx_lm.server does: a detokenizer's segments need not end on a tag).
* :class:`TokenChannels` says which generated tokens are reasoning (for
  ``stats.reasoning_tokens`` and log-probs).
* :class:`ThinkingBudget` forces the close (the end tag and what the template
  puts after it) once ``budget`` reasoning tokens were generated. Its state is
  a function of the row's tokens only (memoized), so a paused row resumes
  exactly: nothing of it lives outside the tokens.

Example::

    tags = think_tags(tokenizer)                       # None: the model does not think
    channels = TextChannels(tags, opens_thinking(tags, prompt_ids))
    reasoning, answer = channels.split("<think>\\nHmm.</think>\\n\\nHi")

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # MLX only where the budget runs: the handle imports this module on the kernel's side too
    import mlx.core as mx

log = logging.getLogger(__name__)

# What follows the end tag when the chat template does not say (Qwen3, DeepSeek-R1 and GLM write this).
DEFAULT_AFTER_END = "\n\n"


@dataclass(frozen=True)
class ThinkTags:
    """A tokenizer's reasoning tags, as text and as token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]


def think_tags(tokenizer: Any) -> ThinkTags | None:
    """The reasoning tags mlx-lm found in ``tokenizer``'s vocabulary, or ``None``."""
    if tokenizer is None or not getattr(tokenizer, "has_thinking", False):
        return None
    start_ids, end_ids = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    if not start_ids or not end_ids:
        return None
    return ThinkTags(tokenizer.think_start, tokenizer.think_end, tuple(start_ids), tuple(end_ids))


def _ends_with(tokens: Sequence[int], tag: tuple[int, ...]) -> bool:
    n = len(tag)
    return len(tokens) >= n and tuple(tokens[-n:]) == tag


def opens_thinking(tags: ThinkTags | None, prompt: Sequence[int]) -> bool:
    """Whether ``prompt`` leaves a reasoning block open (its last start tag after its last end tag)."""
    if tags is None:
        return False
    return _rfind(prompt, tags.start_ids) > _rfind(prompt, tags.end_ids)


def _rfind(tokens: Sequence[int], tag: tuple[int, ...]) -> int:
    first = tag[0]
    for i in range(len(tokens) - len(tag), -1, -1):
        if tokens[i] == first and tuple(tokens[i : i + len(tag)]) == tag:
            return i
    return -1


class TextChannels:
    """Streamed text in, ``(reasoning, answer)`` out; the tags themselves go to neither.

    Text that may be the beginning of a tag is held back until the next piece
    says (:meth:`flush` lets it out at the end). Whitespace right after a tag
    (``<think>\\n``, ``</think>\\n\\n``) is left out of the channel it opens.

    Args:
        tags: The tags (``None``: everything is answer).
        reasoning: Whether the text starts inside a reasoning block.
    """

    def __init__(self, tags: ThinkTags | None, reasoning: bool = False) -> None:
        self.tags = tags
        self.reasoning = reasoning and tags is not None
        self._held = ""
        self._after_tag = self.reasoning

    def split(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer in ``text`` (appended to what came before)."""
        if self.tags is None:
            return "", text
        out = ["", ""]  # reasoning, answer
        text = self._held + text
        self._held = ""
        while text:
            tag = self.tags.end if self.reasoning else self.tags.start
            at = text.find(tag)
            if at < 0:
                keep = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
                self._held = text[len(text) - keep :]
                self._put(out, text[: len(text) - keep])
                break
            self._put(out, text[:at])
            self.reasoning = not self.reasoning
            self._after_tag = True
            text = text[at + len(tag) :]
        return out[0], out[1]

    def flush(self) -> tuple[str, str]:
        """What was held back (the generation ended)."""
        out = ["", ""]
        self._put(out, self._held)
        self._held = ""
        return out[0], out[1]

    def _put(self, out: list[str], text: str) -> None:
        if self._after_tag:
            text = text.lstrip()
            if not text:
                return
            self._after_tag = False
        out[0 if self.reasoning else 1] += text


class TokenChannels:
    """Which generated tokens are reasoning (the tags are neither channel).

    Args:
        tags: The tags (``None``: no token is reasoning).
        reasoning: Whether generation starts inside a reasoning block.
    """

    def __init__(self, tags: ThinkTags | None, reasoning: bool = False) -> None:
        self.tags = tags
        self.reasoning = reasoning and tags is not None
        self._recent: list[int] = []

    def feed(self, token: int) -> bool:
        """Take the next token; return whether it is a reasoning token."""
        tags = self.tags
        if tags is None:
            return False
        self._recent = (self._recent + [token])[-max(len(tags.start_ids), len(tags.end_ids)) :]
        if self.reasoning:
            if _ends_with(self._recent, tags.end_ids):
                self.reasoning = False
                return False
            return True
        if _ends_with(self._recent, tags.start_ids):
            self.reasoning = True
        return False

    def peek(self, token: int) -> bool:
        """Whether ``token`` would be a reasoning token, without taking it."""
        if self.tags is None or not self.reasoning:
            return False
        return not _ends_with(self._recent + [token], self.tags.end_ids)


def close_sequence(tokenizer: Any, tags: ThinkTags) -> list[int]:
    """The tokens that close a reasoning block: the end tag, then what the chat template writes after it.

    The template says it where it closes an empty block itself: with
    ``enable_thinking=False`` Qwen3's generation prompt ends ``<think>\\n\\n</think>\\n\\n``.
    Templates that do not (DeepSeek-R1 opens the block in every prompt) get
    ``DEFAULT_AFTER_END``.
    """
    after = DEFAULT_AFTER_END
    if getattr(tokenizer, "has_chat_template", False):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "."}], add_generation_prompt=True, tokenize=False, enable_thinking=False
            )
            at = text.rfind(tags.end)
            if at >= 0:
                after = text[at + len(tags.end) :]
        except Exception:  # a template that cannot render this: keep the default
            log.debug("chat template did not render with enable_thinking=False", exc_info=True)
    tail = list(tokenizer.encode(after, add_special_tokens=False)) if after else []
    return list(tags.end_ids) + tail


@dataclass(frozen=True)
class _State:
    """Where a row is, after some tokens: in the answer, in the reasoning (``count`` so far), or closing."""

    mode: str  # "answer", "reasoning", "closing"
    count: int = 0  # reasoning tokens generated so far
    at: int = 0  # closing: the index of the next forced token


class ThinkingBudget:
    """A logits processor that forces the close of the reasoning after ``budget`` reasoning tokens.

    Its state after ``n`` generated tokens is a pure function of the prompt and
    those tokens (memoized for the last ``n``): a paused row, whose tokens are
    kept, resumes with exactly the decision it would have taken. A step built
    before its input token is read (``pending``) does not read it: when the
    decision depends on it (did that token close the block?), the choice is
    made on the device with ``mx.where``.

    Args:
        budget: Most reasoning tokens.
        tags: The reasoning tags.
        close: The tokens forced to close (:func:`close_sequence`).
        prompt: The row's prompt tokens.
        generated: The row's generated tokens (its own list: read, not copied).
    """

    def __init__(
        self, budget: int, tags: ThinkTags, close: list[int], prompt: Sequence[int], generated: list[int]
    ) -> None:
        self.budget = budget
        self.tags = tags
        self.close = close
        self.generated = generated
        self._prompt_tail = list(prompt[-max(len(tags.start_ids), len(tags.end_ids)) :])
        start = _State("reasoning") if opens_thinking(tags, prompt) else _State("answer")
        self._start = self._enter(start)
        self._memo = (0, self._start)

    # -- the state, from the tokens ------------------------------------------------

    def _enter(self, state: _State) -> _State:
        # Inside the block with the budget spent (0, or a block reopened): close at once.
        if state.mode == "reasoning" and state.count >= self.budget:
            return _State("closing", state.count, 0)
        return state

    def _next(self, state: _State, before: Sequence[int], token: int) -> _State:
        """The state after ``token``, ``before`` being the tokens before it (enough for a tag)."""
        tags = self.tags
        seq = [*before, token]
        if state.mode == "closing":
            at = state.at + 1
            return _State("answer", state.count) if at >= len(self.close) else _State("closing", state.count, at)
        if state.mode == "reasoning":
            if _ends_with(seq, tags.end_ids):
                return _State("answer", state.count)
            return self._enter(_State("reasoning", state.count + 1))
        if _ends_with(seq, tags.start_ids):
            return self._enter(_State("reasoning", state.count))
        return state

    def state_after(self, n: int) -> _State:
        """The state after the first ``n`` generated tokens."""
        done, state = self._memo
        if n < done:  # not seen in a row's life (tokens only grow); recomputed, never guessed
            done, state = 0, self._start
        tokens = self.generated
        width = max(len(self.tags.start_ids), len(self.tags.end_ids))
        for i in range(done, n):
            before = (self._prompt_tail + tokens[:i])[-(width - 1) :] if width > 1 else []
            state = self._next(state, before, tokens[i])
        self._memo = (n, state)
        return state

    def _forced(self, state: _State) -> int:
        return self.close[state.at] if state.mode == "closing" else -1

    # -- the processor ------------------------------------------------------------------

    def __call__(self, context: mx.array, logits: mx.array, *, pending: bool) -> mx.array:
        """Force this step's token when the close is due.

        Args:
            context: The tokens before the one predicted; its last is the step's input.
            logits: One row's logits, shape ``(1, vocab)``.
            pending: Whether the input token is not read yet (not in ``generated``).
        """
        import mlx.core as mx

        read = len(self.generated)
        state = self.state_after(read)
        if not pending:
            return self._force(logits, self._forced(state))
        if state.mode == "closing":  # the input was forced: known without reading it
            return self._force(logits, self._forced(self._next(state, [], self.close[state.at])))
        width = max(len(self.tags.start_ids), len(self.tags.end_ids))
        before = (self._prompt_tail + self.generated)[-(width - 1) :] if width > 1 else []
        other = self._forced(self._next(state, before, -1))
        choices = {
            tag[-1]: self._forced(self._next(state, before, tag[-1]))
            for tag in (self.tags.start_ids, self.tags.end_ids)
        }
        if all(forced == other for forced in choices.values()):
            return self._force(logits, other)
        target = mx.array(other)
        last = context[-1]
        for token, forced in choices.items():
            if forced != other:
                target = mx.where(last == token, mx.array(forced), target)
        return mx.where(target < 0, logits, _one_hot_logits(target, logits))

    @staticmethod
    def _force(logits: mx.array, token: int) -> mx.array:
        import mlx.core as mx

        return logits if token < 0 else _one_hot_logits(mx.array(token), logits)


def _one_hot_logits(token: mx.array, like: mx.array) -> mx.array:
    """Logits shaped as ``like`` that only ``token`` can follow: 0 there, -inf elsewhere."""
    import mlx.core as mx

    row = mx.where(mx.arange(like.shape[-1]) == token, 0.0, -mx.inf).astype(like.dtype)
    return mx.broadcast_to(row, like.shape)


__all__ = [
    "DEFAULT_AFTER_END",
    "TextChannels",
    "ThinkTags",
    "ThinkingBudget",
    "TokenChannels",
    "close_sequence",
    "opens_thinking",
    "think_tags",
]
