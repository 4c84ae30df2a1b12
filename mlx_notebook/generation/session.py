"""The worker's loop while generations of one model run: prefill pieces and batched decode steps.

A session starts with the first queued generation and takes every generation
of the same model queued behind it (up to the batch cap) as they arrive. Each
one loads (once per session), prepares its prompt, starts from the longest
cached prefix, prefills, then joins the :class:`~.decode_batch.DecodeBatch`.
A prefill's checkpoints run one decode step of the batch, so the others keep
streaming while a new prompt is read: between two of their tokens there is at
most one prefill piece (sized to the budget) and one step. Where the device
builds kernels per shape, a prompt that joins rows already streaming is
prefilled on the prefill thread instead (:mod:`.prefill_thread`), one at a
time, while this loop steps the others, the two taking the device in turns
(:mod:`.device_turns`); it joins at the loop's next look.

Rows of the model's own cache share one batch; a row with a quantized or
rotating cache (``kv_bits``, ``max_kv_size``) decodes in a batch of its own,
and the batches step in turn.

Pauses: a decoding generation is parked outside the batch (the others go
on); a prefilling one blocks in its checkpoint, which meanwhile runs the
batch's steps. The session ends when nothing runs, joins or is parked.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from ..budget import OTHERS_STEP_SHARE, PREFILL_SHARE
from ..control import Cancelled, Pace
from ..errors import InvalidArgumentError
from ..loading.blas_threads import fit_to_load, step_took
from ..loading.policy import batch_decode
from ..loading.store import LoadedModel, ModelStore
from . import batch_cache, quantized_attention, small_attention
from .batch_cache import Cache
from .chunks import KV_STEP
from .constraint_matcher import start_grammar_process
from .decode_batch import DecodeBatch, Row
from .device_turns import DeviceTurns
from .handle import Reporter
from .kv_settings import KV_GROUP_SIZES, KVSettings
from .persist import load_seed
from .prefill import prefill
from .prefill_thread import PrefillThread, SideJob
from .prefix_cache import PromptCache, common_prefix, restore, storable, trimmed
from .prompt import prepare_prompt
from .prompt_turn import PromptTurn
from .states import State
from .stats import FinishReason
from .wired import wired_limit

log = logging.getLogger(__name__)
# The key of the batch shared by rows of the model's own cache.
_SHARED = "shared"
# How long an idle session (every generation paused) waits before looking
# again; requests wake it at once (the tokens' watchers).
IDLE_WAIT_S = 0.5
# A joining prompt on the prefill thread hands the device over before its hold would pass its slice (DeviceTurns'
# ``ahead``). Off until a device measures it (benchmarks/results/join_handover_probe_session38.py.txt sets it).
TURNS_AHEAD = False
# A joining prompt on the prefill thread hands the device over with its last groups still queued, the others' step
# queued behind them on the device (DeviceTurns.gate), not after this thread waited for them: on an H100 the joiner's
# first token came 0.91x as late, the others' longest gap alike (session 53, docs/benchmarks.md).
TURNS_GATED = True


class Jobs(Protocol):
    """What a session needs from its worker."""

    def take_joiner(self, key: str, accept: Callable[[Reporter], bool]) -> Reporter | None:
        """The next queued job if it is a generation of model ``key`` that ``accept`` takes."""
        ...

    def run_inline_calls(self) -> bool:
        """Run the calls that may not wait for the session's end (saves of paused generations); whether any ran."""
        ...

    def wait_for_change(self, timeout: float) -> None:
        """Block until a job is queued or a request arrives, or ``timeout`` passes."""
        ...

    def prefill_thread(self) -> PrefillThread | None:
        """The thread that prefills prompts joining a decoding batch, or ``None`` where they are fed in turn."""
        ...


