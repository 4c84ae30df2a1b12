"""Continuous batching and prompt-prefix reuse against plain mlx-lm, in one run.

Usage::

    python -m benchmarks.batching --model default --batch 4 --out benchmarks/results/batching_cpu.json
    python -m benchmarks.batching --synthetic llama3-8b --batch 8 --budget 0.01 \
        --join-length 8192 --out benchmarks/results/h200_batching.json   # on an NVIDIA machine

What it measures (EOS off, so every run decodes the same number of tokens):

* solo: decode tok/s of one generation through the worker (a batch of one)
  and through the pre-batching engine loop (``Engine.run``: "today's"), alternated;
* together: wall time of ``--batch`` generations submitted together against
  the same ones one after another (submit, wait, next), alternated, greedy:
  the user's view of batching, and whether each row's tokens equal its solo
  run's;
* batch: aggregate decode tok/s of ``--batch`` concurrent generations (counted
  over the window where all of them decode), against one generation and
  against mlx-lm's ``BatchGenerator`` on the same prompts; greedy agreement of
  every row with its solo run;
* stop of one row while the others decode (``cancel()`` to ``wait()``), p50/p99,
  against the batched step time;
* stop of a prompt whose tokens all come from the prefix cache
  (``--join-length`` tokens), 0-20 ms after its submit;
* the others' longest gap between two tokens while a ``--join-length`` prompt
  joins, against the budget and the step time;
* every row stopped at once 0-2 steps after a ``--join-length`` prompt joined
  (``--join-stop-rounds`` rounds), each row's ``cancel()`` to its end;
* prefix reuse: a ``--prefix-length`` prompt, then the same with its last
  sentence changed: time to first token cold vs warm, same tokens.

It runs the defaults as shipped: no ``MLX_NOTEBOOK_BATCH`` is set here (set it
outside to measure an override), and ``mlx_notebook`` is imported before
``mlx`` so that the CPU's OpenBLAS fast path is what users get. The result
records both (``batch_decode``, ``blas``). An earlier version imported ``mlx``
first: OpenBLAS was never loaded, the default model stayed Q4_1, and MLX's
quantized CPU matmul costs about B times one row for B rows (the 1.07x of
``batching_cpu_default.json``; ``benchmarks/batch_step.py`` measures it).
"""

from __future__ import annotations

import mlx_notebook  # isort: skip  (before mlx: OpenBLAS must be loaded first)

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.bench import SYNTHETIC, gpu_state, open_model, percentile, prompt_ids, save
from benchmarks.solo_engine import Engine
from mlx_notebook.control import unpaced
from mlx_notebook.generation import fused_projections, prefill_thread, skinny_matmul, warm_up
from mlx_notebook.generation.handle import Generation, Reporter
from mlx_notebook.generation.request import GenerationRequest
from mlx_notebook.loading.policy import batch_decode

# The longest any wait here lasts (a 32k prefill of an 8B shape on a slow host is minutes): a hang fails, it does
# not hold a device call or the smoke tests until their own limits.
WAIT_S = 1800.0


class TokenClock:
    """Times of every token of a set of generations (listener).

    Only events that bring tokens count: a generation's end flushes text held
    back (a possible tag's start) as a "tokens" event with none, and counting
    that one made a row's "gap" run to its stop at the end of the join
    benchmark (62-130 ms read as the others' longest gap on an H200).
    """

    def __init__(self, gens: list[Generation]) -> None:
        self.times: dict[int, list[float]] = {g.id: [] for g in gens}
        self._seen = {g.id: 0 for g in gens}
        for g in gens:
            g.add_listener(self)

    def __call__(self, event) -> None:
        if event.kind != "tokens":
            return
        gen = event.generation
        count = len(gen.tokens)
        if count > self._seen[gen.id]:
            self._seen[gen.id] = count
            self.times[gen.id].append(time.perf_counter())


def aggregate_tps(times: list[list[float]]) -> float:
    """Tokens per second while every sequence decodes (from the last first token to the first last one).

    Rows that join one after the other (continuous batching) also run with
    fewer rows at the start and the end; that is in ``wall_s``, not here.
    """
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    if end <= start:
        return 0.0  # the rows never decoded at the same time
    n = sum(sum(1 for x in t if start < x <= end) for t in times)
    return n / max(end - start, 1e-9)


def ours_batch(worker, name, prompts, max_tokens, budget):
    t0 = time.perf_counter()
    gens = [
        mlx_notebook.generate(p, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget) for p in prompts
    ]
    clock = TokenClock(gens)
    for g in gens:
        g.result(timeout=WAIT_S)
    wall = time.perf_counter() - t0
    return aggregate_tps([clock.times[g.id] for g in gens]), [g.tokens for g in gens], wall


def mlx_lm_batch(worker, name, prompts, max_tokens):
    """mlx-lm's BatchGenerator on the worker thread and stream."""
    from mlx_lm.generate import BatchGenerator

    def job(store):
        t0 = time.perf_counter()
        loaded = store.get(name)
        # mlx-lm's side runs MLX's own matmuls and separate projections, not the worker's kernel and fusion.
        with skinny_matmul.unpatched(loaded.model), fused_projections.unfused(loaded.model):
            gen = BatchGenerator(
                loaded.model, stop_tokens=None, stream=worker.stream, completion_batch_size=len(prompts)
            )
            uids = gen.insert(prompts, [max_tokens] * len(prompts))
            times = {u: [] for u in uids}
            tokens = {u: [] for u in uids}
            while responses := gen.next_generated():
                now = time.perf_counter()
                for r in responses:
                    times[r.uid].append(now)
                    tokens[r.uid].append(r.token)
            gen.close()
        return aggregate_tps([times[u] for u in uids]), [tokens[u] for u in uids], time.perf_counter() - t0

    return worker.call(job)


