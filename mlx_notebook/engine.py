"""One generation, phase by phase, with a cancel checkpoint between pieces of work.

Phases: load (parameters evaluated in budget-sized batches), prepare (chat
template, tokenization), prefill (prompt chunks sized so one chunk fits the
stop budget), decode (one token per piece, pipelined like mlx-lm: the next
step is submitted before the current token is read).

The engine never synchronizes on a stop itself: it raises
:class:`~mlx_notebook.control.Cancelled` out of a checkpoint and the worker,
which owns the stream, synchronizes before it reports the generation stopped.
A pause synchronizes in place (``on_pause``) and blocks inside the checkpoint,
so the KV cache, the sampler key and the pipelined step all survive it and
resume continues with exactly the tokens an uninterrupted run gives.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Protocol, Union

import mlx.core as mx

from .control import DEFAULT_STOP_BUDGET_S, CancelToken
from .errors import InvalidArgumentError
from .fit import linear_fit
from .models import LoadedModel, ModelStore
from .pieces import prefill_runner

MAX_PREFILL_CHUNK = 2048  # a power of two (see ChunkPlanner)
FIRST_PREFILL_CHUNK = 8
# A chunk is sized to this share of the budget: per-token cost grows with the
# prompt position (attention), so the next chunk runs a bit slower than the last.
BUDGET_SHARE = 0.7


@dataclass
class GenerationRequest:
    """What to generate. Validated by :meth:`validate` before queueing.

    Args:
        prompt: The user's prompt, or a list of token ids used as they are
          (no chat template): exact prompt lengths for benchmarks.
        model: Model name (see :func:`mlx_notebook.models.resolve`). Default: ``None``.
        max_tokens: Most tokens to generate. Default: ``256``.
        temperature: 0 for greedy. Default: ``0.0``.
        top_p: Nucleus sampling mass; 1 disables it. Default: ``1.0``.
        seed: Seed of the sampling key; ``None`` for a random one. Default: ``None``.
        system: System message for the chat template. Default: ``None``.
        chat: Apply the model's chat template. Default: ``True``.
        stop_budget: Target seconds for one piece of work. Default: ``DEFAULT_STOP_BUDGET_S`` (0.1).
    """

    prompt: Union[str, List[int]]
    model: Optional[str] = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    system: Optional[str] = None
    chat: bool = True
    stop_budget: float = DEFAULT_STOP_BUDGET_S

    def validate(self) -> None:
        """Raise :class:`InvalidArgumentError` with the fix for a bad field."""
        if isinstance(self.prompt, (list, tuple)):
            if not self.prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prompt
            ):
                raise InvalidArgumentError(
                    "a token prompt must be a non-empty list of non-negative integers"
                )
        elif not isinstance(self.prompt, str):
            raise InvalidArgumentError(
                f"prompt must be a string, got {type(self.prompt).__name__}"
            )
        elif not self.prompt.strip():
            raise InvalidArgumentError("prompt is empty: give some text to generate from")
        else:
            _check_text("prompt", self.prompt)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("top_p", self.top_p, minimum=0.0, exclusive_minimum=True, maximum=1.0)
        _check_number("stop_budget", self.stop_budget, minimum=0.0, exclusive_minimum=True)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.system is not None and not isinstance(self.system, str):
            raise InvalidArgumentError(
                f"system must be a string or None, got {type(self.system).__name__}"
            )
        if self.system is not None:
            _check_text("system", self.system)


def _check_text(name: str, text: str) -> None:
    # Tokenizers take UTF-8 only; a lone surrogate (bytes decoded with
    # errors="surrogateescape") would fail later, on the worker, with a TypeError.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{name} is not valid UTF-8 text: {text[exc.start]!r} at position {exc.start} is a "
            "lone surrogate; decode the source bytes with errors='replace'"
        ) from None


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")


def _check_number(
    name: str,
    value,
    *,
    minimum: float,
    exclusive_minimum: bool = False,
    maximum: Optional[float] = None,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not low_ok or (maximum is not None and value > maximum) or math.isinf(value):
        bound = f"> {minimum}" if exclusive_minimum else f">= {minimum}"
        if maximum is not None:
            bound += f" and <= {maximum}"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")


@dataclass
class GenerationStats:
    """Measurements of one generation.

    Args:
        prompt_tokens: Tokens in the prepared prompt.
        generated_tokens: Tokens generated so far (EOS not counted).
        ttft_s: Seconds from the start of the job (load included) to the first token.
        prompt_tps: Prompt tokens per second of prefill.
        generation_tps: Generated tokens per second after the first.
        peak_memory_gb: MLX peak memory during the job.
        stop_latency_s: Seconds from the stop request to the parked worker.
        load_s: Seconds spent loading the model (0 when it was loaded).
        prefill_pieces: How prefill was cut: ``"chunks"`` or ``"layers"``.
        prefill_chunks: Number of prefill chunks run.
        finish_reason: ``"stop"`` (EOS), ``"length"``, ``"stopped"``, ``"failed"``.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: Optional[float] = None
    prompt_tps: Optional[float] = None
    generation_tps: Optional[float] = None
    peak_memory_gb: Optional[float] = None
    stop_latency_s: Optional[float] = None
    load_s: float = 0.0
    prefill_pieces: str = "chunks"
    prefill_chunks: int = 0
    finish_reason: Optional[str] = None