@dataclass
class _Side:
    """A prompt being prefilled on the prefill thread while the session steps the others.

    The prefill thread publishes ``fed``, the prompt's length, once it is
    known; the session (worker thread) then allocates the batch's buffers for
    the join a layer per loop (``reserve``), as ``Session.between`` does for a
    prompt fed in turn. A pause drops them (``dropped``).
    """

    reporter: Reporter
    job: SideJob | None = None
    fed: int | None = None
    reserve: batch_cache.Reserve | None = None
    reserved: bool = False
    dropped: threading.Event = field(default_factory=threading.Event)
    # How it and the others' steps take the device in turns. ``None`` only where a benchmark turns them off to
    # compare with the library before them (benchmarks/results/join_device_turns_probe_session32.py.txt).
    turns: DeviceTurns | None = None


class _PauseHooks:
    """What a pause of a prefilling generation does: let go of what it holds for later, drain the stream, report ``paused``.

    ``release``: called first; the session drops the buffers reserved for the
    prompt's join (a pause may last, and the batch may change meanwhile).
    """

    def __init__(self, reporter: Reporter, stream: mx.Stream, release: Callable[[], None]) -> None:
        self._reporter = reporter
        self._stream = stream
        self._release = release
        self._before = State.LOADING

    def on_pause(self) -> None:
        self._release()
        mx.synchronize(self._stream)
        self._before = self._reporter.state
        self._reporter.set_state(State.PAUSED)

    def on_resume(self) -> None:
        self._reporter.set_state(self._before)


