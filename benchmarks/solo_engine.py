"""The one-generation loop from before batching, kept as the reference a batch of one is compared against.

``Engine.run`` loads, prefills (the library's own :func:`~mlx_notebook.generation.prefill.prefill`)
and decodes one generation on the calling thread, token by token, with mlx-lm's
pipelining while two steps fit the budget. The library runs every generation
through :class:`~mlx_notebook.generation.decode_batch.DecodeBatch` (a batch of
one is a solo run); only :mod:`benchmarks.batching` runs this, to show that a
batch of one costs what this loop cost.
"""

from __future__ import annotations

import mlx_notebook  # noqa: F401  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import time
from typing import Any, cast

import mlx.core as mx

from mlx_notebook.control import Pace
from mlx_notebook.errors import InvalidArgumentError
from mlx_notebook.generation import decode_pacing
from mlx_notebook.generation.prefill import Sink, prefill
from mlx_notebook.generation.prompt import prepare_prompt
from mlx_notebook.generation.request import GenerationRequest
from mlx_notebook.generation.sampling import make_sampler
from mlx_notebook.generation.states import State
from mlx_notebook.generation.stats import FinishReason, GenerationStats
from mlx_notebook.generation.wired import wired_limit
from mlx_notebook.loading.store import LoadedModel, ModelStore


class Engine:
    """Runs generations on the calling thread, which must own ``stream``.

    Args:
        store: Loaded models.
        stream: The MLX stream all work goes to.
    """

    def __init__(self, store: ModelStore, stream: mx.Stream) -> None:
        self.store = store
        self.stream = stream

    def run(self, request: GenerationRequest, pace: Pace, sink: Sink) -> FinishReason:
        """Run one generation to its end; return why it ended.

        Raises:
            Cancelled: A stop was requested (the caller synchronizes).
            MLXNotebookError: Bad input found while preparing.
            RuntimeError: An MLX error.
        """
        if request.stop or request.logprobs or make_sampler(request).processors:
            raise InvalidArgumentError(
                "Engine.run is the one-generation loop from before batching: it has no stop strings, "
                "log-probabilities or logits processors; submit the request to a Worker"
            )
        start = time.perf_counter()
        mx.reset_peak_memory()
        with mx.stream(self.stream):
            sink.set_state(State.LOADING)
            loaded = self.store.get(
                request.model, pace, progress=lambda done, total, step: sink.progress(f"load: {step}", done, total)
            )
            sink.stats.load_s = time.perf_counter() - start
            sink.set_state(State.PREFILLING)
            prompt = prepare_prompt(loaded, request)
            sink.stats.prompt_tokens = len(prompt)
            pace.checkpoint()
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(loaded.model)
            with wired_limit(loaded.model, self.stream):
                prefill_start = time.perf_counter()
                prefill(loaded, cache, prompt, pace=pace, sink=sink)
                return decode(
                    loaded, cache, prompt, request, pace=pace, sink=sink, start=start, prefill_start=prefill_start
                )


def decode(
    loaded: LoadedModel,
    cache: list[Any],
    prompt: list[int],
    request: GenerationRequest,
    *,
    pace: Pace,
    sink: Sink,
    start: float,
    prefill_start: float,
) -> FinishReason:
    """Generate token by token; return why it ended.

    Like mlx-lm, the next step's graph is built while the device computes the
    current token. Whether that step is also queued on the device before the
    current token is read (two steps in flight, mlx-lm's pipelining) depends
    on the budget: a stop that lands while the worker waits for a token waits
    for the queued step too, so the second step is queued only while two
    steps fit ``DECODE_PIPELINE_SHARE`` of the budget. Otherwise it is submitted
    once the current token is read (at once when no stop or pause is waiting,
    after the checkpoint when one is), and a stop waits for at most one step.
    """
    model = loaded.model
    sample = make_sampler(request)
    eos = set(loaded.tokenizer.eos_token_ids)
    detokenizer = loaded.tokenizer.detokenizer
    detokenizer.reset()
    stats = sink.stats

    def step(inputs: mx.array) -> mx.array:
        logits = model(inputs[None], cache=cache)[:, -1, :]
        return sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    y = step(mx.array(prompt[-1:], dtype=mx.uint32))
    mx.async_eval(y)
    # One step in flight until a step time is measured.
    stats.decode_in_flight = 1
    first_token_at: float | None = None
    last_token_at = 0.0
    finish = FinishReason.LENGTH
    n = 0
    while True:
        next_y = step(y) if n + 1 < request.max_tokens else None
        pipelined = stats.decode_in_flight == 2
        if next_y is not None and pipelined:
            # Queued before this token is read: the device works while Python
            # detokenizes and checks the token.
            mx.async_eval(next_y)
        tok = cast(int, y.item())  # a token id
        now = time.perf_counter()
        queued = pipelined
        if next_y is not None and not queued and tok not in eos and not pace.requested:
            # No stop or pause waiting: queue the next step now, before this
            # token's bookkeeping, so the device idles only while it is encoded.
            mx.async_eval(next_y)
            queued = True
        n += 1
        if first_token_at is None:
            first_token_at = now
            stats.ttft_s = now - start
            stats.prompt_tps = len(prompt) / max(now - prefill_start, 1e-9)
            sink.set_state(State.DECODING)
            sink.progress("prefill", len(prompt), len(prompt))
        else:
            _measure_step(stats, now - last_token_at, pace.budget_s)
        last_token_at = now
        if tok in eos:
            finish = FinishReason.EOS
            break
        detokenizer.add_token(tok)
        stats.generated_tokens = n
        if n > 1:
            stats.generation_tps = (n - 1) / max(now - first_token_at, 1e-9)
        if n % 32 == 1:
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        sink.emit([tok], detokenizer.last_segment)
        if next_y is None:
            break
        if n % 256 == 0:
            mx.clear_cache()
        pace.checkpoint()
        if not queued:
            mx.async_eval(next_y)
        y = next_y
    detokenizer.finalize()
    tail = detokenizer.last_segment
    if tail:
        sink.emit([], tail)
    stats.finish_reason = finish
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return finish


def _measure_step(stats: GenerationStats, seconds: float, budget_s: float) -> None:
    """Update the decode step time and choose how many steps to keep in flight."""
    step = stats.decode_step_s = decode_pacing.smoothed_step(stats.decode_step_s, seconds)
    stats.decode_in_flight = decode_pacing.steps_in_flight(step, budget_s)
    stats.budget_below_step = step > budget_s