class GenerationSink(Protocol):
    """Where the engine reports what happens (the worker's ``Generation``)."""

    stats: GenerationStats

    def set_state(self, state: str) -> None: ...

    def progress(self, phase: str, done: int, total: int) -> None: ...

    def emit(self, token_ids: List[int], text: str) -> None: ...


@dataclass
class _Pause:
    """Synchronizes the stream and reports ``paused`` when a pause takes effect."""

    sink: GenerationSink
    stream: mx.Stream
    resumed_state: str = "loading"

    def on_pause(self) -> None:
        mx.synchronize(self.stream)
        self.sink.set_state("paused")

    def on_resume(self) -> None:
        self.sink.set_state(self.resumed_state)


@dataclass
class Engine:
    """Runs generations on the calling thread, which must own ``stream``.

    Args:
        store: Loaded models.
        stream: The MLX stream all work goes to.
    """

    store: ModelStore
    stream: mx.Stream
    _keys: List[int] = field(default_factory=list)

    def run(self, request: GenerationRequest, token: CancelToken, sink: GenerationSink) -> str:
        """Run one generation to its end; return the finish reason.

        Raises:
            Cancelled: A stop was requested (the caller synchronizes).
            MLXNotebookError: Bad input found while preparing.
            RuntimeError: An MLX error.
        """
        start = time.perf_counter()
        pause = _Pause(sink, self.stream)
        mx.reset_peak_memory()
        with mx.stream(self.stream):
            sink.set_state("loading")
            loaded = self.store.get(
                request.model,
                token=token,
                progress=lambda done, total: sink.progress("load", done, total),
                budget_s=request.stop_budget,
                on_pause=pause.on_pause,
                on_resume=pause.on_resume,
            )
            sink.stats.load_s = time.perf_counter() - start
            pause.resumed_state = "prefilling"
            sink.set_state("prefilling")
            prompt = prepare_prompt(loaded, request)
            sink.stats.prompt_tokens = len(prompt)
            token.checkpoint(on_pause=pause.on_pause, on_resume=pause.on_resume)
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(loaded.model)
            prefill_start = time.perf_counter()
            prefill(loaded, cache, prompt, request, token, sink, pause)
            return decode(loaded, cache, prompt, request, token, sink, pause, start, prefill_start)


def prepare_prompt(loaded: LoadedModel, request: GenerationRequest) -> List[int]:
    """Apply the chat template (or not) and tokenize; check the context length."""
    tokenizer = loaded.tokenizer
    if isinstance(request.prompt, (list, tuple)):
        ids = list(request.prompt)
        vocab = loaded.config.get("vocab_size")
        if isinstance(vocab, int) and max(ids) >= vocab:
            raise InvalidArgumentError(
                f"token id {max(ids)} is outside the model's vocabulary of {vocab}"
            )
    elif request.chat and getattr(tokenizer, "has_chat_template", False):
        messages = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        messages.append({"role": "user", "content": request.prompt})
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        with _no_length_warning():
            ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        text = request.prompt if request.system is None else f"{request.system}\n\n{request.prompt}"
        with _no_length_warning():
            ids = tokenizer.encode(text)
    ids = list(ids)
    if not ids:
        raise InvalidArgumentError("prompt tokenized to nothing: give some text to generate from")
    context = loaded.config.get("max_position_embeddings")
    if isinstance(context, int) and len(ids) >= context:
        raise InvalidArgumentError(
            f"prompt has {len(ids)} tokens but the model's context is {context}: shorten the prompt"
        )
    return ids