class Session:
    """Runs generations of one model on the worker thread, which owns ``stream``.

    Args:
        store: The loaded models.
        stream: The worker's stream.
        jobs: The worker's queue.
        key: The model's key (:attr:`ModelSource.key`).
        prompt_cache_bytes: Bound of a model's prompt cache, made on first use.
        on_end: Called with each generation's reporter, error and final state
          when it ends, after it is reported (the worker forgets it).
    """

    def __init__(
        self,
        store: ModelStore,
        stream: mx.Stream,
        jobs: Jobs,
        key: str,
        prompt_cache_bytes: Callable[[], int],
        on_end: Callable[[Reporter, State, BaseException | None], None],
    ) -> None:
        self.store = store
        self.stream = stream
        self.jobs = jobs
        self.key = key
        self.prompt_cache_bytes = prompt_cache_bytes
        self.on_end = on_end
        self.running: list[Reporter] = []
        self.loaded: LoadedModel | None = None
        # Decode batches: one for the rows of the model's own cache, and one per
        # row with a quantized or rotating cache (those decode alone: kv_settings).
        self.batches: dict[Hashable, DecodeBatch] = {}
        self.batchable = True
        # When the loop's last decode step ended, and its rows: the next one is
        # timed from there if nothing else ran in between (see _timed_step).
        self._timed: tuple[float, int] | None = None
        # The shared batch's cache after the prompt being prefilled joins, allocated a layer per checkpoint.
        self._reserve: batch_cache.Reserve | None = None
        # The prompt being prefilled on the prefill thread, if any.
        self._side: _Side | None = None
        # The turn of the prompt (or inline call) fed in pieces on this thread now: from its first
        # boundary to the loop's next pass.
        self._turn: PromptTurn | None = None

    # -- the loop -----------------------------------------------------------------

    def run(self, first: Reporter) -> None:
        """Run ``first`` and every generation that joins, until none is left."""
        try:
            with contextlib.ExitStack() as stack:
                self._start(first, stack)
                while True:
                    self._prune_prefixes()
                    self._run_inline_calls()
                    for batch in self._live_batches():
                        batch.poll_parked()
                    if self._side is not None:
                        self._follow_side()
                    job = self.jobs.take_joiner(self.key, self._fits) if self._side is None else None
                    if job is not None:
                        self._timed = None
                        self._start(job, stack)
                        self._interrupt_batches()  # its prefill's last piece ran since the others' last read
                    elif self._has_work():
                        self._timed_step()
                    elif self._side is not None or any(b.parked for b in self.batches.values()):
                        if self._side is not None and self._side.turns is not None:
                            self._side.turns.pass_turn()  # no step to wait for
                        self.jobs.wait_for_change(IDLE_WAIT_S)
                    else:
                        return
        finally:
            if self._side is not None and self._side.job is not None:
                # A bug ended the loop while a prompt was prefilled beside it: stop it, and wait (it uses the model).
                self._side.reporter.generation.token.cancel()
                self._side.job.done.wait()
            # A batch refers back to the session (its on_leave): break the
            # cycle so that what it holds goes now, not at the next collection.
            for batch in self.batches.values():
                batch.close()
            self.batches = {}
            self._prune_prefixes()

    def _fits(self, job: Reporter) -> bool:
        """Whether ``job`` may join now: every member's ``max_batch`` (its own too) leaves room."""
        if not self.running:
            return True
        if not self.batchable:
            return False
        running = list(self.running)  # a stop reported on another thread removes from it
        cap = min([r.generation.request.max_batch for r in running] + [job.generation.request.max_batch])
        return len(running) < cap

    def _timed_step(self) -> None:
        """A step of the loop's own, timed for OpenBLAS's thread count on the CPU.

        Only a step whose rows decoded in the step before and go on after it
        is timed: right after a prefill the interval would hold a piece of
        it, and a batch's last step only reads a token queued a step before
        (measured: 27-35 ms against 78-109 ms for 4 rows of the default model
        on 2 cores; such a sample among a candidate's three can pick the
        slower thread count). A lone batch's step is timed from one read of
        its tokens to the next: the host's reporting after a read overlaps
        the next step on the device, so the time from one step's end to the
        next's is short by however long that reporting took (a 53 ms sample
        among 80-120 ms ones); several batches' steps are timed end to end.
        """
        rows = self._rows_decoding()
        self._step(rows)
        now = time.perf_counter()
        if self._timed is not None and self._timed[1] == rows and self._rows_decoding() == rows:
            live = [b for b in self.batches.values() if b.rows]
            seconds = live[0].last_interval if len(live) == 1 else now - self._timed[0]
            if seconds is not None:
                step_took(rows, seconds)
        self._timed = (now, rows)

    def _rows_decoding(self) -> int:
        return sum(len(b.rows) for b in self.batches.values() if b.has_work())

    def _step(self, rows: int = 1, hold: bool = False) -> None:
        """One step of every batch with work (in turn: they share the device); ``hold``: see :meth:`DecodeBatch.step`.

        While a prompt is prefilled on the prefill thread the step takes the
        device in turns with its pieces (:mod:`.device_turns`), and the next
        step is held, not queued ahead: it waits for the piece after this one.
        """
        _fit_blas_threads(rows)
        turns = self._side.turns if self._side is not None else None
        with turns.worker_turn() if turns is not None else contextlib.nullcontext():
            for batch in list(self.batches.values()):
                if batch.has_work():
                    self._step_batch(batch, hold or turns is not None)

    def _step_batch(self, batch: DecodeBatch, hold: bool = False) -> None:
        try:
            batch.step(hold)
        except Exception as exc:  # an MLX error: every row of the batch fails
            log.debug("decode step failed", exc_info=True)
            self._synchronize_quietly()
            # Their tokens' watchers would keep the batch, and through it the model and its prompt cache, alive.
            for row in batch.abandon():
                if not row.detached:  # a detached row was reported stopped already
                    self._end(row.sink, State.FAILED, exc)
        for row in batch.rows:
            row.sink.stats.batch_size = max(row.sink.stats.batch_size, len(batch.rows))

    def _has_work(self) -> bool:
        return any(b.has_work() for b in self.batches.values())

    def _live_batches(self) -> list[DecodeBatch]:
        """The batches, after dropping the emptied ones of single rows."""
        for key, batch in list(self.batches.items()):
            if key != _SHARED and not len(batch):
                batch.close()
                del self.batches[key]
        return list(self.batches.values())

    def _batch_for(self, reporter: Reporter, kv: KVSettings) -> DecodeBatch:
        """The batch a prefilled generation joins: the shared one, or its own (quantized, rotating)."""
        assert self.loaded is not None
        key: Hashable = _SHARED if kv.plain else reporter.generation.id
        batch = self.batches.get(key)
        if batch is None:
            batch = self.batches[key] = DecodeBatch(self.loaded, self.stream, self._row_left, keep=self._keep_prefix)
        return batch

    # -- one generation's start ------------------------------------------------------

    def _start(self, reporter: Reporter, stack: contextlib.ExitStack) -> None:
        gen = reporter.generation
        if gen.token.cancelled:
            gen.stats.stop_latency_s = gen.token.mark_stopped()
            self.running.append(reporter)
            self._end(reporter, State.STOPPED, None)
            return
        self.running.append(reporter)
        thread = self.jobs.prefill_thread() if self._streaming() and self.loaded is not None else None
        if thread is not None and KVSettings.of(gen.request).plain:
            budget = gen.request.stop_budget
            # The prompt hands the device over after about half a budget (its layer groups are sized to half of
            # it: a group or two a turn), so the others' gap is about a step and a budget; they wait at most one
            # budget for it, and it waits for one of their steps (at most 4 budgets: a save may hold the worker).
            turns = DeviceTurns(
                slice_s=budget * OTHERS_STEP_SHARE, worker_wait_s=budget, side_wait_s=4 * budget, ahead=TURNS_AHEAD
            )
            side = self._side = _Side(reporter, turns=turns)
            side.job = thread.submit(lambda stream: self._side_row(reporter, stack, stream, side))
            return
        row = self._prefilled_row(reporter, stack, self.stream, None)
        if row is not None:
            self._batch_for(reporter, row.kv).add(row)

    def _pace(self, reporter: Reporter, stream: mx.Stream, side: _Side | None) -> Pace:
        """A generation's pace: on the worker thread its checkpoints step the others (and a pause does too);
        on the prefill thread they hand the device to the others' steps in turn (the worker runs them)."""
        gen = reporter.generation
        if side is not None:
            turns = side.turns

            def release() -> None:
                side.dropped.set()
                if turns is not None:
                    turns.release()

            hooks = _PauseHooks(reporter, stream, release=release)
            pace = Pace(gen.token, gen.request.stop_budget, on_pause=hooks.on_pause, on_resume=hooks.on_resume)
            if turns is not None:
                # Its checkpoints take the device in turns with the others' steps; it hands over with its work
                # drained, or (gated) left queued with their step queued behind it on the device.
                pace.between = lambda: turns.side_checkpoint(lambda: pace.requested)
                pace.shared = turns.due
                if TURNS_GATED:
                    pace.gate = turns.gate
            return pace
        hooks = _PauseHooks(reporter, stream, release=self._drop_reserve)
        return Pace(
            gen.token,
            gen.request.stop_budget,
            on_pause=hooks.on_pause,
            on_resume=hooks.on_resume,
            between=self.between,
            while_paused=self._while_paused,
            shared=self._streaming,
        )

    def _prefilled_row(
        self, reporter: Reporter, stack: contextlib.ExitStack, stream: mx.Stream, side: _Side | None
    ) -> Row | None:
        """Load, prepare and prefill one generation on ``stream``: its row, or ``None`` when it ended (stopped, failed).

        ``side``: on the prefill thread (the model is loaded; the session
        reserves the join's buffers from the length published there).
        """
        gen = reporter.generation
        pace = self._pace(reporter, stream, side)
        start = time.perf_counter()
        cache: Cache | None = None
        fed: list[int] = []
        try:
            with mx.stream(stream):
                reporter.set_state(State.LOADING)
                if side is not None and self.loaded is not None:
                    loaded = self.loaded
                else:
                    if self.loaded is None:
                        mx.reset_peak_memory()
                    loaded = self.store.get(
                        gen.request.model,
                        pace,
                        progress=lambda done, total, step: reporter.progress(f"load: {step}", done, total),
                    )
                gen.stats.load_s = time.perf_counter() - start
                if self.loaded is None:
                    self._open(loaded, stack)
                reporter.set_tokenizer(loaded.tokenizer)
                reporter.set_state(State.PREFILLING)
                if gen.request.constraint is not None:
                    start_grammar_process(loaded)  # its tokenizer builds in a child while the prompt is read
                _check_logit_bias(loaded, gen.request)
                _prepare_kv_bits(loaded, gen.request)
                resume = reporter.resume
                prompt = resume.prompt if resume is not None else prepare_prompt(loaded, gen.request)
                # What the cache will hold: the prompt, and a resumed generation's tokens so far.
                fed = prompt + resume.tokens if resume is not None else prompt
                gen.stats.prompt_tokens = len(prompt)
                pace.checkpoint()
                kv = KVSettings.of(gen.request)
                cache, cached = self._start_cache(loaded, reporter, fed, kv, pace)
                gen.stats.cached_tokens = cached
                prefill_start = time.perf_counter()
                reserve = None
                if side is not None:
                    side.fed = len(fed)
                    first = prefill(
                        loaded,
                        cache,
                        fed,
                        pace=pace,
                        sink=reporter,
                        start=cached,
                        kv=kv,
                        side=True,
                        turns=side.turns is not None,
                    )
                else:
                    shared = self.batches.get(_SHARED)
                    self._reserve = shared.reserve_for(len(fed)) if kv.plain and shared is not None else None
                    try:
                        # A lone generation's first forward is stoppable in layer groups (see prefill's last=).
                        first = prefill(
                            loaded, cache, fed, pace=pace, sink=reporter, start=cached, kv=kv, last=not self._decoding()
                        )
                        reserve = self._reserve
                    finally:
                        self._reserve = None
            row = Row(reporter, pace, gen.request, prompt, cache, fed[-1], start, prefill_start)
            row.first_logits = first
            row.reserve = reserve
            if resume is not None:
                row.tokens = list(resume.tokens)
                if resume.key is not None:
                    row.sample.key = mx.array(resume.key, dtype=mx.uint32)
            return row
        except Cancelled:
            if side is not None or not self._decoding():
                _synchronize_quietly(stream)
            if cache is not None and self.loaded is not None:
                self._keep_prefix(fed, cache, KVSettings.of(gen.request))
            gen.stats.stop_latency_s = gen.token.mark_stopped()
            self._end(reporter, State.STOPPED, None)
        except Exception as exc:  # MLX RuntimeError, bad input: fail this one only
            _synchronize_quietly(stream)
            log.debug("generation #%s failed", gen.id, exc_info=True)
            self._end(reporter, State.FAILED, exc)
        return None

    def _side_row(self, reporter: Reporter, stack: contextlib.ExitStack, stream: mx.Stream, side: _Side) -> Row | None:
        """On the prefill thread: :meth:`_prefilled_row`, taking the device in turns with the others' steps."""
        turns = side.turns
        if turns is None:
            return self._prefilled_row(reporter, stack, stream, side)
        watchers = reporter.generation.token.watchers
        watchers.append(turns.wake)
        try:
            return self._prefilled_row(reporter, stack, stream, side)
        finally:
            turns.close()
            watchers.remove(turns.wake)

    def _follow_side(self) -> None:
        """Between two steps: reserve the join's buffers for the prompt prefilled beside, and join it once read."""
        side = self._side
        assert side is not None
        self._timed = None  # a step beside a prefill is not one step's time
        if side.dropped.is_set():
            side.reserve = None
        elif side.fed is not None and not side.reserved:
            side.reserved = True
            shared = self.batches.get(_SHARED)
            side.reserve = shared.reserve_for(side.fed) if shared is not None else None
        elif side.reserve is not None and not side.reserve.done:
            # In turns the worker loops once per step and piece, not once per step: an 8k prompt gave it 25-27
            # loops for Qwen3-8B's 36 layers, and a layer a loop left the rest to the admit, inside the others'
            # gap (H200: 47-53 ms against 35-42 without turns; benchmarks/results/h200_join_turns_session32.json).
            side.reserve.advance(3 if side.turns is not None else 1)
        if side.job is None or not side.job.done.is_set():
            return
        self._side = None
        if side.job.error is not None:
            raise side.job.error
        row: Row | None = side.job.result
        if row is None:
            return
        row.reserve = None if side.dropped.is_set() else side.reserve
        # From now on its checkpoints (a constrained row's wait, a pause) are the worker's.
        row.pace = self._pace(side.reporter, self.stream, None)
        self._batch_for(side.reporter, row.kv).add(row)

    def _start_cache(
        self, loaded: LoadedModel, reporter: Reporter, fed: list[int], kv: KVSettings, pace: Pace
    ) -> tuple[Cache, int]:
        """The cache a generation starts from and how many of ``fed`` it holds.

        A resumed generation's file, or a loaded chat's; else the longest
        prefix in the model's prompt cache; else an empty cache. Either copy
        gets room for the rest of the prompt and the first steps.
        """
        seed = reporter.resume.seed if reporter.resume is not None else reporter.seed
        cache: Cache | None = None
        cached = 0
        if seed is not None and seed.tokens:
            # Read with room for the rest of the prompt and the first steps: restore() below copies nothing.
            cache = load_seed(seed, loaded, kv, pace, room=max(0, len(fed) - len(seed.tokens)) + KV_STEP)
            common = min(common_prefix(seed.tokens, fed), len(fed) - 1)
            if common < len(seed.tokens):
                if not storable(cache):
                    cache, common = None, 0  # a rotating cache cannot be cut back: read the prompt
                else:
                    cache = trimmed(cache, common)
            cached = common
            reporter.seed = None  # read once: the next turns find it in the prompt cache
        if cache is None or not cached:
            cache, cached = self._prompt_cache(loaded).fetch(fed, kv)
        if cache is None:
            return kv.make_cache(loaded.model), 0
        if storable(cache):
            # Room for the rest of the prompt and the first steps: no copy in them.
            restore(cache, len(fed) - cached + KV_STEP, pace, piece_s=pace.budget_s * PREFILL_SHARE)
        return cache, cached

    # -- what saving asks (on the worker thread) ------------------------------------------

    def parked_row(self, gen: Any) -> Row | None:
        """The parked (paused, decoding) row of ``gen``, if it has one."""
        for batch in self.batches.values():
            for row in batch.parked:
                if row.sink.generation is gen:
                    return row
        return None

    def _open(self, loaded: LoadedModel, stack: contextlib.ExitStack) -> None:
        """The model is loaded: make the batch, raise the wired limit for the session."""
        from mlx_lm.models.cache import make_prompt_cache

        self.loaded = loaded
        loaded.warmed = True  # its first prefill pays the first uses (see warm_up)
        self.batchable = batch_decode(loaded.model) and batch_cache.batchable(make_prompt_cache(loaded.model))
        if small_attention.wanted():
            small_attention.install(loaded.model)
        stack.enter_context(wired_limit(loaded.model, self.stream))

    def _prompt_cache(self, loaded: LoadedModel) -> PromptCache:
        if loaded.prompt_cache is None:
            loaded.prompt_cache = PromptCache(self.prompt_cache_bytes())
        cache: PromptCache = loaded.prompt_cache
        return cache

    # -- checkpoints of a prefilling generation ----------------------------------------

    def _streaming(self) -> bool:
        """Whether rows stream tokens now (have shown their first), or will at the next step (resumed)."""
        return any(r.first_token_at is not None for b in self.batches.values() for r in b.rows + b.ready)

    def _decoding(self) -> bool:
        return any(b.rows for b in self.batches.values())

    def between(self) -> None:
        """At a prefill piece boundary: one decode step of the others, when they need one.

        Also between two pieces of an inline call (a save). Parked rows are
        looked at here too: the session's loop waits for the prompt's end.
        Only for rows that stream already: rows still waiting for their first
        token (generations submitted together) wait until the prompts queued
        with them are prefilled, then all start decoding together, as
        mlx-lm's batch generator does. And at most one step per turn of the
        prompt (:mod:`.prompt_turn`): half a budget where their steps are
        short, longer where their gap's bound (a budget and two steps) leaves
        room for it.
        """
        _fit_blas_threads()
        self._interrupt_batches()  # a piece ran since their last read, or runs before their next
        for batch in self.batches.values():
            # A paused row resumed or stopped now acts within a piece, not after the prompt (a 1,000-token
            # prompt of the default model on 2 cores: 4.1 s to the resumed row's next token, 3.8 s to the stop).
            batch.poll_parked()
        if self._streaming():
            self._step_in_turn()
        # After their step, not before it: queued before it, a layer's buffers (zeroed, new memory on a process's
        # first join) ran inside their gap (on 2 cores, the default model, three rows joined by a 3,000-token
        # prompt: ~19.5 MB a layer, their steps at the first 30 boundaries ~180 ms against ~110). Queued here they
        # run before the prompt's next piece, timed as its own: the turn leaves room for them.
        if self._reserve is not None and not self._reserve.done:
            self._reserve.advance()

    def _step_in_turn(self) -> None:
        """The others' next step, when the prompt's turn has passed (:mod:`.prompt_turn`)."""
        batches = [b for b in self.batches.values() if b.rows or b.ready]
        budget = min(r.pace.budget_s for b in batches for r in b.rows + b.ready)
        steps = [s for b in batches if (s := b.fastest_step_s) is not None]
        turn = self._turn = self._turn or PromptTurn()
        now, last = time.perf_counter(), min(b.last_step_at for b in batches)
        turn.reached(now)
        if turn.due(now - last, budget, min(steps, default=None)):
            # On OpenBLAS's count for their rows, as the loop's own steps (a prefill piece's count can lose on a
            # step of several rows: 88 against 74 ms for 4 rows of the default model on a Zen 4's two cores).
            self._step(self._rows_decoding(), hold=True)  # their next step waits for the next boundary: not timed
            # The piece's count back. Their step was read and the next is held: no product runs on the old count.
            _fit_blas_threads()
            read = min(b.last_step_at for b in batches)
            if last and read > now:  # each batch read a token: how long after the boundary fits the next turn
                turn.stepped(read - now)
        turn.left(time.perf_counter())

    def _run_inline_calls(self) -> None:
        """The calls waiting (saves), between two steps: the step after them is not timed."""
        self._turn = None  # a save's pieces, or the next prompt's, start a turn of their own
        if self.jobs.run_inline_calls():
            self._interrupt_batches()

    def _interrupt_batches(self) -> None:
        """The worker ran something else between two steps: their interval is not a step's time."""
        for batch in self.batches.values():
            batch.interrupted()

    def _drop_reserve(self) -> None:
        self._reserve = None

    def _while_paused(self) -> None:
        """While a prefilling generation is paused: the others' steps, or a short wait."""
        self._run_inline_calls()
        for batch in self._live_batches():
            batch.poll_parked()
        if self._has_work():
            self._step()
            return
        self.jobs.wait_for_change(IDLE_WAIT_S)

    # -- ends ---------------------------------------------------------------------------------

    def _row_left(self, row: Row, cache: Cache | None, error: BaseException | None) -> None:
        """A row left the batch for good: keep its cache, report it."""
        reporter = row.sink
        if cache is not None:
            self._keep_prefix(row.fed_tokens(), cache, row.kv)
        if row.finish is FinishReason.STOPPED:
            reporter.stats.stop_latency_s = row.pace.token.mark_stopped()
            self._end(reporter, State.STOPPED, None)
        else:
            self._end(reporter, State.DONE, None)

    def _keep_prefix(self, tokens: list[int], cache: Cache, kv: KVSettings) -> None:
        """Store what ``cache`` holds of ``tokens`` in the model's prompt cache (made with ``kv``).

        Before the generation is reported ended, so that whoever looks next
        finds it; what it makes redundant is freed by the loop, after the
        report and outside the batch's lock (:meth:`_prune_prefixes`): that
        took 5-6 ms of a 32k-token stop on an H200.
        """
        if self.loaded is None or not storable(cache):
            return
        offsets = {int(layer.offset) for layer in cache}
        if len(offsets) != 1:
            return  # stopped between groups of layers: the layers disagree
        n = min(offsets.pop(), len(tokens))
        if n > 0:
            self._prompt_cache(self.loaded).store(tokens[:n], cache, kv, prune=False)

    def _prune_prefixes(self) -> None:
        if self.loaded is not None and self.loaded.prompt_cache is not None:
            self.loaded.prompt_cache.prune()

    def _end(self, reporter: Reporter, state: State, error: BaseException | None) -> None:
        if reporter in self.running:
            self.running.remove(reporter)
        self.on_end(reporter, state, error)

    def _synchronize_quietly(self) -> None:
        _synchronize_quietly(self.stream)


