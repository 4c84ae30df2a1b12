"""One generation on every rank: prefill and decode in budget-sized pieces, every decision agreed.

The engine takes decisions from each process's own clock: the next chunk
size (a cost model fitted to measured chunk times), the layer-group size,
whether a second decode step is queued before a token is read. Over ranks
that would deadlock, since a sharded forward pass runs collectives: chunks of
64 tokens on one rank and 96 on another never meet. So the prefill is the
engine's own loop (:func:`mlx_notebook.generation.prefill.prefill`) run with
an :class:`~.agreement.AgreedPace`, whose ``agree`` and ``choose`` take rank
0's proposals in the checkpoint's own collective; decode here queues the same
steps on every rank whatever its clock says. So every rank runs the same
shapes and stops, pauses or resumes at the same boundary.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import time
from typing import Any, cast

import mlx.core as mx

from ..budget import STEP_EMA
from ..generation.prefill import Sink, prefill
from ..generation.sampling import make_sampler
from ..generation.states import State
from ..generation.stats import FinishReason
from ..loading.store import LoadedModel
from .agreement import AgreedPace
from .protocol import Job


def run_job(loaded: LoadedModel, job: Job, *, pace: AgreedPace, sink: Sink) -> FinishReason:
    """Prefill ``job.prompt`` and decode; every rank calls this with the same job.

    Raises:
        Cancelled: An agreed stop (every rank raises at the same boundary).
    """
    from mlx_lm.models.cache import make_prompt_cache

    start = time.perf_counter()
    sink.set_state(State.PREFILLING)
    sink.stats.prompt_tokens = len(job.prompt)
    cache = make_prompt_cache(loaded.model)
    prefill(loaded, cache, job.prompt, pace=pace, sink=sink)
    return decode(loaded, cache, job, pace=pace, sink=sink, prefill_start=start)


def decode(
    loaded: LoadedModel, cache: list[Any], job: Job, *, pace: AgreedPace, sink: Sink, prefill_start: float
) -> FinishReason:
    """Generate token by token, with one agreement per token.

    Step ``n + 1`` is queued as soon as token ``n`` is read, and the graph of
    step ``n + 2`` is built while it runs; then the ranks agree. The
    agreement's collective runs on the same stream, after step ``n + 1``, so
    it returns once that step is done on every rank: the device idles only
    for the collective's round trip, and a stop or pause finds exactly one
    finished step and nothing queued, the same on every rank (a stop waits
    for at most one step plus one collective).
    """
    model = loaded.model
    max_tokens = job.request.max_tokens
    # The local engine's sampler: its filters, logits processors and own key, so every
    # rank (same seed, same logits) draws the token a single process draws.
    sample = make_sampler(job.request)
    fed = list(job.prompt)  # what the logits processors look back at (prompt, then tokens read)
    generated: list[int] = []
    sample.follow(loaded.tokenizer, job.prompt, generated)  # a thinking budget counts the row's tokens
    eos = set(loaded.tokenizer.eos_token_ids)
    detokenizer = loaded.tokenizer.detokenizer if pace.leader else None
    if detokenizer is not None:
        detokenizer.reset()
    stats = sink.stats
    stats.decode_in_flight = 1

    def step(inputs: mx.array, pending: bool) -> mx.array:
        logits = model(inputs[None], cache=cache)[:, -1, :]
        if sample.processors:
            # As DecodeBatch's rows: the last tokens before the predicted one, ``inputs`` among
            # them when it is a step's token not read yet.
            known = mx.array(fed[-sample.context :], dtype=mx.uint32)
            context = mx.concatenate([known, inputs])[-sample.context :] if pending else known
            logits = sample.process(context, logits, pending=pending)
        return sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    y = step(mx.array(job.prompt[-1:], dtype=mx.uint32), pending=False)
    mx.async_eval(y)
    next_y = step(y, pending=True) if max_tokens > 1 else None
    first_at: float | None = None
    last_at = 0.0
    finish = FinishReason.LENGTH
    n = 0
    while True:
        tok = cast(int, y.item())
        fed.append(tok)
        generated.append(tok)
        if next_y is not None:
            mx.async_eval(next_y)
        now = time.perf_counter()
        n += 1
        if first_at is None:
            first_at = now
            stats.ttft_s = now - prefill_start
            stats.prompt_tps = len(job.prompt) / max(now - prefill_start, 1e-9)
            sink.set_state(State.DECODING)
            sink.progress("prefill", len(job.prompt), len(job.prompt))
        else:
            seconds = now - last_at
            prev = stats.decode_step_s
            stats.decode_step_s = seconds if prev is None else (1 - STEP_EMA) * prev + STEP_EMA * seconds
            stats.budget_below_step = stats.decode_step_s > pace.budget_s
        last_at = now
        if tok in eos:
            finish = FinishReason.EOS
            break
        stats.generated_tokens = n
        if n > 1:
            stats.generation_tps = (n - 1) / max(now - first_at, 1e-9)
        if detokenizer is not None:
            detokenizer.add_token(tok)
            sink.emit([tok], detokenizer.last_segment)
        if next_y is None:
            break
        if n % 256 == 0:
            mx.clear_cache()
        following = step(next_y, pending=True) if n + 2 <= max_tokens else None
        pace.agree()
        y, next_y = next_y, following
    if detokenizer is not None:
        detokenizer.finalize()
        tail = detokenizer.last_segment  # read once: reading it moves the segment's start
        if tail:
            sink.emit([], tail)
    stats.finish_reason = finish
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return finish