@contextmanager
def _no_length_warning() -> Iterator[None]:
    # transformers warns on stderr, i.e. in the user's cell, when a prompt is
    # longer than the tokenizer's model_max_length; the context check in
    # prepare_prompt says it in one line instead (or the prompt fits the model).
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def prefill(
    loaded: LoadedModel,
    cache: list,
    prompt: List[int],
    request: GenerationRequest,
    token: CancelToken,
    sink: GenerationSink,
    pause: _Pause,
) -> None:
    """Feed all but the last prompt token through the model in adaptive chunks.

    A :class:`ChunkPlanner` sizes each chunk from the measured cost of the
    recent ones so that one piece of work takes about ``BUDGET_SHARE *
    stop_budget``; it starts from the model's last measurement, or small.
    """
    total = len(prompt)
    to_process = total - 1
    budget = request.stop_budget
    ids = mx.array(prompt, dtype=mx.uint32)
    runner = prefill_runner(loaded, cache, token, pause.on_pause, pause.on_resume, budget)
    sink.stats.prefill_pieces = runner.pieces
    shapes = None
    if _builds_kernels_per_shape():
        shapes = loaded.extras.setdefault("prefill_shapes_seen", set())
    planner = ChunkPlanner(loaded.extras.get("prefill_cost"), shapes)
    done = 0
    sink.progress("prefill", 0, total)
    while done < to_process:
        target = budget * BUDGET_SHARE * runner.chunk_budget_factor
        n = planner.next_chunk(target, done, to_process - done)
        t0 = time.perf_counter()
        runner.run(ids[None, done : done + n])
        planner.observe(n, time.perf_counter() - t0, start=done)
        sink.stats.prefill_pieces = runner.pieces
        done += n
        sink.stats.prefill_chunks += 1
        sink.progress("prefill", done, total)
        mx.clear_cache()
        token.checkpoint(on_pause=pause.on_pause, on_resume=pause.on_resume)
    if planner.cost is not None:
        loaded.extras["prefill_cost"] = planner.cost
        loaded.prefill_s_per_token = planner.cost[1]


KV_STEP = 256  # mlx-lm's KVCache.step