def _synchronize_quietly(stream: mx.Stream) -> None:
    try:
        mx.synchronize(stream)
    except Exception:  # the device error is already being reported
        log.debug("synchronize after error failed", exc_info=True)


def _fit_blas_threads(rows: int = 1) -> None:
    """On the CPU, OpenBLAS's threads to the cores other processes leave free and to the work (:mod:`..loading.blas_threads`).

    ``rows``: the rows of the decode step about to run; 1 for a prefill piece.
    """
    if mx.default_device().type == mx.cpu:
        fit_to_load(rows)


def _check_logit_bias(loaded: LoadedModel, request: Any) -> None:
    """Token ids of ``logit_bias`` must exist in the model's vocabulary (known only once it is loaded)."""
    if not request.logit_bias:
        return
    vocab = loaded.config.get("vocab_size")
    if vocab is None:
        return
    bad = [t for t in request.logit_bias if t >= vocab]
    if bad:
        raise InvalidArgumentError(f"logit_bias token id {bad[0]} is not in the model's vocabulary (0-{vocab - 1})")


def _prepare_kv_bits(loaded: LoadedModel, request: Any) -> None:
    """Check ``kv_group_size`` against the model's head size (known only once it is loaded) and route attention.

    On the CUDA backend attention over a quantized cache runs on each layer
    dequantized (:mod:`.quantized_attention`); a model whose module has no
    mlx-lm attention function to route is refused there.
    """
    if request.kv_bits is None:
        return
    if quantized_attention.wanted() and not quantized_attention.install(loaded.model):
        raise InvalidArgumentError(
            f"kv_bits does not run for {type(loaded.model).__module__} on MLX's CUDA backend (its attention "
            "does not go through mlx-lm's scaled_dot_product_attention): leave kv_bits unset for this model"
        )
    config = loaded.config
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else None)
    if not head_dim or head_dim % request.kv_group_size == 0:
        return
    fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
    fix = f"use kv_group_size={fits[-1]}" if fits else "leave kv_bits unset for this model"
    raise InvalidArgumentError(
        f"kv_group_size {request.kv_group_size} does not divide the model's head size {head_dim}: {fix}"
    )