def todays_engine(worker, name, ids, max_tokens, budget):
    """The engine's own solo loop (``Engine.run``), as before batching."""
    request = GenerationRequest(ids, model=name, max_tokens=max_tokens, stop_budget=budget)
    gen = Generation(request, on_cancel=lambda g: None)
    clock = TokenClock([gen])

    def job(store):
        Engine(store, worker.stream).run(request, unpaced(budget), Reporter(gen))

    worker.call(job)
    t = clock.times[gen.id]
    return (len(t) - 1) / (t[-1] - t[0]), gen.tokens


def solo_rows(worker, name, prompts, max_tokens, budget):
    out = []
    for p in prompts:
        gen = mlx_notebook.generate(
            p, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget, max_batch=1
        )
        clock = TokenClock([gen])
        gen.result(timeout=WAIT_S)
        t = clock.times[gen.id]
        out.append(((len(t) - 1) / (t[-1] - t[0]), gen.tokens))
    return out


def together_vs_sequential(worker, name, prompts, max_tokens, budget, repeats, solo):
    """Wall time of the prompts submitted together against one after another, alternated."""
    together, sequential, equal, batch_sizes = [], [], [], []
    for r in range(repeats):
        for who in ["together", "sequential"] if r % 2 == 0 else ["sequential", "together"]:
            t0 = time.perf_counter()
            if who == "together":
                gens = [
                    mlx_notebook.generate(p, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget)
                    for p in prompts
                ]
                for g in gens:
                    g.result(timeout=WAIT_S)
                together.append(time.perf_counter() - t0)
                equal.append(sum(g.tokens == s[1] for g, s in zip(gens, solo)))
                batch_sizes.append(max(g.stats.batch_size for g in gens))
            else:
                for p in prompts:
                    mlx_notebook.generate(
                        p, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget
                    ).result(timeout=WAIT_S)
                sequential.append(time.perf_counter() - t0)
    seq, tog = statistics.median(sequential), statistics.median(together)
    return {
        "tokens_each": max_tokens,
        "together_wall_s": tog,
        "one_after_another_wall_s": seq,
        "speedup": seq / tog,
        "largest_batch": min(batch_sizes),
        "rows_equal_to_solo": f"{min(equal)}/{len(prompts)} (worst of {len(equal)})",
    }


def cached_stop_rounds(worker, name, ids, budget, rounds, rng, trace=False):
    """Stop a prompt whose tokens all come from the prefix cache, 0-20 ms after its submit.

    With ``trace``, a round over the budget keeps what the worker did from its submit to its end.
    """
    worker.prompt_cache_gb = 64
    tracer = CachedTrace()
    try:
        warm = mlx_notebook.generate(ids, model=name, worker=worker, max_tokens=4, stop_budget=budget)
        warm.result(timeout=WAIT_S)
        again = mlx_notebook.generate(ids, model=name, worker=worker, max_tokens=4, stop_budget=budget)
        again.result(timeout=WAIT_S)
        latencies, states, detail = [], {}, []
        for _ in range(rounds):
            tracer.events.clear()
            with GcPauses() as pauses, tracer if trace else contextlib.nullcontext():
                t_submit = time.perf_counter()
                gen = mlx_notebook.generate(ids, model=name, worker=worker, max_tokens=100_000, stop_budget=budget)
                delay = rng.uniform(0.0, 0.02)
                time.sleep(delay)
                state = str(gen.state)
                t0 = time.perf_counter()
                gen.cancel()
                gen.wait()
                t1 = time.perf_counter()
            latencies.append(t1 - t0)
            states[state] = states.get(state, 0) + 1
            detail.append(
                {
                    "delay_ms": round(1000 * delay, 2),
                    "state": state,
                    "tokens": len(gen.tokens),
                    "ms": round(1000 * latencies[-1], 2),
                    "longest_gc_ms": round(1000 * pauses.longest, 2),
                }
            )
            if trace and latencies[-1] > budget:
                detail[-1]["trace"] = [f"cancel at {1000 * (t0 - t_submit):+.1f}"] + tracer.around(t_submit, t1)
    finally:
        worker.prompt_cache_gb = 0
    return {
        "prompt_tokens": len(ids),
        "cached_tokens": again.stats.cached_tokens,
        "warm_ttft_s": again.stats.ttft_s,
        "p50": 1000 * percentile(latencies, 50),
        "p99": 1000 * percentile(latencies, 99),
        "max": 1000 * max(latencies),
        "rounds": len(latencies),
        "state_at_stop": states,
        "rounds_detail": detail,
        "first_step": {
            "warm_ttft_ms": 1000 * again.stats.ttft_s,
            "decode_step_ms": 1000 * (again.stats.decode_step_s or 0),
        },
    }


def wait_decoding(gens, n=2):
    deadline = time.perf_counter() + WAIT_S
    while any(len(g.tokens) < n and not g.finished for g in gens):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"rows without {n} tokens after {WAIT_S:.0f} s: {[len(g.tokens) for g in gens]}")
        time.sleep(0.0005)


def wait_ended(gen):
    if not gen.wait(WAIT_S):
        raise TimeoutError(f"generation #{gen.id} still {gen.state} {WAIT_S:.0f} s after its stop")