def _builds_kernels_per_shape() -> bool:
    """Whether the device builds attention kernels per input shape (the CUDA backend's cuDNN graphs)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and cuda.is_available()


class ChunkPlanner:
    """Sizes prefill chunks from an affine cost model, ``t = fixed + n * per_token``.

    A plain per-token rate fails on accelerators: a chunk of 8 tokens costs
    about as much as one of 200 (reading the weights dominates), so the rate
    of a small chunk predicts tiny chunks forever. Fitting a fixed cost plus a
    per-token cost over the recent chunks lets the size grow to what fits.

    Chunks of 256 tokens or more end on multiples of mlx-lm's ``KVCache``
    allocation step: the cache slices and copies itself when a chunk ends off
    it, which made later decode steps slower (an H200 at 32k tokens).

    On devices that build kernels per shape (``shapes_seen`` given: the CUDA
    backend builds a cuDNN attention graph for every new pair of chunk length
    and context length, 50 ms to 1 s each) chunk sizes are powers of two and
    a chunk of size ``g`` ends on a multiple of ``g`` (the first one after a
    smaller size is shortened to get there), so runs of a prompt share their
    boundaries: a prompt planned differently from the last run's (a known
    cost skips the small first chunks) paid those builds inside one piece.

    A chunk of a shape the device has not run before may include such a
    build: its time says nothing about the cost model, and learning from it
    shrank the next chunks to new shapes again, each with its own build
    (a 512-token prefill ran at 0.09x plain mlx-lm on an H200). With
    ``shapes_seen``, such a chunk is not learned from when it ran over twice
    the prediction (or nothing predicts yet), and the next chunk grows as if
    it had fit; and a planned chunk never run before gives way to one up to
    4x smaller that has (see :meth:`_seen_size`).

    Args:
        cost: A ``(fixed_s, per_token_s)`` from an earlier generation, or ``None``.
        shapes_seen: ``(start, size)`` pairs run before with this model, updated
          here; ``None`` where shapes cost nothing new (no first-use rule).
    """

    def __init__(self, cost: Optional[tuple] = None, shapes_seen: Optional[set] = None) -> None:
        self.cost = tuple(cost) if cost is not None else None
        self.shapes_seen = shapes_seen
        self._samples: List[tuple] = []
        self._last = 0
        self._grow_blind = False

    def observe(self, n: int, seconds: float, *, start: int) -> None:
        """Record that the chunk of ``n`` tokens from ``start`` took ``seconds``."""
        self._last = n
        if self.shapes_seen is not None and (start, n) not in self.shapes_seen:
            self.shapes_seen.add((start, n))
            if self.cost is None or seconds > 2 * (self.cost[0] + n * self.cost[1]):
                self._grow_blind = True
                return
        self._grow_blind = False
        self._samples = (self._samples + [(n, seconds)])[-6:]
        line = linear_fit(self._samples)
        if line is None or line[1] <= 0:
            self.cost = (0.0, seconds / n)
            return
        fixed, per_token = line
        self.cost = (max(0.0, fixed), per_token)

    def next_chunk(self, target_s: float, done: int, remaining: int) -> int:
        """The next chunk size for a piece budget of ``target_s`` seconds."""
        if self._grow_blind:
            n = self._last * 4
        elif self.cost is None:
            n = FIRST_PREFILL_CHUNK
        else:
            fixed, per_token = self.cost
            n = int((target_s - fixed) / per_token) if target_s > fixed else 1
            if self._last:
                # At most 4x growth a chunk: the cost model extrapolates.
                n = min(n, self._last * 4)
            if target_s <= fixed:
                # Not even one token fits: larger chunks cost no more latency
                # than small ones, so grow for throughput.
                n = max(n, self._last * 2, FIRST_PREFILL_CHUNK)
        n = max(1, min(n, MAX_PREFILL_CHUNK))
        if self.shapes_seen is None:
            # Shapes cost nothing new here: any size (rounding down to powers of
            # two doubled the chunk count at 4k-8k tokens on a 2-core CPU and
            # cost 40% of prefill speed at 8k); big chunks end on the KV step.
            n = min(n, remaining)
            if KV_STEP <= n < remaining:
                n = (done + n) // KV_STEP * KV_STEP - done
            return n
        size = 1 << (n.bit_length() - 1)  # the largest power of two <= n
        size = self._seen_size(size, done, remaining)
        return _aligned(size, done, remaining)

    def _seen_size(self, size: int, done: int, remaining: int) -> int:
        """``size``, or up to 4x smaller where only that chunk from ``done`` ran before.

        The cost carried from the end of a long prompt (attention makes late
        chunks slower) wobbles the plan of the next run between neighbouring
        powers of two; a smaller chunk already built costs a little
        throughput, a new one a graph build inside a piece (72 ms at 32k).
        """
        for candidate in (size, size // 2, size // 4):
            if candidate >= 1 and (done, _aligned(candidate, done, remaining)) in self.shapes_seen:
                return candidate
        return size


def _aligned(size: int, done: int, remaining: int) -> int:
    """The chunk from ``done`` that ends on the next multiple of ``size`` (or the prompt's end)."""
    return min((done // size + 1) * size - done, remaining)


def make_sampler(request: GenerationRequest):
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


def decode(
    loaded: LoadedModel,
    cache: list,
    prompt: List[int],
    request: GenerationRequest,
    token: CancelToken,
    sink: GenerationSink,
    pause: _Pause,
    start: float,
    prefill_start: float,
) -> str:
    """Generate token by token with one step in flight; return the finish reason."""
    model = loaded.model
    sample = make_sampler(request)
    eos = set(loaded.tokenizer.eos_token_ids)
    detokenizer = loaded.tokenizer.detokenizer
    stats = sink.stats

    def step(inputs: mx.array) -> mx.array:
        logits = model(inputs[None], cache=cache)[:, -1, :]
        return sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    y = step(mx.array(prompt[-1:], dtype=mx.uint32))
    mx.async_eval(y)
    pause.resumed_state = "decoding"
    first_token_at = None
    finish = "length"
    n = 0
    while True:
        next_y = None
        if n + 1 < request.max_tokens:
            # Submit the next step before reading this token: the device
            # works while Python detokenizes and checks the token.
            next_y = step(y)
            mx.async_eval(next_y)
        tok = y.item()
        n += 1
        if first_token_at is None:
            first_token_at = time.perf_counter()
            stats.ttft_s = first_token_at - start
            stats.prompt_tps = len(prompt) / max(first_token_at - prefill_start, 1e-9)
            sink.set_state("decoding")
            sink.progress("prefill", len(prompt), len(prompt))
        if tok in eos:
            finish = "stop"
            break
        detokenizer.add_token(tok)
        stats.generated_tokens = n
        if n > 1:
            stats.generation_tps = (n - 1) / max(time.perf_counter() - first_token_at, 1e-9)
        if n % 32 == 1:
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        sink.emit([tok], detokenizer.last_segment)
        if next_y is None:
            break
        if n % 256 == 0:
            mx.clear_cache()
        token.checkpoint(on_pause=pause.on_pause, on_resume=pause.on_resume)
        y = next_y
    detokenizer.finalize()
    tail = detokenizer.last_segment
    if tail:
        sink.emit([], tail)
    stats.finish_reason = finish
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return finish
