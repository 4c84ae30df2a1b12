"""Decode many generations of one model together: one batched step, one token each.

Decode reads every weight once per step whatever the batch size, so on a GPU
eight sequences cost about what one does. A :class:`DecodeBatch` holds the
sequences decoding now (rows), each with its own sampler and PRNG key, its
own ``max_tokens``, EOS and detokenizer. Rows join after their prefill, and
leave when they finish, stop or pause; a paused row's cache is taken out of
the batch (parked) and re-joins on resume, so its tokens are those of an
uninterrupted run.

With one row the cache is the model's plain ``KVCache`` and a step is exactly
the solo decode step (same graph, same tokens); with more it is mlx-lm's
left-padded ``BatchKVCache`` (see :mod:`.batch_cache`).

Like mlx-lm, the next step's graph is built and queued on the device while
Python reads and reports the current tokens. Whether it is queued *before* the
tokens are read (two steps in flight) depends on the stop budget: a stop that
lands while the worker waits for a token also waits for the step queued
behind it, so that happens only while two steps fit ``budget.DECODE_PIPELINE_SHARE`` of
the tightest budget in the batch (:mod:`.decode_pacing` decides that, the groups
below and the lead). Otherwise the next step is queued as soon
as the tokens are read, unless a row has a stop or pause waiting or a
sequence waits to join: then rows change first. While a constrained row
(``schema=``, ``choices=``, ``regex=``: :mod:`.constraint_matcher`) is in the
batch only the next step's forward is built ahead: its mask needs its last
token read, so the forward is queued at the read and runs on the device while
the matchers (one request per step to the llguidance process, masks filled in
parallel there) compute the masks; then the sampling is queued.

A stop of one row while others go on is reported at once, on the thread that
asks for it, without waiting for the step in flight (:meth:`DecodeBatch._on_request`;
:meth:`DecodeBatch._detach` says why that is honest); the token that step makes
for it is dropped and its cache is cut out at the step's end. When the last
row leaves, the stream is synchronized before it is reported, so nothing is
left in flight.

A step longer than the stop budget (a long context, a quantized cache, a big
model on a small device) is queued and evaluated in groups of layers, one
group queued behind the one waited on (:class:`.pieces.MarkedLayers`; two
groups fit ``DECODE_PIPELINE_SHARE`` of the budget); the next step's build
waits for one of them at each of its own marks, so the host's build and the
device's groups overlap as they do with whole steps. When every row is
stopped between two groups the rest of the step is never queued: its tokens
are never read, and the positions it wrote stay lazy in the cache (computed
if that cache is used again, e.g. from the prefix cache). A lone row's next
step, built meanwhile, stops being built at its stop. A pause still waits
for the step, which resume must not compute twice.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast, overload

import mlx.core as mx
import mlx.nn as nn

from ..control import Pace
from ..errors import InvalidArgumentError
from ..loading.store import LoadedModel
from . import batch_cache, decode_pacing, kv_capacity, row_attention
from .batch_cache import Cache
from .chunks import KV_STEP, builds_kernels_per_shape
from .constraint_matcher import RowMatcher, mask_logits
from .handle import Reporter, TokenLogprobs
from .kv_settings import KVSettings, cache_nbytes
from .pieces import BuildStopped, MarkedLayers, layer_owner
from .request import GenerationRequest
from .sampling import Sampler, make_sampler
from .states import State
from .stats import FinishReason

log = logging.getLogger(__name__)


@dataclass
class Row:
    """One generation in (or parked beside) a decode batch.

    Args:
        sink: Where its tokens and stats go.
        pace: Its stop / pause requests and budget.
        request: What it generates.
        prompt: Its prompt tokens.
        cache: Its own KV cache while outside the batch (after prefill, or
          parked); ``None`` while its rows are in the batch's cache.
        next_token: The token it feeds next: the prompt's last token after
          prefill, or, parked, the token computed before the pause.
        start: When its job started (``time.perf_counter``).
        prefill_start: When its prefill started.
    """

    sink: Reporter
    pace: Pace
    request: GenerationRequest
    prompt: list[int]
    cache: Cache | None
    next_token: int
    start: float
    prefill_start: float
    sample: Sampler = field(init=False)
    kv: KVSettings = field(init=False)
    eos: set[int] = field(default_factory=set)
    detokenizer: Any = None
    # Read tokens, EOS included: with the prompt, what the cache holds.
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    paused_at: float | None = None
    paused_s: float = 0.0
    finish: FinishReason | None = None
    # Text held back because it may be the start of a stop string.
    held: str = ""
    # Reported stopped while a step with it in was in flight: its share of that
    # step is dropped, its rows are cut from the batch's cache when the step ends.
    detached: bool = False
    # Its grammar's state (schema=, choices=, regex=), fed every read token: parked with the row.
    matcher: RowMatcher | None = None
    # Its first token's logits, when its prefill fed the last prompt token too
    # (then its cache holds it): sampled instead of a forward if it starts alone.
    first_logits: mx.array | None = None
    # The batch's cache buffers after it joins, allocated during its prefill (see batch_cache.Reserve).
    reserve: batch_cache.Reserve | None = None

    def __post_init__(self) -> None:
        self.sample = make_sampler(self.request)
        self.kv = KVSettings.of(self.request)

    def context(self, pending: mx.array | None) -> mx.array:
        """The last tokens before the one a step predicts, for the logits processors.

        ``pending`` is the step's input when it is not read yet (a step built
        before the previous one's tokens were read); otherwise the input is
        the last read token (or the prompt's last).
        """
        n = self.sample.context
        known = (self.prompt + self.tokens)[-n:]
        tokens = mx.array(known, dtype=mx.uint32)
        return tokens if pending is None else mx.concatenate([tokens, pending])[-n:]

    @property
    def greedy(self) -> bool:
        return self.request.temperature == 0

    def fed_tokens(self) -> list[int]:
        """The tokens its cache holds, in order (prompt, then generated)."""
        return self.prompt + self.tokens


@dataclass
class _Step:
    """One built decode step: a token per row and, for rows that keep them, log-probabilities."""

    tokens: mx.array
    # Per row: (the sampled token's log-probability, the top ids, their log-probabilities), or None.
    logprobs: list[tuple[mx.array, mx.array, mx.array] | None]
    # The hidden state after each group of layers but the last (lazy), when the step goes in pieces.
    groups: list[mx.array] = field(default_factory=list)
    # Groups evaluated so far (some while the next step was built).
    waited: int = 0
    # A whole step's hidden state after its first layers (lazy): queued behind the step in
    # flight before that one's tokens are read (see DecodeBatch._lead_layers).
    lead: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [self.tokens] + [a for entry in self.logprobs if entry is not None for a in entry]

    def first_piece(self) -> list[mx.array]:
        """What to queue first: its first group of layers, or the whole step."""
        return self.groups[:1] or self.arrays()

    def piece(self, i: int) -> list[mx.array] | mx.array:
        """Its ``i``-th group of layers; past the last mark, the rest of the step."""
        return self.groups[i] if i < len(self.groups) else self.arrays()

    def rows(self, keep: list[int]) -> _Step:
        if len(keep) == len(self.logprobs):
            return self
        return _Step(batch_cache.take_rows(self.tokens, keep), [self.logprobs[i] for i in keep], self.groups)


class DecodeBatch:
    """The rows of one model decoding on the worker's stream.

    Args:
        loaded: The model.
        stream: The worker's stream (synchronized when the last row leaves).
        on_leave: Called with each row that left for good (done, stopped),
          after its final state is known and before it is reported: the
          worker keeps its cache and reports it. A row stopped while a step
          with it in is in flight leaves with no cache (``None``).
        keep: Called with the tokens and cache of a row that was reported
          stopped before its last step ended, once that step ended: the
          worker keeps the cache for prefix reuse. Default: ``None``
          (dropped).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        stream: mx.Stream,
        on_leave: Callable[[Row, Cache | None, BaseException | None], None],
        keep: Callable[[list[int], Cache, KVSettings], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.stream = stream
        self.on_leave = on_leave
        self.keep = keep
        # Held by the worker while it changes or reports rows, released while
        # the device works (queueing a step, reading its tokens): a stop asked
        # meanwhile is reported at once on its own thread (_on_request).
        # Re-entrant: a request made on the worker thread itself comes back here.
        self._lock = threading.RLock()
        self.rows: list[Row] = []
        self.ready: list[Row] = []  # prefilled or resumed, joining at the next step
        self.parked: list[Row] = []  # paused outside the batch
        self._cache: Cache = []
        self._pads: list[int] = []
        # The last step built: its tokens (one per row) are not read yet.
        self._y: _Step | None = None
        self.step_s: float | None = None
        self.in_flight = 1
        self._last_read = 0.0
        self.steps = 0
        # Views of the cache as the step in flight leaves it, while the next step is built but not
        # queued: if every row leaves then, they are cut out of these (see _cut_out). None otherwise.
        self._before_ahead: list[batch_cache.LayerState] | None = None
        # ``step(hold=True)`` is running; the step in ``_y`` is built but not queued yet.
        self._hold = False
        self._held = False
        # Seconds from the tokens read before to the last step's: one step's
        # device time while a step is queued before the host reports the one
        # before it; ``None`` for a batch's first step.
        self.last_interval: float | None = None
        # When the last step's tokens were read (time.perf_counter).
        self.last_step_at = 0.0
        # The last steps' times: the shortest bounds a joining prompt's turn (see fastest_step_s).
        self._recent_steps: deque[float] = deque(maxlen=8)
        self._row_attention = row_attention.wanted() and row_attention.install(self.model)
        # Decode buffers laid out for the device's attention kernels (see kv_capacity).
        self._per_shape = builds_kernels_per_shape()
        # The module whose layers a step goes through, for steps in groups of layers (found at the first).
        self._owner: nn.Module | None = None
        self._owner_found = False

    @property
    def fastest_step_s(self) -> float | None:
        """The shortest of the last 8 steps timed; ``None`` before one was.

        What a prompt fed in turn may take of the rows' gap is bounded with
        it (:mod:`.prompt_turn`), not with :attr:`step_s`: the running average
        still holds a batch's first steps (OpenBLAS's thread trials, a step
        right after a prefill): 385 ms when a prompt joined three rows of a
        Qwen3-0.6B shape on 2 cores, whose tokens came ~300 ms apart, so a
        bound read from it was 170 ms too wide.
        """
        return min(self._recent_steps) if self._recent_steps else None

    # -- membership -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows) + len(self.ready) + len(self.parked)

    def has_work(self) -> bool:
        """Whether a step would do something (rows decoding or waiting to join)."""
        return bool(self.rows or self.ready)

    def interrupted(self) -> None:
        """The worker does other work before this batch's next step (a prefill piece, a save): that step is not timed.

        Its tokens are read after that work, so the time since the read
        before holds it: during a join fed in turn on a 2-core CPU (3 rows,
        a 1,000-token prompt, budget 0.1) such intervals lifted the step time
        to 124 ms against 70-99 ms steps, and 32-68 of ~140 steps went in
        layer groups for a budget they fitted whole.
        """
        self._last_read = 0.0

    def add(self, row: Row) -> None:
        """Queue a prefilled row to join at the next step."""
        with self._lock:
            self._add(row)

    def reserve_for(self, tokens: int) -> batch_cache.Reserve | None:
        """Buffers for this batch's cache once a prompt of ``tokens`` joins it, to be allocated during its prefill.

        Only where the prompt will be the longest row by a margin (the batch
        grows a position a step while it prefills) and joins alone.
        """
        if not self.rows or self.ready or self._cache is None or not len(self._cache):
            return None
        top = tokens - 1  # the cache holds all but the last prompt token when it joins (_feed_last_again)
        layer = self._cache[0]
        # A lone row's cache is mlx-lm's own (no _idx).
        positions = layer._idx if hasattr(layer, "_idx") else batch_cache.length(self._cache)
        if top <= positions + 2 * KV_STEP:
            return None
        return batch_cache.Reserve(self._cache, len(self.rows) + 1, top)

    def _add(self, row: Row) -> None:
        tokenizer = self.loaded.tokenizer
        row.eos = set(tokenizer.eos_token_ids)
        # Each row streams its own text: a copy of the tokenizer's detokenizer, reset.
        row.detokenizer = copy.copy(tokenizer.detokenizer)
        row.detokenizer.reset()
        # The reasoning channel starts open when the prompt opened it; a thinking budget reads the row's tokens.
        row.sink.set_prompt(row.prompt)
        row.sample.follow(tokenizer, row.prompt, row.tokens)
        row.sink.stats.kv = row.kv.describe()
        constraint = row.request.constraint
        if constraint is not None and row.matcher is None:
            # The model's first constrained row waits here (at its checkpoints) for llguidance's tokenizer;
            # with a reasoning model the grammar holds the answer after the reasoning.
            row.matcher = RowMatcher.for_row(constraint, self.loaded, row.prompt, wait=row.pace.checkpoint)
        if row.tokens:
            self._replay(row)
        # A stop is reported on the thread that asks for it (see _on_request).
        row.pace.token.watchers.append(self._on_request)
        self.ready.append(row)

    def _replay(self, row: Row) -> None:
        """A row resumed from a file: its tokens so far, reported as the uninterrupted run reported them."""
        for tok in row.tokens:
            row.detokenizer.add_token(tok)
            if row.matcher is not None:
                try:
                    row.matcher.advance(tok)
                    row.matcher.done  # noqa: B018 (reads the child's answer: a refused token raises here)
                except Exception:
                    raise InvalidArgumentError(
                        f"the saved tokens do not fit the request's grammar (token {tok} is refused): "
                        "the file's request was changed; save the generation again"
                    ) from None
        row.sink.stats.generated_tokens = len(row.tokens)
        self._emit(row, list(row.tokens), row.detokenizer.last_segment)

    def close(self) -> None:
        """Forget the rows' requests (the session ends)."""
        with self._lock:
            for row in self.all_rows():
                self._unwatch(row)

    def abandon(self) -> list[Row]:
        """After a failed step: forget every row and the cache; the rows, for the caller to fail."""
        with self._lock:
            rows = self.all_rows()
            for row in rows:
                self._unwatch(row)
            self.rows, self.ready, self.parked = [], [], []
            self._cache, self._pads, self._y = [], [], None
            self._before_ahead = None  # a step failed between the build and the queue: its views go too
            return rows

    def _on_request(self) -> None:
        """A row's stop, pause or resume, on the thread that asked for it.

        A stop of a row that others outlive is reported here and now (see
        :meth:`_detach`): the worker holds the lock only while it changes or
        reports rows, not while the device runs or MLX queues a step, so this
        waits for at most that bookkeeping, not for the step in flight.
        """
        if not any(self._detachable(r) for r in list(self.rows)):
            # Nothing to report here (a lone row, a pause): the worker acts at its next check. Taking the lock
            # would wait for what it does under it (ending a row: 5-9 ms at 32k on an H200, a cache stored).
            return
        with self._lock:
            try:
                self._detach_stopped()
            except Exception:  # the worker reports the row at its next step instead
                log.exception("mlx-notebook: reporting a stop early failed")

    @contextlib.contextmanager
    def _released(self) -> Iterator[None]:
        """Let go of the lock (held once, by the worker in :meth:`step`) while the device works."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def poll_parked(self) -> None:
        """Re-join resumed rows; end the parked rows that were stopped."""
        with self._lock:
            self._poll_parked()

    def _poll_parked(self) -> None:
        for row in list(self.parked):
            token = row.pace.token
            if token.cancelled:
                self.parked.remove(row)
                row.paused_at = None
                self._leave(row, row.cache, FinishReason.STOPPED)
            elif not token.pause_requested:
                self.parked.remove(row)
                token.mark("resume")
                now = time.perf_counter()
                if row.paused_at is not None:
                    row.paused_s += now - row.paused_at
                    row.paused_at = None
                row.sink.set_state(State.DECODING if row.first_token_at is not None else State.PREFILLING)
                self.ready.append(row)

    def all_rows(self) -> list[Row]:
        """Every row: decoding, joining, parked."""
        return self.rows + self.ready + self.parked

    # -- one step ----------------------------------------------------------------

    def step(self, hold: bool = False) -> None:
        """Read one token of every row, report it, change rows, queue the next step.

        ``hold``: build the next step but queue it only at the next call. The
        worker feeds a prompt in turn before then (:meth:`.Session.between`):
        queued now, the step would run ahead of the prompt's next piece on the
        stream and be timed as part of it, and the chunk planner, told the
        others' step is the piece's cost, would cut the pieces small.
        """
        with self._lock:
            self._hold = hold
            try:
                self._step()
            finally:
                self._hold = False

    def _step(self) -> None:
        self._poll_parked()
        if self._y is None:
            self._admit()
            if not self.rows:
                return
            self._queue(self._first_step())
        y = self._y
        assert y is not None
        if self._held:
            self._held = False
            if self._all_stopped():
                # Stopped while their step waited unqueued: it never runs (as when they stop between two groups).
                self._change_rows([r.next_token for r in self.rows], None, abandoned=True)
                return
            with self._released():
                mx.async_eval(y.first_piece())
        continuing = [len(r.tokens) + 1 < r.request.max_tokens for r in self.rows]
        nxt = None  # the next step, built ahead
        ahead = None  # with a constrained row: the next step's logits, built ahead (sampled after the masks)
        queued = False
        inputs = y.tokens
        reading = len(self.rows)  # the rows whose tokens ``y`` makes
        if any(continuing) and self.ready and self._admits_ahead():
            self._admit()  # the rows join now, while ``y`` runs: the first joined step is built ahead too
            joined = [r.next_token for r in self.rows[reading:]]
            if joined:
                inputs = mx.concatenate([y.tokens, mx.array(joined, dtype=y.tokens.dtype)])
        if any(continuing) and not self.ready:
            if len(self.rows) > 1:
                self._before_ahead = batch_cache.snapshot(self._cache)
            if any(r.matcher is not None for r in self.rows):
                # A constrained row's next mask needs ``y``'s token read and fed
                # to its matcher: only the forward is built ahead, queued right
                # after the read, and the device runs it while the host feeds
                # the matchers and gets their masks; the sampling waits for them.
                ahead = self._logits(y.tokens)
            else:
                # The next step's graph is built while the device computes ``y``
                # (as mlx-lm does); it is queued before ``y`` is read only while
                # two steps fit the budget (see the module's docstring).
                beside = None
                if len(y.groups) > 1:
                    # Two pieces of ``y`` on the device while the host starts building the next step;
                    # at each of its marks the build waits for one and queues the next (see _forward).
                    with self._released():
                        mx.async_eval(y.groups[1])
                    beside = y
                nxt = self._forward(inputs, stoppable=True, beside=beside)
                if nxt is None:
                    pass  # every row stopped while it was built: y is abandoned below
                elif (
                    self.in_flight == 2
                    and not nxt.groups
                    and not self._hold
                    and not any(r.pace.requested for r in self.rows)
                ):
                    self._before_ahead = None
                    with self._released():
                        mx.async_eval(nxt.arrays())
                    queued = True
                elif nxt.lead is not None and not self._hold and not any(r.pace.requested for r in self.rows):
                    # Its first layers behind ``y``: the device has work while the host wakes and reads.
                    with self._released():
                        mx.async_eval(nxt.lead)
        with self._released():
            # Releases the GIL too: a stop asked now is reported on its own thread.
            whole = self._evaluate(y)
        if not whole:
            # Every row was stopped between two groups of the step's layers: its tokens are never read.
            self._change_rows([r.next_token for r in self.rows], None, abandoned=True)
            return
        # Rows that joined while ``y`` ran: the token the step built ahead feeds them stands for theirs.
        tokens = cast(list[int], y.tokens.tolist()) + [r.next_token for r in self.rows[reading:]]
        now = time.perf_counter()
        self.last_interval = now - self._last_read if self._last_read and self.steps else None
        if self.last_interval is not None:
            self._measure(self.last_interval)
        self._last_read = self.last_step_at = now
        self.steps += 1
        # Constrained rows' tokens to their matchers, one request per step, first: the
        # llguidance process fills the masks while the next forward is queued and run.
        RowMatcher.advance_all(
            [(r.matcher, t) for r, t in zip(self.rows, tokens) if r.matcher is not None and not r.detached]
        )
        if ((nxt is not None and not queued) or ahead is not None) and not self._hold:
            staying = [
                more and t not in r.eos and not r.pace.requested for t, r, more in zip(tokens, self.rows, continuing)
            ]
            if any(staying):
                # A row goes on: queue the next step now, before the
                # reporting, so the device idles only while it is encoded.
                self._before_ahead = None
                with self._released():
                    mx.async_eval(nxt.first_piece() if nxt is not None else ahead)
        for i, (row, tok, more) in enumerate(zip(self.rows, tokens, continuing)):
            if not row.detached:  # a detached row's token of this step is dropped
                self._report(row, tok, more, now, y.logprobs[i])
        self._change_rows(tokens, nxt, ahead)

    def _detach_stopped(self) -> None:
        for row in self.rows:
            if self._detachable(row):
                self._detach(row)

    def _detachable(self, row: Row) -> bool:
        """A stopped row that may be reported now: another row goes on (is not stopped)."""
        if row.detached or not row.pace.token.cancelled:
            return False
        return any(not r.detached and not r.pace.token.cancelled for r in self.rows)

    def _detach(self, row: Row) -> None:
        """Report ``row`` stopped now, while the step in flight still computes its share.

        Why this is "nothing in flight" (invariant 2) for this generation: the
        step is one computation for every row; it cannot be cut, and it runs
        for the rows that go on whether or not this one is in it. What it
        computes for this row (one token, one position of keys and values) is
        dropped or cut out when it ends: nothing in flight can change what
        this generation reports (its tokens and text are final from here) or
        hand it anything later. The device is busy, but with work that belongs
        to generations still running, and the stream is synchronized before
        the last of them is reported. So a row is detached only while another
        row goes on: a stop of every row, or of the last, waits for the step
        and the synchronize as before. The row stays in the batch's cache
        until the step ends; then its rows are cut out (and its prefix kept,
        ``keep``), like any row that leaves.
        """
        self._unwatch(row)
        self._finish(row, FinishReason.STOPPED)
        row.detached = True
        self.on_leave(row, None, None)

    def _unwatch(self, row: Row) -> None:
        watchers = row.pace.token.watchers
        if self._on_request in watchers:
            watchers.remove(self._on_request)

    def _report(
        self,
        row: Row,
        tok: int,
        more: bool,
        now: float,
        logprobs: tuple[mx.array, mx.array, mx.array] | None,
    ) -> None:
        stats = row.sink.stats
        row.tokens.append(tok)  # a constrained row's matcher was fed it already (step: RowMatcher.advance_all)
        if row.first_token_at is None:
            row.first_token_at = now
            stats.ttft_s = now - row.start
            stats.prompt_tps = len(row.prompt) / max(now - row.prefill_start, 1e-9)
            row.sink.set_state(State.DECODING)
            row.sink.progress("prefill", len(row.prompt), len(row.prompt))
        if tok in row.eos:
            # A constrained row's mask allows EOS only where its grammar accepts.
            row.finish = FinishReason.EOS if row.matcher is None else FinishReason.GRAMMAR
            return
        if logprobs is not None:
            chosen, top_ids, top_values = (a.tolist() for a in logprobs)
            top = sorted(zip(cast(list[int], top_ids), cast(list[float], top_values)), key=lambda p: -p[1])
            row.sink.add_logprobs(TokenLogprobs(tok, cast(float, chosen), top))
        row.detokenizer.add_token(tok)
        n = len(row.tokens)
        stats.generated_tokens = n
        if n > 1:
            # Paused time is not generation time.
            active = now - row.first_token_at - row.paused_s
            stats.generation_tps = (n - 1) / max(active, 1e-9)
        if n % 32 == 1:
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            stats.kv_bytes = self._row_kv_bytes()
        self._emit(row, [tok], row.detokenizer.last_segment)
        if row.matcher is not None and row.matcher.done and row.finish is None:
            row.finish = FinishReason.GRAMMAR  # the value closed: nothing but EOS may follow
        if not more and row.finish is None:
            row.finish = FinishReason.LENGTH

    def _emit(self, row: Row, token_ids: list[int], text: str) -> None:
        """Report text, holding back what may be the start of a stop string; end the row at one."""
        stops = row.request.stop
        if not stops:
            row.sink.emit(token_ids, text)
            return
        thought, text = row.sink.split(text)  # stop strings read the answer, not the reasoning
        text = row.held + text
        hits = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        if hits:
            row.held = ""
            row.sink.emit_split(token_ids, thought, text[: min(hits)])
            row.finish = FinishReason.STOP_STRING
            return
        # The longest end of the text that begins some stop string waits for the next token.
        keep = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        row.held = text[len(text) - keep :] if keep else ""
        row.sink.emit_split(token_ids, thought, text[: len(text) - keep])

    def _change_rows(
        self, tokens: list[int], nxt: _Step | None, ahead: mx.array | None = None, *, abandoned: bool = False
    ) -> None:
        """Drop finished, stopped and paused rows; admit the ready ones; queue the next step.

        ``nxt`` is the next step if it was built ahead; ``ahead`` its logits
        only (a constrained row in the batch): either way the cache holds one
        more position per row, which a pausing row gives back.

        ``abandoned``: every row was stopped before the step in flight ended,
        and the rest of it never runs. The rows' caches hold that step's
        position in part, and a copy of any row would compute the rest of
        the step before the last row may be reported, over the stop's
        budget. So a batch's rows leave without a copy, and the prefix
        cache keeps none of them. A lone row's own cache is kept as it is,
        lazily, since it holds no other row's buffers.
        """
        leaving = [i for i, r in enumerate(self.rows) if r.finish is not None or r.pace.requested]
        if leaving:
            self.interrupted()  # the next step's interval holds the leaving and is another batch's
            keep = [i for i in range(len(self.rows)) if i not in leaving]
            # Every row leaves before the step built ahead is queued: cut before it (see _cut_out).
            before = self._before_ahead if not keep else None
            copies = {i: None if abandoned and len(self.rows) > 1 else self._cut_out(i, before) for i in leaving}
            if not keep:
                # The batch empties: nothing may stay in flight when the last
                # row is reported (a stop-all, an interrupt, a pause of all),
                # the leaving rows' copies out of the batch's arrays included.
                mx.async_eval(
                    [
                        a
                        for c in copies.values()
                        if c is not None and c is not self._cache
                        for a in batch_cache.state_arrays(c)
                    ]
                )
                mx.synchronize(self.stream)
                self.interrupted()  # the next rows' first step is not measured from these
            for i in leaving:
                self._take_out(
                    self.rows[i],
                    copies[i],
                    tokens[i],
                    built_ahead=(nxt is not None or ahead is not None) and (before is None or copies[i] is self._cache),
                    sampled=nxt is not None,
                )
            if keep:
                self._keep(keep)
                if nxt is not None:
                    nxt = nxt.rows(keep)
                if ahead is not None and len(keep) < ahead.shape[0]:
                    ahead = batch_cache.take_rows(ahead, keep)
                tokens = [tokens[i] for i in keep]
            else:
                self._cache, self._pads, self.rows = [], [], []
                nxt = ahead = None
        self._before_ahead = None
        if nxt is not None:
            self._queue(nxt)  # queued already unless every row was leaving
            return
        if ahead is not None:
            self._queue(self._sample(ahead))  # the forward is queued already; now its masks and sampling
            return
        self._y = None
        for row, tok in zip(self.rows, tokens):
            row.next_token = tok
        if self.rows or self.ready:
            self._admit()
            self._queue(self._first_step())

    def _queue(self, step: _Step) -> None:
        """Make ``step`` the one in flight and queue it on the device (the lock let go meanwhile); held: at the next step."""
        self._y = step
        if self._hold:
            self._held = True
            return
        with self._released():
            mx.async_eval(step.first_piece())

    def _all_stopped(self) -> bool:
        return bool(self.rows) and all(r.pace.token.cancelled for r in self.rows)

    def _evaluate(self, step: _Step) -> bool:
        """Wait for ``step``'s tokens, group by group when it has groups; ``False``: every row stopped between two."""
        if step.waited and self._all_stopped():
            return False  # stopped after a group waited while the next step was built
        while step.waited < len(step.groups):
            if not self._wait_group(step):
                return False
        mx.eval(step.tokens)
        return True

    def _wait_group(self, step: _Step) -> bool:
        """Wait for ``step``'s next group of layers; ``False``: every row is stopped now.

        The group after it is queued first, so the device does not idle
        while the host waits and checks: a stop waits for two groups at most.
        """
        i = step.waited
        mx.async_eval(step.piece(i + 1))
        mx.eval(step.groups[i])
        step.waited += 1
        return not self._all_stopped()

    def _cut_out(self, index: int, before: list[batch_cache.LayerState] | None = None) -> Cache:
        """Row ``index``'s cache: a lone row's own, or a (lazy) copy out of the batch's arrays.

        ``before``: views of the cache taken before the next step was built
        (:func:`~.batch_cache.snapshot`), given when every row leaves before
        that step is queued. Cut from the built step's arrays, the copies
        made the device compute that whole step for nothing (a CPU stop of
        4 rows right after a join: 60 of the last row's 81 ms). Where a row
        stays the step runs anyway, and the copies are cut after it: cut
        before, they would hold its input buffers while it writes them, and
        it would copy them instead of writing in place.
        """
        if len(self.rows) == 1:
            return self._cache
        return batch_cache.extract(self._cache, self._pads, index, before)

    def _take_out(self, row: Row, single: Cache | None, tok: int, *, built_ahead: bool, sampled: bool) -> None:
        """``row`` leaves with its cache ``single`` (:meth:`_cut_out`; ``None``: a stop that keeps none): parked
        (pause) or ended (done, stop).

        ``built_ahead``: the next step's forward was built and its position
        of keys and values is in ``single``; ``sampled``: its sampling was
        built too (the row's key was split for it).
        """
        if row.detached:
            # Reported already; its cache holds its prompt and read tokens (and
            # the dropped steps' positions, which ``keep`` trims off).
            if single is None:
                return
            if single is not self._cache:
                mx.async_eval(batch_cache.state_arrays(single))
            if self.keep is not None:
                self.keep(row.fed_tokens(), single, row.kv)
            return
        token = row.pace.token
        if row.finish is None and token.pause_requested and not token.cancelled:
            assert single is not None  # an abandoned step's rows were all stopped
            # Drop this row's share of the step built after ``tok``: trim
            # ``tok``'s keys and values and undo its key split, so that
            # resume computes exactly that step again.
            if built_ahead:
                for layer in single:
                    layer.trim(1)
            if sampled:
                row.sample.undo()
            row.next_token = tok
            row.cache = single
            if single is not self._cache:
                # A copy out of the batch's arrays: evaluate it so that it holds none of them.
                mx.async_eval(batch_cache.state_arrays(single))
            row.paused_at = time.perf_counter()
            token.mark("pause")
            row.sink.set_state(State.PAUSED)
            self.parked.append(row)
            return
        finish = row.finish if row.finish is not None else FinishReason.STOPPED
        self._leave(row, single, finish)

    def _leave(self, row: Row, cache: Cache | None, finish: FinishReason) -> None:
        if not self.rows:
            # Nothing may stay in flight when the last row is reported.
            mx.synchronize(self.stream)
        if cache is not None and cache is not self._cache:
            # A copy out of the batch's arrays: evaluate it so that it holds none of them.
            mx.async_eval(batch_cache.state_arrays(cache))
        self._unwatch(row)
        self._finish(row, finish)
        self.on_leave(row, cache, None)

    def _finish(self, row: Row, finish: FinishReason) -> None:
        """The row's last text (detokenizer tail, held-back text) and final stats."""
        row.finish = finish
        if finish is not FinishReason.STOP_STRING:
            row.detokenizer.finalize()
            tail = row.detokenizer.last_segment
            if finish in (FinishReason.STOPPED, FinishReason.FAILED):
                # Cut short, the text keeps what the stream held back except the
                # bytes of a character not complete yet: the detokenizer writes
                # them as U+FFFD, which the next token would have replaced, so the
                # text would not be a prefix of the uninterrupted one. Tokens keep them.
                tail = tail.rstrip("\ufffd")
            if tail:
                self._emit(row, [], tail)
            if row.finish is not FinishReason.STOP_STRING and row.held:
                row.sink.emit_split([], "", row.held)
            row.held = ""
            finish = row.finish
        if not row.greedy:
            row.sink.keep_sampler_key(row.sample.key)  # read only if the generation is saved
        stats = row.sink.stats
        stats.finish_reason = finish
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        if row in self.rows:
            stats.kv_bytes = self._row_kv_bytes()

    def _keep(self, keep: list[int]) -> None:
        rows = [self.rows[i] for i in keep]
        if len(self.rows) == 1:
            return
        if len(keep) == 1:
            # Back to one row: the plain cache again (the solo step).
            self._cache = batch_cache.extract(self._cache, self._pads, keep[0])
            self._pads = [0]
        else:
            self._pads = batch_cache.keep_rows(self._cache, self._pads, keep)
        self.rows = rows

    def _admits_ahead(self) -> bool:
        """Whether the ready rows may join while the step in flight runs, and the first joined step be built meanwhile.

        Otherwise they join after its tokens are read, and the first joined
        step is built while the device idles: on an H200 (Qwen3-8B shape, 7
        rows joined by an 8k prompt) the merge and that build were 11-14 ms
        of the others' gap between two tokens, which the bound of budget +
        2 steps (35-39 ms there) could not spare (benchmarks/results/
        h200_admit_session32.log). Only for a batch of rows already (a lone
        row's cache is converted at a join) and rows without a grammar or
        logits processors: a constrained row's step is built in two parts,
        and a joining row's processors would see its last prompt token twice
        (it is fed again, and would be the step's pending token too).
        """
        if len(self.rows) < 2:
            return False
        return not any(r.matcher is not None or r.sample.processors for r in self.rows + self.ready)

    def _admit(self) -> None:
        """Merge the ready rows' caches into the batch, between steps or while one runs (:meth:`_admits_ahead`).

        A step in flight wrote its position into the rows' caches (lazily): the
        merge copies them with it.
        """
        if not self.ready:
            return
        joining, self.ready = self.ready, []
        reserve = joining[0].reserve if len(joining) == 1 else None
        for row in joining:
            row.reserve = None  # a parked row must not hold the buffers
        for row in list(joining):
            token = row.pace.token
            if token.cancelled:
                joining.remove(row)
                self._leave(row, row.cache, FinishReason.STOPPED)
            elif token.pause_requested:
                joining.remove(row)
                _feed_last_again(row)  # parked as every paused row is: its cache before next_token
                row.paused_at = time.perf_counter()
                token.mark("pause")
                row.sink.set_state(State.PAUSED)
                self.parked.append(row)
        if not joining:
            return
        self.interrupted()  # the next step's interval holds the merge, and a step not built ahead
        if self.rows or len(joining) > 1:
            for row in joining:
                _feed_last_again(row)  # a batched step feeds it with the others
        caches = [r.cache for r in joining]
        for r in joining:
            r.cache = None
        if not self.rows and len(joining) == 1:
            self._cache, self._pads = caches[0], [0]  # type: ignore[assignment]
        elif not self.rows:
            self._cache, self._pads = batch_cache.merge(caches)  # type: ignore[arg-type]
        else:
            if len(self.rows) == 1:
                self._cache, self._pads = batch_cache.merge([self._cache])
            self._pads = batch_cache.extend(self._cache, self._pads, caches, reserve)  # type: ignore[arg-type]
            # The rows' copy into the joined buffers runs while the host builds the first joined step, not
            # after it (H200, Qwen3-8B shape, 7 rows joined by an 8k prompt: the copy 6-24 ms, the build
            # 9-13 ms, both in the others' gap; benchmarks/results/h200_admit_session32.log).
            with self._released():
                mx.async_eval([a for layer in self._cache for a in (layer.keys, layer.values) if a is not None])
        self.rows = self.rows + joining

    # -- the model -------------------------------------------------------------------

    def _first_step(self) -> _Step:
        """The step after rows changed between steps: a forward, or a lone row's first logits sampled."""
        first = self.rows[0].first_logits if len(self.rows) == 1 else None
        if first is None:
            return self._forward([r.next_token for r in self.rows])
        self.rows[0].first_logits = None
        return self._sample(self._processed(first, None))

    @overload
    def _forward(self, inputs: list[int] | mx.array) -> _Step: ...

    @overload
    def _forward(self, inputs: list[int] | mx.array, stoppable: bool, beside: _Step | None = None) -> _Step | None: ...

    def _forward(
        self, inputs: list[int] | mx.array, stoppable: bool = False, beside: _Step | None = None
    ) -> _Step | None:
        """Build one decode step for every row (lazy), in groups of layers when a stop cannot wait for a whole one.

        ``inputs`` is a list of read tokens, or the previous step's tokens
        before they are read (a step built while the device computes that one).
        ``stoppable``: a step in groups of a lone row stops being built when
        the row is stopped (``None``; the layers built give their position back).
        ``beside``: the step in flight, in groups: the build waits for one of
        them at each of its own marks and queues the next. Otherwise only the
        two groups queued before the build would run during it, and the rest
        of that step after it: on a host-bound device (an H200, 8 rows, 8B
        shape) the build's ~9 ms and the device's work would add up, not
        overlap (16-17 ms steps in groups against 13.5-14.6 whole; fed, 13.8-15.6).
        """
        per = self._layers_per_group()
        if not per:
            lead = self._lead_layers() if stoppable else 0
            for row in self.rows:
                row.sink.stats.decode_pieces = 1
                row.sink.stats.decode_lead_layers = lead
            if not lead:
                return self._sample(self._logits(inputs))
            assert self._owner is not None
            with MarkedLayers(self._owner, lead) as marked:
                logits = self._logits(inputs)
            whole = self._sample(logits)
            whole.lead = marked.marks[0] if marked.marks else None
            return whole
        assert self._owner is not None
        # A lone row's cache trims back (a batch's rows would have to agree first).
        stopped = self._all_stopped if stoppable and len(self.rows) == 1 else None
        try:
            with MarkedLayers(self._owner, per, stopped, self._feeder(beside)) as marked:
                logits = self._logits(inputs)
        except BuildStopped:
            for layer in self._cache[: marked.built]:
                layer.trim(1)
            return None
        step = self._sample(logits)
        step.groups = marked.marks
        for row in self.rows:
            row.sink.stats.decode_pieces = len(step.groups) + 1
        return step

    def _feeder(self, step: _Step | None) -> Callable[[], None] | None:
        """What a build calls at its marks: wait for ``step``'s next group (the lock let go), until all are waited."""
        if step is None:
            return None

        def feed() -> None:
            if step.waited < len(step.groups) and not (step.waited and self._all_stopped()):
                with self._released():
                    if self._wait_group(step) and step.waited < len(step.groups):
                        # Two groups on the device again while the build goes on (as before it began).
                        mx.async_eval(step.piece(step.waited + 1))

        return feed

    def _layers_per_group(self) -> int:
        """Layers per piece of a step (:func:`.decode_pacing.layers_per_group`): 0, whole steps."""
        # Before this batch measured a step: the model's last one alone (a row of a long context that
        # follows another starts in pieces; a wrong guess lasts until the second step is read).
        step = self.step_s if self.step_s is not None else self.loaded.step_s
        if step is None or self.in_flight != 1 or not self.loaded.layer_pieces or not self.rows:
            return 0
        budget = min(r.pace.budget_s for r in self.rows)
        if step <= budget:
            return 0  # before the layer list is looked for: most steps fit
        return decode_pacing.layers_per_group(step, budget, self._layer_count())

    def _layer_count(self) -> int:
        """Layers of the model's layer list a step's marks go through (found at the first ask); 0: none found."""
        if not self._owner_found:
            self._owner, self._owner_found = layer_owner(self.model, len(self._cache)), True
        return len(self._owner.layers) if self._owner is not None else 0

    def _lead_layers(self) -> int:
        """Layers of a lone row's next whole step to queue before its token is read; 0: none.

        See :func:`.decode_pacing.lead_layers` (why, and what fits) and
        :func:`.decode_pacing.lead_wanted` (where, as measured). A lone row
        only: a batch's rows leaving all at once are cut from views of the
        cache taken before the next step (``_before_ahead``), which a queued
        lead would make the device copy.
        """
        if not decode_pacing.lead_wanted(self._per_shape) or self.in_flight != 1 or len(self.rows) != 1:
            return 0
        if self.step_s is None or not self.loaded.layer_pieces:
            return 0
        return decode_pacing.lead_layers(self.step_s, self.rows[0].pace.budget_s, self._layer_count())

    def _logits(self, inputs: list[int] | mx.array) -> mx.array:
        """A step's forward for every row, to its processed logits (lazy); see :meth:`_forward`."""
        pending = isinstance(inputs, mx.array)
        if not isinstance(inputs, mx.array):
            inputs = mx.array(inputs, dtype=mx.uint32)
        if len(self.rows) == 1:
            # Before the call, not after as mlx-lm does: the same cache at every
            # call, and a step built ahead and undone on pause converted nothing.
            self.rows[0].kv.quantize(self._cache)
        elif self._row_attention:
            row_attention.mark(self._cache, self._pads)
        kv_capacity.make_room(self._cache, 1, per_shape=self._per_shape)
        logits = self.model(inputs[:, None], cache=self._cache)[:, -1, :]
        return self._processed(logits, inputs if pending else None)

    def _processed(self, logits: mx.array, pending: mx.array | None) -> mx.array:
        """``logits`` after the rows' logits processors; ``pending``: the step's input tokens, not read yet."""
        if any(r.sample.processors for r in self.rows):
            # mlx-lm's logits processors (bias, repetition penalty), row by row, on the row's context.
            logits = mx.concatenate(
                [
                    r.sample.process(
                        r.context(pending[i : i + 1] if pending is not None else None),
                        logits[i : i + 1],
                        pending=pending is not None,
                    )
                    if r.sample.processors
                    else logits[i : i + 1]
                    for i, r in enumerate(self.rows)
                ]
            )
        return logits

    def _sample(self, logits: mx.array) -> _Step:
        """A step's tokens (and kept log-probabilities) from its logits (lazy); constrained rows masked first."""
        if any(r.matcher is not None for r in self.rows):
            # The forward is queued first (already, when built ahead), so the
            # device runs it while the host waits for the matchers' masks (the
            # lock let go: a stop meanwhile is reported at once); only the
            # sampling below waits for them.
            matchers = [r.matcher for r in self.rows]
            with self._released():
                mx.async_eval(logits)
                logits = mask_logits(logits, matchers)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if len(self.rows) == 1:
            tokens = self.rows[0].sample(logprobs)
        elif all(r.greedy for r in self.rows):
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            # Each row samples with its own key, split once per token as when solo.
            tokens = mx.concatenate([r.sample(logprobs[i : i + 1]) for i, r in enumerate(self.rows)])
        kept: list[tuple[mx.array, mx.array, mx.array] | None] = []
        for i, r in enumerate(self.rows):
            k = min(r.request.logprobs, logprobs.shape[-1])
            if not k:
                kept.append(None)
                continue
            row_lp = logprobs[i]
            top = mx.argpartition(-row_lp, k - 1)[:k]
            kept.append((row_lp[tokens[i]], top, row_lp[top]))
        return _Step(tokens, kept)

    def _row_kv_bytes(self) -> int:
        """Bytes of KV cache per row now (a batch's padded cache shared out evenly)."""
        return cache_nbytes(self._cache) // max(1, len(self.rows))

    def _measure(self, seconds: float) -> None:
        """Update the step time and choose how many steps to keep in flight."""
        self._recent_steps.append(seconds)
        step = self.step_s = decode_pacing.smoothed_step(self.step_s, seconds)
        if len(self.rows) == 1:
            self.loaded.step_s = step
        self.in_flight = decode_pacing.steps_in_flight(step, min(r.pace.budget_s for r in self.rows))
        for row in self.rows:
            stats = row.sink.stats
            stats.decode_step_s = step
            stats.decode_in_flight = self.in_flight
            stats.budget_below_step = step > row.pace.budget_s


def _feed_last_again(row: Row) -> None:
    """Drop a row's first logits: a step feeds its last prompt token after all (cut off its cache)."""
    if row.first_logits is not None and row.cache is not None:
        row.first_logits = None
        for layer in row.cache:
            layer.trim(1)