def stop_one_rounds(worker, name, prompts, budget, rounds, rng, options=None, detail=None, gil=None):
    """Latencies of stopping one row while the others decode, and the batch's step times.

    ``options``: more keyword arguments of every row's ``generate`` (e.g. ``schema=``: the
    rows must still decode ~0.2 s after they all started, so a constraint's value must be long).
    ``detail``: a list that gets one dict per round (where the latency went); ``gil``: a
    :class:`benchmarks.bench.GilSampler` whose longest hold in each stop goes there too.
    """
    latencies, steps, worker_side = [], [], []
    early = 0
    for _ in range(rounds):
        gens = [
            mlx_notebook.generate(
                p, model=name, worker=worker, max_tokens=100_000, stop_budget=budget, **(options or {})
            )
            for p in prompts
        ]
        clock = TokenClock(gens)
        wait_decoding(gens)
        time.sleep(rng.uniform(0.0, 0.2))
        victim = rng.choice(gens)
        ended: list[float] = []
        victim.add_listener(lambda e: ended.append(time.perf_counter()) if e.kind == "state" else None)
        state = str(victim.state)
        t0 = time.perf_counter()
        victim.cancel()
        t1 = time.perf_counter()
        victim.wait()
        t2 = time.perf_counter()
        latencies.append(t2 - t0)
        worker_side.append(victim.stats.stop_latency_s or 0.0)
        if detail is not None:
            detail.append(
                {
                    "ms": round(1000 * (t2 - t0), 3),
                    "in_cancel_ms": round(1000 * (t1 - t0), 3),
                    "worker_side_ms": round(1000 * (victim.stats.stop_latency_s or 0.0), 3),
                    "longest_gil_ms": round(gil.longest_ms(t0, t2), 3) if gil is not None else None,
                    "state": state,
                    "tokens": len(victim.tokens),
                }
            )
        # Reported before any other row got a token after the stop: it did not wait for the step.
        early += all(not (t0 < x < ended[-1]) for g in gens if g is not victim for x in clock.times[g.id])
        assert all(not g.finished for g in gens if g is not victim), "a stop ended another row"
        assert max(g.stats.batch_size for g in gens) == len(gens), "the rows did not decode together"
        for g in gens:
            g.cancel()
        for g in gens:
            wait_ended(g)
        t = clock.times[gens[0].id]
        steps += [b - a for a, b in zip(t, t[1:]) if b < t0]
    return latencies, steps, worker_side, early


class GcPauses:
    """Longest Python garbage collection while the block runs (it holds the GIL: a gap for every thread)."""

    def __enter__(self):
        self.longest, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._t0)

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)


