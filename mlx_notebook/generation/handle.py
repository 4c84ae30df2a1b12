"""``Generation``: the user's handle on one generation, and the engine's reporter behind it.

A :class:`Generation` is future-like: returned at once, it follows the job
through its :class:`~.states.State`\\ s and lets any thread pause, resume or
cancel it. Its public surface is what users call; the worker and the engine
write to it only through its :class:`Reporter`, which the worker keeps.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..control import CancelToken
from ..errors import InvalidArgumentError
from .constraints import IncompleteOutputError
from .reasoning import TextChannels, ThinkTags, TokenChannels, opens_thinking, think_tags
from .request import GenerationRequest
from .states import State
from .stats import FinishReason, GenerationStats

log = logging.getLogger(__name__)

_ids = itertools.count(1)
_HAND_OVER_S = 0.0002


def _hand_over_gil() -> None:
    """Let a thread woken by a state change (``wait()``, the interrupt hook) run before the worker goes on.

    Otherwise it waits for the worker's next GIL switch (Python's 5 ms
    interval), or longer behind a C call that frees a step's graph or a
    cache: on an H200, stops reported 2-4 ms after the request returned from
    ``wait()`` up to 17 ms after it. ``time.sleep(0)`` hands the GIL to one
    waiting thread, which may be another (a sampler, ipykernel's); a short
    real sleep lets every waiting thread run. 0.2 ms per generation's end.
    """
    time.sleep(_HAND_OVER_S)


@dataclass
class GenerationEvent:
    """What a listener hears.

    Args:
        kind: ``"state"``, ``"progress"`` or ``"tokens"``.
        generation: The generation it is about.
        state: The state after the event.
        text: For ``"tokens"``: the new text of the answer. Default: ``""``.
        phase: For ``"progress"``: ``"load"`` or ``"prefill"``. Default: ``""``.
        done: For ``"progress"``: bytes (load) or tokens (prefill) done. Default: ``0``.
        total: For ``"progress"``: the total of the same. Default: ``0``.
    """

    kind: str
    generation: Generation
    state: State
    text: str = ""
    phase: str = ""
    done: int = 0
    total: int = 0
    reasoning: str = ""  # for "tokens": the new text of the reasoning


Listener = Callable[[GenerationEvent], None]


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the most likely alternatives at its step.

    Args:
        token: The token id.
        logprob: Its log-probability (after logit bias and repetition
          penalty, before temperature and the top-p / min-p / top-k filters,
          as mlx-lm reports it).
        top: ``(token_id, logprob)`` of the most likely tokens, most likely first.
        reasoning: Whether the token is part of the reasoning (not the answer). Default: ``False``.
    """

    token: int
    logprob: float
    top: list[tuple[int, float]]
    reasoning: bool = False


class Generation:
    """A handle on one queued, running or finished generation.

    Attributes:
        id: A small integer, unique in the process.
        request: What was asked.
        stats: A :class:`~.stats.GenerationStats`, updated as it runs.
        error: The exception that failed it, or ``None``.
        token: Its :class:`~mlx_notebook.control.CancelToken`: every stop,
          pause and resume request and when it took effect.
        created_at: ``time.time()`` when it was submitted.

    Args:
        request: What to generate.
        on_cancel: Called with the handle after a cancel request (the worker
          drops it from its queue if it has not started).
    """

    def __init__(self, request: GenerationRequest, on_cancel: Callable[[Generation], None]) -> None:
        self.id = next(_ids)
        self.request = request
        self.stats = GenerationStats()
        self.error: BaseException | None = None
        self.token = CancelToken()
        self.created_at = time.time()
        self._on_cancel = on_cancel
        self._state = State.QUEUED
        self._segments: list[str] = []
        self._reasoning: list[str] = []
        self._thinking = False
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._tokenizer: Any = None
        # For saving: the model it runs on, its prompt's tokens, its sampler's last key.
        self.model_key: str | None = None
        self._prompt_tokens: list[int] = []
        self._sampler_key: Any = None
        self._saver: Callable[[Generation, str, float | None], int] | None = None
        self._listeners: list[Listener] = []
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Generation #{self.id} {self._state}: {self.stats.generated_tokens} tokens, {len(self.text)} chars>"

    # -- reading ------------------------------------------------------------

    @property
    def state(self) -> State:
        """Its :class:`~.states.State`; equal to ``"queued"``, ``"decoding"``, ``"done"``..."""
        return self._state

    @property
    def text(self) -> str:
        """The answer generated so far (readable at any time, also after a stop).

        A reasoning model's thinking is not in it: see :attr:`reasoning`.
        """
        return "".join(self._segments)

    @property
    def reasoning(self) -> str:
        """What a reasoning model wrote between its thinking tags so far (``""`` for other models)."""
        return "".join(self._reasoning)

    @property
    def thinking(self) -> bool:
        """Whether the model is inside its reasoning now (the answer has not started)."""
        return self._thinking

    @property
    def tokens(self) -> list[int]:
        """The token ids generated so far (EOS excluded)."""
        return list(self._tokens)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """Per generated token (with ``logprobs=K``): its log-probability and the K most likely tokens."""
        return list(self._logprobs)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the model it runs on (mlx-lm's wrapper), for reading ``tokens`` and
        ``logprobs``; ``None`` until the model is loaded."""
        return self._tokenizer

    @property
    def parsed(self) -> Any:
        """The value of a constrained answer (``schema=``, ``choices=``, ``regex=``), validated.

        The Pydantic instance for a Pydantic ``schema``, the dict (or list...)
        for a JSON Schema, the chosen string for ``choices``, the text for
        ``regex``. :attr:`text` stays readable whatever happens here.

        Raises:
            InvalidArgumentError: The request has no constraint.
            IncompleteOutputError: It has not finished, or ended before the value
              closed (``max_tokens`` ran out, stopped, a stop string); the message says which.
        """
        constraint = self.request.constraint
        if constraint is None:
            raise InvalidArgumentError("gen.parsed needs schema=, choices= or regex= in the request; read gen.text")
        # The final state, not ``finished``: listeners (a map's table) read it before waiters wake.
        finish = self.stats.finish_reason if self._state.final else None
        try:
            return constraint.parse(self.text, finish, max_tokens=self.request.max_tokens)
        except IncompleteOutputError as exc:
            raise IncompleteOutputError(f"generation #{self.id}: {exc}") from None

    @property
    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids as the model read them (chat template applied); empty until prefill starts."""
        return list(self._prompt_tokens)

    @property
    def sampler_key(self) -> list[int] | None:
        """The sampler's PRNG key after its last token (two uint32), ``None`` while it runs or when greedy."""
        key = self._sampler_key
        return None if key is None else [int(k) for k in key.tolist()]

    @property
    def finished(self) -> bool:
        """Whether the generation reached ``stopped``, ``done`` or ``failed``."""
        return self._done.is_set()

    # -- control --------------------------------------------------------------

    def pause(self) -> None:
        """Pause at the next checkpoint; the KV cache and sampler are kept."""
        if not self.finished:
            self.token.pause()

    def resume(self) -> None:
        """Continue a paused generation exactly where it stopped."""
        self.token.resume()

    def cancel(self) -> None:
        """Stop at the next checkpoint (or drop it from the queue)."""
        if self.finished:
            return
        self.token.cancel()
        self._on_cancel(self)

    stop = cancel

    def save(self, path: str, *, timeout: float | None = None) -> int:
        """Write this generation to one file that :func:`mlx_notebook.resume_from` continues, in any process.

        A paused generation is saved with its KV cache and sampler state, so
        the resume gives exactly the tokens an uninterrupted run gives; a
        stopped or finished one with the cache the model's prompt cache still
        holds of it (the resume prefills what it lacks). The file is mlx-lm's
        prompt-cache format (safetensors + JSON), never code. The save runs
        on the worker in budget-sized pieces; the other generations keep
        streaming; an interrupt (or ``KeyboardInterrupt``) stops it and keeps
        any older file at ``path``.

        Returns:
            The bytes written.

        Raises:
            InvalidArgumentError: It cannot be saved now (running: pause it first;
              queued; paused inside its prefill), in one line.
            TimeoutError: Not saved within ``timeout`` seconds.
        """
        if self._saver is None:
            raise InvalidArgumentError(f"generation #{self.id} runs on a cluster: saving is for one process")
        return self._saver(self, str(path), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished; return whether it finished in time."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> str:
        """Wait and return the text (partial after a stop).

        Raises:
            TimeoutError: Not finished within ``timeout`` seconds.
            Exception: The error that failed the generation.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"generation #{self.id} still {self._state} after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.text

    # -- listeners --------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` on every state change, progress and token.

        Listeners run on the worker thread and must be quick; an exception in
        one is logged and does not affect the generation.
        """
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


class Reporter:
    """The engine's and the worker's side of one :class:`Generation` (the engine's ``Sink``).

    Args:
        generation: The handle it writes to.
    """

    def __init__(self, generation: Generation, model_key: str | None = None) -> None:
        self.generation = generation
        self.stats = generation.stats
        generation.model_key = model_key
        # A resumed generation's saved state, or a KV file to start from (a loaded chat's).
        self.resume: Any = None
        self.seed: Any = None
        # The resolved model (``ModelSource.key``): the worker batches
        # generations of the same one together.
        self.model_key = model_key
        # The reasoning channel: the tags come with the tokenizer, the start state with the prompt.
        self._tags: ThinkTags | None = None
        self._text = TextChannels(None)
        self._tokens = TokenChannels(None)
        self._reasoning_start: float | None = None

    @property
    def state(self) -> State:
        """The generation's state now."""
        return self.generation._state

    def set_state(self, state: State) -> None:
        """Enter ``state`` and tell the listeners (no event when it does not change)."""
        gen = self.generation
        if state == gen._state:
            return
        gen._state = state
        self._notify(GenerationEvent("state", gen, state))
        if state is State.PAUSED:
            _hand_over_gil()

    def progress(self, phase: str, done: int, total: int) -> None:
        """Report ``done`` of ``total`` bytes (``"load"``) or tokens (``"prefill"``)."""
        gen = self.generation
        self._notify(GenerationEvent("progress", gen, gen._state, phase=phase, done=done, total=total))

    def emit(self, token_ids: list[int], text: str) -> None:
        """Append generated tokens and their text (split into reasoning and answer)."""
        reasoning, answer = self.split(text)
        self.emit_split(token_ids, reasoning, answer)

    def split(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer in the next piece of text (for readers of the answer alone, e.g. stop strings)."""
        return self._text.split(text)

    def emit_split(self, token_ids: list[int], reasoning: str, answer: str) -> None:
        """Append generated tokens, and text already split by :meth:`split`."""
        gen = self.generation
        gen._tokens.extend(token_ids)
        stats = gen.stats
        now = time.perf_counter()
        thought = False
        for token in token_ids:
            if self._tokens.feed(token):
                thought = True
                stats.reasoning_tokens += 1
                if self._reasoning_start is None:
                    self._reasoning_start = now
        if thought and self._reasoning_start is not None:
            # Clocked to the last reasoning token: frozen once the block closes.
            stats.reasoning_s = now - self._reasoning_start
        gen._thinking = self._tokens.reasoning
        if reasoning:
            gen._reasoning.append(reasoning)
        if answer:
            gen._segments.append(answer)
        self._notify(GenerationEvent("tokens", gen, gen._state, text=answer, reasoning=reasoning))

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The model is loaded: its tokenizer reads this generation's token ids (and says its thinking tags)."""
        self.generation._tokenizer = tokenizer
        self._tags = think_tags(tokenizer)
        self.set_prompt([])

    def set_prompt(self, prompt: list[int]) -> None:
        """The prompt's tokens: the reasoning channel starts open when the chat template opened the block."""
        self.generation._prompt_tokens = list(prompt)
        self.set_reasoning(self._tags, opens_thinking(self._tags, prompt))

    def keep_sampler_key(self, key: Any) -> None:
        """The sampler's key after the last token (an MLX array, read only when the generation is saved)."""
        self.generation._sampler_key = key

    def set_reasoning(self, tags: ThinkTags | None, open_: bool) -> None:
        """The reasoning tags, and whether the block is open before the first token (where the tokenizer is not here: a cluster's rank 0 says)."""
        self._tags = tags
        self._text = TextChannels(tags, open_)
        self._tokens = TokenChannels(tags, open_)
        self.generation._thinking = open_

    def add_logprobs(self, entry: TokenLogprobs) -> None:
        """Keep one token's log-probabilities (``logprobs=K``), marked reasoning or answer."""
        entry.reasoning = self._tokens.peek(entry.token)
        self.generation._logprobs.append(entry)

    def finish(self, state: State, error: BaseException | None = None) -> None:
        """Enter a final state (after the stream was synchronized) and wake the waiters."""
        gen = self.generation
        reasoning, answer = self._text.flush()  # a piece held back as the possible start of a tag
        if reasoning or answer:
            self.emit_split([], reasoning, answer)
        gen._thinking = False
        gen.error = error
        if state is State.STOPPED:
            gen.stats.finish_reason = FinishReason.STOPPED
        elif state is State.FAILED:
            gen.stats.finish_reason = FinishReason.FAILED
        self.set_state(state)
        gen._done.set()
        _hand_over_gil()

    def _notify(self, event: GenerationEvent) -> None:
        gen = self.generation
        with gen._lock:
            listeners = list(gen._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a display bug must never stop the generation
                log.exception("mlx-notebook listener failed")