class Trace:
    """What the worker did between two batch steps (``--trace``): wraps a few library calls."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        events = self.events

        def traced(*args, **kwargs):
            # "p:" marks the prefill thread's calls (a prompt joining beside the others' steps).
            name = ("p:" if threading.current_thread().name == "mlx-notebook-prefill" else "") + label
            events.append((time.perf_counter(), name + ">"))
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                # A label ending in "?" tells what the call gave: a list's length (e.g. reserved buffers), else whether any.
                given = len(result) if isinstance(result, list) else result is not None
                events.append((time.perf_counter(), name + ("<" if not name.endswith("?") else f"<{given}")))

        setattr(owner, attr, traced)
        self._undo.append((owner, attr, original))

    def __enter__(self):
        from mlx_notebook.generation import (
            batch_cache,
            decode_batch,
            device_turns,
            kv_capacity,
            pieces,
            prefill,
            session,
        )

        self.wrap(decode_batch.DecodeBatch, "step", "step")
        self.wrap(decode_batch.DecodeBatch, "_admit", "admit")
        self.wrap(decode_batch.DecodeBatch, "_evaluate", "read")
        self.wrap(decode_batch.DecodeBatch, "_take_out", "take_out")
        self.wrap(pieces.LayerRunner, "run", "chunk")
        self.wrap(pieces.ChunkRunner, "run", "chunk")
        self.wrap(pieces.LayerRunner, "_hook", "hook")
        self.wrap(session.Session, "between", "between")
        self.wrap(prefill.mx, "clear_cache", "clear_cache")
        self.wrap(session, "prepare_prompt", "prepare")
        self.wrap(batch_cache, "extend", "extend")
        self.wrap(session.Session, "_keep_prefix", "keep_prefix")
        self.wrap(device_turns.DeviceTurns, "side_checkpoint", "turn")
        self.wrap(decode_batch.DecodeBatch, "_forward", "fwd")
        self.wrap(decode_batch.DecodeBatch, "_queue", "queue")
        self.wrap(kv_capacity, "make_room", "room")
        self.wrap(decode_batch.DecodeBatch, "_leave", "leave")  # a row that left for good (the joiner's end)
        self.wrap(batch_cache, "extract", "extract")
        self.wrap(batch_cache, "keep_rows", "keep")
        if os.environ.get("TRACE_ADMIT"):
            # Where an admit's and the first joined step's host time goes (session 36: 24 ms in the admit's queue).
            self.wrap(batch_cache.Reserve, "take", "take?")
            self.wrap(batch_cache, "_joined", "joined")
            self.wrap(decode_batch.DecodeBatch, "_change_rows", "change")
            self.wrap(decode_batch.DecodeBatch, "_poll_parked", "parked")
            self.wrap(decode_batch.DecodeBatch, "add", "add")  # the joined row's own host work (session 39)
            self.wrap(decode_batch.mx, "async_eval", "aeval")
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)

    def around(self, t0: float, t1: float) -> list[str]:
        return [f"{1000 * (t - t0):+.1f} {label}" for t, label in self.events if t0 - 0.001 <= t <= t1 + 0.001]


class JoinTurns:
    """The device turns of the prompts that joined inside the block (the library's own counts, kept at no cost)."""

    def __init__(self) -> None:
        self.counts: list = []

    def __enter__(self):
        from mlx_notebook.generation import device_turns

        self._cls = device_turns.DeviceTurns
        original = self._original = self._cls.close
        counts = self.counts

        def close(turns):
            counts.append(dataclasses.replace(turns.counts))
            original(turns)

        self._cls.close = close
        return self

    def __exit__(self, *exc):
        self._cls.close = self._original

    def summary(self) -> dict | None:
        """The last join's counts, times in ms; ``None`` where the prompt was prefilled on the worker itself."""
        if not self.counts:
            return None
        counts = dataclasses.asdict(self.counts[-1])
        return {
            k[:-2] + "_ms" if k.endswith("_s") else k: round(1000 * v, 3) if k.endswith("_s") else v
            for k, v in counts.items()
        }


class CachedTrace(Trace):
    """What the worker did while a cached prompt started and stopped (``--trace``)."""

    def __enter__(self):
        from mlx_notebook import control
        from mlx_notebook.generation import pieces, prefix_cache, session

        self.wrap(session, "restore", "restore")
        self.wrap(session, "prefill", "prefill")
        self.wrap(session, "prepare_prompt", "prepare")
        self.wrap(prefix_cache.PromptCache, "fetch", "fetch")
        self.wrap(prefix_cache.PromptCache, "store", "store")
        self.wrap(prefix_cache.PromptCache, "prune", "prune")
        self.wrap(pieces.LayerRunner, "_hook", "hook")
        self.wrap(pieces.LayerRunner, "logits", "logits")
        self.wrap(control.Pace, "checkpoint", "checkpoint")
        self.wrap(control.CancelToken, "mark_stopped", "mark_stopped")
        self.wrap(session.Session, "_synchronize_quietly", "sync")
        self.wrap(session.Session, "_keep_prefix", "keep_prefix")
        self.wrap(session.Session, "_end", "end")
        self.wrap(session.mx, "eval", "eval")
        return self


class Durations:
    """Seconds spent in each call of a few library functions while the block runs (``--profile``)."""

    def __init__(self, targets: list[tuple[object, str]]) -> None:
        self.targets = targets
        self.calls: dict[str, list[tuple[float, float]]] = {}
        self._undo: list = []

    def __enter__(self):
        for owner, attr in self.targets:
            original = getattr(owner, attr)
            spans = self.calls.setdefault(attr, [])

            def timed(*args, _original=original, _spans=spans, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    _spans.append((t0, time.perf_counter()))

            setattr(owner, attr, timed)
            self._undo.append((owner, attr, original))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)

    def medians_ms(self) -> dict:
        return {k: round(1000 * statistics.median(b - a for a, b in v), 3) for k, v in self.calls.items() if v}

    def totals_ms(self) -> dict:
        return {k: round(1000 * sum(b - a for a, b in v), 1) for k, v in self.calls.items()}


def step_profile(worker, name, prompts, max_tokens, budget):
    """Where a batched step's time goes on the worker: Python parts, queueing steps (`_queue`), the read."""
    from mlx_notebook.generation.decode_batch import DecodeBatch

    parts = ["step", "_forward", "_queue", "_report", "_change_rows"]
    with Durations([(DecodeBatch, p) for p in parts]) as d:
        gens = [
            mlx_notebook.generate(p, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget)
            for p in prompts
        ]
        for g in gens:
            g.result(timeout=WAIT_S)
    steps = d.calls["step"][len(prompts) :]  # decoding together
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    return {
        "median_ms": d.medians_ms(),
        "between_steps_ms": round(1000 * statistics.median(gaps), 3),
        "step_period_ms": round(1000 * statistics.median(b[0] - a[0] for a, b in zip(steps, steps[1:])), 3),
    }


def join_gap(worker, name, prompts, join_ids, budget, trace=False, after_tokens=12, quiet_s=0.0):
    """Others' longest inter-token gap while a long prompt prefills and joins, and where it fell.

    The joiner decodes ``after_tokens`` tokens with the others, so the window
    ends with steps at the joined size. Those are longer than the ones before
    the join (on the CPU every row attends over the joiner's length; on CUDA
    the rows attend in groups of one padding, yet session 42's H200 paid
    1.0-2.1x), so "budget + 2 steps" is given for both.

    The others' gap over the joiner's leave (its last token, then the batch
    drops its row) is a row leaving, not the join: it is reported apart
    (``others_leave_gap_ms``), and the others are cancelled only once each
    has its token after it. Counted with the join, it read as a 16-2,132 ms
    "join" gap on session 43's H100, with the joiner decoding 48 tokens.

    ``quiet_s``: the others decode that long alone before the join, and
    their longest gap then is reported (``others_quiet_gaps_ms``): the
    machine's own hiccups, the yardstick for a long join gap. Session 54's
    H100 missed 22 of 26 joins, the gaps past the bound after the join (no
    prompt's thread running) in 8 of them, its steps 8-16 ms where session
    53's were 8-9.
    """
    gens = [
        mlx_notebook.generate(p, model=name, worker=worker, max_tokens=100_000, stop_budget=budget) for p in prompts
    ]
    clock = TokenClock(gens)
    wait_decoding(gens, 8)
    t_quiet = time.perf_counter()
    time.sleep(quiet_s)  # a window measured, not an event waited for
    tracer = Trace()
    with GcPauses() as pauses, tracer if trace else contextlib.nullcontext(), JoinTurns() as turns:
        joiner = mlx_notebook.generate(join_ids, model=name, worker=worker, max_tokens=after_tokens, stop_budget=budget)
        jclock = TokenClock([joiner])
        t_join = time.perf_counter()
        joiner.result(timeout=WAIT_S)
        t_last = jclock.times[joiner.id][-1] + 0.002  # a token after this came after the joiner left
        deadline = time.perf_counter() + 30
        while any(not g.finished and clock.times[g.id][-1] <= t_last for g in gens):
            if time.perf_counter() > deadline:
                raise TimeoutError("the others got no token in 30 s after the joiner left")
            time.sleep(0.0005)
    for g in gens:
        g.cancel()
    for g in gens:
        wait_ended(g)
    t_first = jclock.times[joiner.id][0]  # the joiner's first token: its prefill is over, its row admitted
    steps, spans, after = [], [], []
    by_index: list[list[float]] = []  # the others' gaps after the admit, by their order: a cost that fades, or stays
    admit: tuple[float, float, float] | None = None  # the admit's longest gap, (gap, from, to)
    leave: tuple[float, float, float] | None = None  # the longest over the joiner's leave
    where: dict[str, float] = {"prefill": 0.0, "admit": 0.0, "after": 0.0, "leave": 0.0}
    for g in gens:
        t = clock.times[g.id]
        before = [b - a for a, b in zip(t, t[1:]) if b < t_join]
        steps += before[-8:]
        k = 0
        for a, b in zip(t, t[1:]):
            if b < t_join or a > t_last:
                continue
            if b > t_last:  # over the joiner's leave
                where["leave"] = max(where["leave"], b - a)
                if leave is None or b - a >= leave[0]:
                    leave = (b - a, a, b)
                continue
            spans.append((b - a, a, b))
            # The admit step's tokens are reported with the joiner's first, just before or after it (the rows'
            # order): a gap that ends within 2 ms of it, or spans it, is the admit's.
            phase = "admit" if abs(b - t_first) < 0.002 or a < t_first < b else "prefill" if b < t_first else "after"
            where[phase] = max(where[phase], b - a)
            if phase == "admit" and (admit is None or b - a >= admit[0]):
                admit = (b - a, a, b)
            if phase == "after":
                after.append(b - a)
                if k == len(by_index):
                    by_index.append([])
                by_index[k].append(b - a)
                k += 1
    gaps = [gap for gap, _, _ in spans]
    quiet = sorted(
        b - a for g in gens for a, b in zip(clock.times[g.id], clock.times[g.id][1:]) if t_quiet <= a and b < t_join
    )
    # The prefill's gaps of the first row (the others' are the same steps): a long one alone, or the common run.
    first_row = clock.times[gens[0].id]
    in_prefill = [(b - a, b - t_join) for a, b in zip(first_row, first_row[1:]) if t_join < b < t_first]
    prefill_gaps = sorted(gap for gap, _ in in_prefill)
    # The prefill phase's last gap: the joining row merges (the admit ahead) beside the others' step in it. On a
    # quiet H100 (session 56) it was a first join's longest in 6 of 8.
    before_admit = [span for span in spans if span[2] <= t_first - 0.002]  # ends 2 ms or more before: not the admit's
    pre_admit = max(before_admit, key=lambda span: span[2]) if before_admit else None
    step = statistics.median(steps)
    step_after = statistics.median(after[-8 * len(gens) :]) if after else float("nan")
    if trace:
        # The three longest, each from the token before it: one gap can be a cause of its own, three show a pattern.
        shown: list[float] = []
        for gap, a, b in sorted(spans, reverse=True):
            if len(shown) == 3:
                break
            if any(abs(a - t) < 0.002 for t in shown):
                continue  # the same gap of another row
            shown.append(a)
            print(f"gap {1000 * gap:.1f} ms:", " | ".join(tracer.around(a, b)), flush=True)
        if pre_admit is not None:  # the prefill's last, where the admit ahead runs beside their step
            print(f"pre-admit gap {1000 * pre_admit[0]:.1f} ms:", " | ".join(tracer.around(*pre_admit[1:])), flush=True)
        if admit is not None:  # the admit's own, longest or not
            print(f"admit gap {1000 * admit[0]:.1f} ms:", " | ".join(tracer.around(*admit[1:])), flush=True)
        if leave is not None:
            print(f"leave gap {1000 * leave[0]:.1f} ms:", " | ".join(tracer.around(*leave[1:])), flush=True)
    return {
        "join_length": len(join_ids),
        "joiner_prefill_s": joiner.stats.ttft_s,
        "others_max_gap_ms": 1000 * max(gaps),
        "others_p99_gap_ms": 1000 * percentile(gaps, 99),
        "longest_gc_ms": 1000 * pauses.longest,
        "others_max_gap_by_phase_ms": {k: round(1000 * v, 2) for k, v in where.items() if k != "leave"},
        "others_prefill_gaps_ms": {
            "count": len(prefill_gaps),
            "p50": round(1000 * statistics.median(prefill_gaps), 1) if prefill_gaps else None,
            "longest": [round(1000 * g, 1) for g in prefill_gaps[::-1][:5]],
            # Where they fell (ms from the join's submit to the gap's end; the joiner's first token at
            # joiner_prefill_s): a process's first uses early on, or a chunk's new shape anywhere.
            "longest_at_ms": [round(1000 * at) for _, at in sorted(in_prefill, reverse=True)[:5]],
            "first": [round(1000 * gap, 1) for gap, _ in in_prefill[:4]],
        },
        "others_pre_admit_gap_ms": round(1000 * pre_admit[0], 2) if pre_admit is not None else None,
        "others_leave_gap_ms": round(1000 * where["leave"], 2),
        "others_quiet_gaps_ms": {
            "window_s": round(t_join - t_quiet, 3),
            "count": len(quiet),
            "p50": round(1000 * statistics.median(quiet), 1) if quiet else None,
            "longest": [round(1000 * g, 1) for g in quiet[::-1][:3]],
        },
        "others_step_ms": 1000 * step,
        "others_step_after_join_ms": 1000 * step_after,
        "others_steps_after_join_ms": [round(1000 * statistics.median(gaps), 2) for gaps in by_index],
        "budget_plus_2_steps_ms": 1000 * (budget + 2 * step),
        "budget_plus_2_steps_after_ms": 1000 * (budget + 2 * step_after),
        "turns": turns.summary(),
    }


def wait_for_ladder(loaded, limit_s=300.0):
    """Seconds until the idle worker's warm-up ladder has run every chunk of ``loaded`` (it runs only while idle).

    A notebook leaves the worker idle between loading a model and its prompts; a benchmark that goes
    straight on meets chunk shapes the ladder would have built (cuDNN graphs, tens of ms each).

    Waits for the worker's own word (``ladder_warmed``, set once :func:`warm_up.warm_ladder` returns), not for
    the chunks left to reach none: the last chunk is counted a moment before the worker is through with the
    ladder (its log, its ``mx.clear_cache``). Warmed with chunks left: the ladder failed (logged).
    """
    t0 = time.perf_counter()
    while not loaded.ladder_warmed:
        if time.perf_counter() - t0 > limit_s:
            raise TimeoutError(f"the warm-up ladder left {len(warm_up.ladder(loaded))} chunks after {limit_s:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def join_stop_rounds(worker, name, prompts, join_ids, budget, rounds, rng, trace=False):
    """Stop every row at once (the Stop of each, as an interrupt does) in the first steps after a prompt joined.

    The steps right after a join are the batch's least settled: the joiner's
    cache just merged, every row's attention over its length, the step after
    the change not timed (so not cut into groups by its own time). Each round
    lets rows decode, joins ``join_ids``, waits for the joiner's first token
    (its row admitted), then 0-2 of the others' steps, and cancels every row;
    each row's stop is timed from the first ``cancel()`` to its end reported.
    ``trace``: print what the worker did in the round whose last stop took longest.
    """
    latencies, steps, after_tokens, last_ms = [], [], [], []
    slowest: tuple[float, list[str]] = (-1.0, [])
    for _ in range(rounds):
        gens = [
            mlx_notebook.generate(p, model=name, worker=worker, max_tokens=100_000, stop_budget=budget) for p in prompts
        ]
        clock = TokenClock(gens)
        wait_decoding(gens, 4)
        t = clock.times[gens[0].id]
        step = statistics.median(b - a for a, b in zip(t, t[1:]))
        steps.append(step)
        joiner = mlx_notebook.generate(join_ids, model=name, worker=worker, max_tokens=100_000, stop_budget=budget)
        everyone = [*gens, joiner]
        ended: dict[int, float] = {}
        for g in everyone:
            g.add_listener(
                lambda e, _id=g.id: (
                    ended.setdefault(_id, time.perf_counter()) if e.kind == "state" and e.state.final else None
                )
            )
        deadline = time.perf_counter() + 600
        while not joiner.tokens and not joiner.finished:
            if time.perf_counter() > deadline:
                raise TimeoutError("the joining prompt gave no token in 600 s")
            time.sleep(0.0005)
        time.sleep(rng.uniform(0.0, 2 * step))
        after_tokens.append(len(joiner.tokens))
        tracer = Trace()
        with tracer if trace else contextlib.nullcontext():
            t0 = time.perf_counter()
            for g in everyone:
                g.cancel()
            for g in everyone:
                if not g.wait(timeout=60):
                    raise TimeoutError(f"a row did not stop in 60 s ({g.state})")
        round_ = [ended[g.id] - t0 for g in everyone]
        latencies += round_
        last_ms.append(round(1000 * max(round_), 2))
        if trace and max(round_) > slowest[0]:
            slowest = (max(round_), tracer.around(t0, t0 + max(round_)))
    if trace:
        print("slowest join stop:", " | ".join(slowest[1]), flush=True)
    step = statistics.median(steps)
    return {
        "rows": len(prompts) + 1,
        "join_length": len(join_ids),
        "rounds": rounds,
        "p50": 1000 * percentile(latencies, 50),
        "p99": 1000 * percentile(latencies, 99),
        "max": 1000 * max(latencies),
        "others_step_ms": 1000 * step,
        "max_budget_or_step_plus_30_ms": 1000 * (max(budget, step) + 0.03),
        "joiner_tokens_at_stop": after_tokens,
        "last_stop_of_each_round_ms": last_ms,
    }


def prefix_reuse(worker, name, vocab, length, budget, max_tokens):
    doc = prompt_ids(length, vocab, seed=7)
    first, second = doc + prompt_ids(24, vocab, seed=8), doc + prompt_ids(24, vocab, seed=9)
    worker.prompt_cache_gb = 0
    cold = mlx_notebook.generate(second, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget)
    cold.result(timeout=WAIT_S)
    worker.prompt_cache_gb = 4
    mlx_notebook.generate(first, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget).result(
        timeout=WAIT_S
    )
    from mlx_notebook.generation import session

    with Durations([(session, "restore"), (session, "prefill")]) as d:
        warm = mlx_notebook.generate(second, model=name, worker=worker, max_tokens=max_tokens, stop_budget=budget)
        warm.result(timeout=WAIT_S)
    worker.prompt_cache_gb = 0
    return {
        "prompt_tokens": len(second),
        "cached_tokens": warm.stats.cached_tokens,
        "cold_ttft_s": cold.stats.ttft_s,
        "warm_ttft_s": warm.stats.ttft_s,
        "warm_over_cold": warm.stats.ttft_s / cold.stats.ttft_s,
        "same_tokens": warm.tokens == cold.tokens,
        "warm_restore_and_prefill_ms": d.totals_ms(),
    }


QUESTIONS = [
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "Give three uses of Python in science.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet in two sentences.",
    "What is a prime number? Give an example.",
    "Suggest a name for a coffee shop by a river.",
    "How do vaccines train the immune system?",
]


def chat_prompts(worker, name: str, count: int) -> list[list[int]]:
    """``count`` short questions as a notebook sends them (the model's chat template), token ids."""
    from mlx_notebook.generation.prompt import prepare_prompt

    def job(store):
        loaded = store.get(name)
        return [
            prepare_prompt(loaded, GenerationRequest(QUESTIONS[i % len(QUESTIONS)], model=name)) for i in range(count)
        ]

    return worker.call(job)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC))
    ap.add_argument("--build-dir")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument(
        "--chat",
        action="store_true",
        help="prompts are short questions through the model's chat template (~36 tokens on SmolLM2), "
        "not --prompt-length random tokens",
    )
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument("--stop-rounds", type=int, default=20)
    ap.add_argument("--join-length", type=int, default=2048)
    ap.add_argument("--join-stop-rounds", type=int, default=6)
    ap.add_argument(
        "--join-after-tokens", type=int, default=12, help="tokens the joiner decodes with the others (the after window)"
    )
    ap.add_argument("--prefix-length", type=int, default=4000)
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of parts to skip: solo,together,batch,stop,profile,join,join_stop,cached_stop,prefix",
    )
    ap.add_argument(
        "--join-quiet",
        type=float,
        default=1.0,
        help="seconds the others decode alone before the join: their longest gap then is the machine's yardstick",
    )
    ap.add_argument("--trace", action="store_true", help="print what the worker did in the longest join gap")
    ap.add_argument(
        "--ladder-first",
        action="store_true",
        help="before the joins, leave the worker idle until its warm-up ladder is done (a notebook's pause after load)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    folder = Path(args.build_dir) if args.build_dir else Path(tempfile.mkdtemp())
    worker, name, vocab, load_s = open_model(args.model, args.synthetic, 0, folder)
    worker.prompt_cache_gb = 0  # repeated prompts must not hit the cache (but in the prefix part)
    result: dict = {
        "model": args.synthetic or args.model,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "batch": args.batch,
        "budget": args.budget,
        "command": " ".join(["python -m benchmarks.batching", *sys.argv[1:]]),
        "blas": mlx_notebook.active_blas(),
        "MLX_NOTEBOOK_BATCH": os.environ.get("MLX_NOTEBOOK_BATCH", "(unset: the default)"),
        "batch_decode": batch_decode(),
        "MLX_NOTEBOOK_PREFILL_THREAD": os.environ.get("MLX_NOTEBOOK_PREFILL_THREAD", "(unset: the default)"),
        "prefill_thread": prefill_thread.wanted(),
        "skinny_matmul": skinny_matmul.wanted(),
        "fused_projections": fused_projections.wanted(),
        "gpu_state": {"start": gpu_state()},
    }
    keys = (
        "device",
        "blas",
        "MLX_NOTEBOOK_BATCH",
        "batch_decode",
        "prefill_thread",
        "skinny_matmul",
        "fused_projections",
        "gpu_state",
    )
    print(
        json.dumps({k: result[k] for k in keys}),
        flush=True,
    )
    prompts = (
        chat_prompts(worker, name, args.batch)
        if args.chat
        else [prompt_ids(args.prompt_length, vocab, seed=i) for i in range(args.batch)]
    )
    result["prompt_tokens"] = [len(p) for p in prompts]
    n = args.decode_tokens
    ours_batch(worker, name, prompts, 8, args.budget)  # warm-up: kernels for both paths, every batch size
    mlx_lm_batch(worker, name, prompts, 8)
    if "solo" not in skip:
        ours_solo, today = [], []
        for r in range(args.repeats):
            for who in ["ours", "today"] if r % 2 == 0 else ["today", "ours"]:
                if who == "ours":
                    ours_solo.append(solo_rows(worker, name, prompts[:1], n, args.budget)[0][0])
                else:
                    today.append(todays_engine(worker, name, prompts[0], n, args.budget)[0])
        result["solo"] = {
            "batch_of_one_tps": statistics.median(ours_solo),
            "todays_engine_tps": statistics.median(today),
            "ratio": statistics.median(ours_solo) / statistics.median(today),
        }
        print(json.dumps(result["solo"]), flush=True)
        save(result, args.out)
    solo = solo_rows(worker, name, prompts, n, args.budget) if {"batch", "together"} - skip else []
    if "together" not in skip:
        result["together"] = together_vs_sequential(worker, name, prompts, n, args.budget, args.repeats, solo)
        print(json.dumps(result["together"]), flush=True)
        save(result, args.out)
    if "batch" not in skip:
        # One generation is timed in the same rounds as the batches (the host's speed moved up to 2x
        # within one H200 call), not only in the solo runs before them.
        ones, ours_tps, plain_tps, agree, ours_wall, plain_wall = [], [], [], [], [], []
        order = ["ours", "plain", "one"]
        for r in range(args.repeats):
            for who in order[r % 3 :] + order[: r % 3]:
                if who == "one":
                    ones.append(solo_rows(worker, name, prompts[:1], n, args.budget)[0][0])
                elif who == "ours":
                    tps, tokens, wall = ours_batch(worker, name, prompts, n, args.budget)
                    ours_tps.append(tps)
                    ours_wall.append(wall)
                    agree.append(sum(t == s[1] for t, s in zip(tokens, solo)))
                else:
                    tps, _, wall = mlx_lm_batch(worker, name, prompts, n)
                    plain_tps.append(tps)
                    plain_wall.append(wall)
        ours_med, plain_med = statistics.median(ours_tps), statistics.median(plain_tps)
        one_tps = statistics.median(ones)
        result["batched"] = {
            "one_generation_tps": one_tps,
            "one_generation_tps_solo_runs": statistics.median(x[0] for x in solo),
            "ours_aggregate_tps": ours_med,
            "mlx_lm_batchgenerator_tps": plain_med,
            "over_one": ours_med / one_tps,
            "over_mlx_lm": ours_med / plain_med,
            "ours_wall_s": statistics.median(ours_wall),
            "mlx_lm_wall_s": statistics.median(plain_wall),
            "rows_equal_to_solo": f"{min(agree)}/{args.batch} (worst of {args.repeats})",
        }
        print(json.dumps(result["batched"]), flush=True)
        save(result, args.out)
    rng = random.Random(0)
    if "stop" not in skip and args.stop_rounds:
        lat, steps, worker_side, early = stop_one_rounds(worker, name, prompts, args.budget, args.stop_rounds, rng)
        step = statistics.median(steps)
        result["stop_one_of_batch_ms"] = {
            "p50": 1000 * percentile(lat, 50),
            "p99": 1000 * percentile(lat, 99),
            "max": 1000 * max(lat),
            "rounds": len(lat),
            "batched_step_ms": 1000 * step,
            "max_budget_or_step_plus_30_ms": 1000 * (max(args.budget, step) + 0.03),
            "worker_side_p50": 1000 * percentile(worker_side, 50),
            "worker_side_p99": 1000 * percentile(worker_side, 99),
            "reported_before_the_others_next_token": early,
        }
        print(json.dumps(result["stop_one_of_batch_ms"]), flush=True)
        save(result, args.out)
    if "profile" not in skip:
        result["step_profile"] = step_profile(worker, name, prompts, 48, args.budget)
        print(json.dumps(result["step_profile"]), flush=True)
        save(result, args.out)
    if "join" not in skip:
        # The process's first long prompt, then a second one: the first meets the chunk shapes the idle
        # ladder has not built yet (it yields to every job queued, and the parts above keep the worker busy).
        loaded = worker.store.loaded()[0]
        if args.ladder_first and warm_up.wanted():
            result["ladder_wait_s"] = wait_for_ladder(loaded)
        for key, seed in (("join", 99), ("join_again", 97)):
            left = len(warm_up.ladder(loaded)) if warm_up.wanted() else 0
            result[key] = join_gap(
                worker,
                name,
                prompts[: max(1, args.batch - 1)],
                prompt_ids(args.join_length, vocab, seed=seed),
                args.budget,
                trace=args.trace,
                after_tokens=args.join_after_tokens,
                quiet_s=args.join_quiet,
            )
            result[key]["ladder_chunks_left"] = left
            print(json.dumps(result[key]), flush=True)
            save(result, args.out)
    if "join_stop" not in skip and args.join_stop_rounds:
        result["join_stop_ms"] = join_stop_rounds(
            worker,
            name,
            prompts[: max(1, args.batch - 1)],
            prompt_ids(args.join_length, vocab, seed=96),
            args.budget,
            args.join_stop_rounds,
            rng,
            trace=args.trace,
        )
        print(json.dumps(result["join_stop_ms"]), flush=True)
        save(result, args.out)
    if "cached_stop" not in skip and args.stop_rounds:
        ids = prompt_ids(args.join_length, vocab, seed=98)
        result["cached_stop_ms"] = cached_stop_rounds(
            worker, name, ids, args.budget, args.stop_rounds, rng, trace=args.trace
        )
        print(json.dumps(result["cached_stop_ms"]), flush=True)
        save(result, args.out)
    if "prefix" not in skip:
        result["prefix_reuse"] = prefix_reuse(worker, name, vocab, args.prefix_length, args.budget, 16)
        print(json.dumps(result["prefix_reuse"]), flush=True)
        save(result, args.out)
    worker.shutdown()
    result["gpu_state"]["end"] = gpu_state()
    save(result, args.out)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
