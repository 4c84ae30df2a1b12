"""Prefill chunk sizes: as large as fits the stop budget, in shapes the device has seen.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import statistics

import mlx.core as mx

from .fit import least_squares, median_line

MAX_PREFILL_CHUNK = 2048  # a power of two (see ChunkPlanner)
FIRST_PREFILL_CHUNK = 8
KV_STEP = 256  # mlx-lm's KVCache.step
WINDOW = 8  # recent chunks the per-token cost is fitted over
FIXED_WINDOW = 48  # chunks the fixed cost is fitted over
LOADED_PROBE = 4  # under load, every 4th chunk is a probe of the fixed part (see _loaded_chunk)
LOADED_SHARE = 2.25  # under load, a chunk takes this many times a probe's time
SUSPECT = 3.0  # a chunk over this many times its prediction is a preemption or new load


def builds_kernels_per_shape() -> bool:
    """Whether the device builds attention kernels per input shape (the CUDA backend's cuDNN graphs)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and cuda.is_available()


class ChunkPlanner:
    """Sizes prefill chunks from a cost model, ``t = fixed + n * (per_token + per_context * position)``.

    A plain per-token rate fails on accelerators: a chunk of 8 tokens costs
    about as much as one of 200 (reading the weights dominates), so the rate
    of a small chunk predicts tiny chunks forever. Fitting a fixed cost plus a
    per-token cost over the recent chunks lets the size grow to what fits;
    attention makes a token's cost grow with its position, and the next
    chunk is predicted at its own (an H200 at 16k: 17x a token at 0).

    Timings are noisy (preemptions; a loaded CPU scatters one chunk's time
    over 0.2-5 s): the fit is a median line, a chunk far over its prediction
    is kept out of it unless three come in a row (the cost changed), and
    where the fixed part alone exceeds the budget (CPU load makes it 15-25x)
    chunks are sized for throughput instead (see :meth:`_loaded_chunk`).

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

    def __init__(
        self, cost: tuple[float, float] | None = None, shapes_seen: set[tuple[int, int]] | None = None
    ) -> None:
        self.cost: tuple[float, float] | None = (cost[0], cost[1]) if cost is not None else None
        self.shapes_seen = shapes_seen
        # (fixed, per_token, per_context): a chunk of n from start costs
        # fixed + n * (per_token + per_context * (start + n / 2)).
        self._model: tuple[float, float, float] | None = (cost[0], cost[1], 0.0) if cost is not None else None
        self._samples: list[tuple[int, int, float]] = []  # (n, start, seconds), the fit window
        self._suspects: list[tuple[int, int, float]] = []  # chunks far over their prediction, in a row
        self._last = 0
        self._grow_blind = False
        self._loaded = False  # the budget cannot be kept (see _loaded_chunk)
        self._loaded_count = 0
        self._probing = False  # the chunk planned last is a probe
        self._probes: list[float] = []  # times of the loaded plan's probes
        self._recent: list[tuple[int, float]] = []  # (n, seconds) of the last other chunks

    def _predict(self, n: int, start: int) -> float:
        fixed, per_token, per_context = self._model or (0.0, 0.0, 0.0)
        return fixed + n * (per_token + per_context * (start + n / 2))

    def observe(self, n: int, seconds: float, *, start: int) -> None:
        """Record that the chunk of ``n`` tokens from ``start`` took ``seconds``."""
        self._last = n
        if self.shapes_seen is not None and (start, n) not in self.shapes_seen:
            self.shapes_seen.add((start, n))
            if self._model is None or seconds > 2 * self._predict(n, start):
                self._grow_blind = True
                return
        self._grow_blind = False
        if self._probing:
            self._probing = False
            self._probes = (self._probes + [seconds])[-12:]
        else:
            # Preemptions included: leaving them out (see below) biased the
            # loaded plan toward the lucky chunks, and up to 5x too big.
            self._recent = (self._recent + [(n, seconds)])[-3:]
        sample = (n, start, seconds)
        if self._model is not None and seconds > SUSPECT * self._predict(n, start):
            self._suspects.append(sample)
            if len(self._suspects) < 3:
                # A preemption, or load that just arrived: one chunk cannot
                # tell (two preemptions in a row happen). Kept out of the fit;
                # the next chunk is planned as if every cost had grown by as
                # much (see next_chunk).
                return
            # Three in a row: the cost changed. What came before them
            # describes another machine.
            self._samples = self._suspects[:-1]
        self._suspects = []
        self._samples = (self._samples + [sample])[-FIXED_WINDOW:]
        self._model = self._fit()
        fixed, per_token, per_context = self._model
        self.cost = (fixed, per_token + per_context * (start + n))

    def _fit(self) -> tuple[float, float, float]:
        """The cost model through the window, every part >= 0.

        Timings are noisy (a loaded CPU scatters one chunk's time over 0.2-5 s)
        and a least-squares line through them swings wildly: the fixed and
        per-token parts come from the median line instead. Growth with the
        context is fitted by least squares only where it explains most of
        what the line leaves (late chunks at long context, measured cleanly).
        Where the sizes are too alike to tell the fixed part from the
        per-token part, the fixed part stays what it was, and no more than a
        typical chunk took: at a cold start that is 0, the pessimistic
        reading for bigger chunks.
        """
        if len(self._samples) >= 5:
            rows = [(1.0, float(n), n * (s + n / 2)) for n, s, _ in self._samples]
            ys = [t for _, _, t in self._samples]
            line, grown = least_squares([r[:2] for r in rows], ys), least_squares(rows, ys)
            if line is not None and grown is not None and min(grown) >= 0:

                def rss(c: list[float]) -> float:
                    return sum((y - sum(x * k for x, k in zip(r, c))) ** 2 for r, y in zip(rows, ys))

                if rss(grown) <= rss(line) / 4:
                    return grown[0], grown[1], grown[2]
        # The fixed part does not change with the context: it comes from the
        # median line through all kept chunks (the per-token part from the
        # recent ones only), or, where that line has no fixed part (sizes too
        # alike, or noise), it stays what it was, and no more than a typical
        # chunk took. Dropping it to 0 read a loaded CPU's time as per-token
        # cost and shrank the chunks toward one token.
        pts = self._samples[-WINDOW:]
        ys = [t for _, _, t in pts]
        line2 = median_line([(n, t) for n, _, t in self._samples], 1.5)
        if line2 is not None and line2[0] >= 0:
            fixed = line2[0] if line2[1] > 0 else statistics.median(ys)
        else:
            fixed = min(self._model[0] if self._model else 0.0, statistics.median(ys))
        return fixed, max(0.0, statistics.median((t - fixed) / n for n, _, t in pts)), 0.0

    def next_chunk(self, target_s: float, done: int, remaining: int) -> int:
        """The next chunk size for a piece budget of ``target_s`` seconds."""
        if self._grow_blind:
            n = self._last * 4
        elif self._model is None:
            n = FIRST_PREFILL_CHUNK
        else:
            fixed, per_token, per_context = self._model
            recent = [t for _, _, t in self._samples[-3:]]
            if fixed >= target_s or (self._last <= FIRST_PREFILL_CHUNK and min(recent or [0.0]) > target_s):
                # The fixed part alone exceeds the budget, or chunks of a few
                # tokens all ran over it (a fit through such chunks cannot tell
                # fixed from per-token cost, and read as per-token they shrank
                # to one token, each paying the fixed part again).
                self._loaded = True
            elif 2 * fixed < target_s:
                # Until the budget holds more token time than fixed time again:
                # the fit wanders, and each fall back shrank chunks to a few tokens.
                self._loaded = False
            if self._loaded:
                n = self._loaded_chunk()
            else:
                if self._suspects:
                    # After a chunk far over its prediction, plan as if every
                    # part of the cost had grown by as much.
                    last = self._suspects[-1]
                    ratio = last[2] / self._predict(last[0], last[1])
                    fixed, per_token, per_context = fixed * ratio, per_token * ratio, per_context * ratio
                n = self._measured_bound(_size_within(target_s - fixed, done, per_token, per_context), target_s, done)
                if n <= 1 and self._last == 1 and self._samples[-1:] and self._samples[-1][2] > target_s:
                    # A single token ran over the budget: shrinking cannot help,
                    # and only a bigger chunk tells a fixed part (load) from a
                    # costly token. Without it, chunks stuck at one token
                    # (reading the time all per-token) paid a loaded CPU's fixed
                    # part for every token.
                    n = 4
            if self._last and not self._loaded:
                # At most 4x growth a chunk: the cost model extrapolates.
                n = min(n, self._last * 4)
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

    def _loaded_chunk(self) -> int:
        """A chunk whose tokens take about 1.25x its fixed part, where that part alone exceeds the budget.

        The budget cannot be kept there (CPU load makes every evaluation wait
        for the scheduler: the fixed part 15-25x), and smaller chunks only pay
        the fixed part more often (a collapse to 1-20 tokens made a loaded
        prefill 10x slower): a little over half the time goes to tokens, and
        a stop waits about twice the fixed part. A preemption changes nothing
        here: it scales both parts alike.

        Such timings scatter (0.2-5 s for one 4-token chunk), and a line
        through them cannot find the fixed part unless small and big chunks
        both ran: every ``LOADED_PROBE``-th chunk is a probe of
        ``FIRST_PREFILL_CHUNK`` tokens, whose time is nearly all fixed part.
        The other chunks scale the recent ones to ``LOADED_SHARE`` times that
        part, read all per-token: this converges on the size from below (2x a
        chunk from far below) and from above, needing no per-token fit.
        """
        self._loaded_count += 1
        if not self._probes or not self._recent or self._loaded_count % LOADED_PROBE == 0:
            # Also the first chunk planned so: a fixed part carried from another
            # generation may be load that has gone.
            self._probing = True
            return FIRST_PREFILL_CHUNK
        # A little over the fixed part (the probe's own tokens): bigger chunks,
        # not smaller. Subtracting them at a fitted per-token cost made the
        # plan follow that fit's noise again.
        fixed = statistics.median(self._probes)
        scaled = statistics.median(m * LOADED_SHARE * fixed / t for m, t in self._recent)
        return max(FIRST_PREFILL_CHUNK, min(int(scaled), 2 * self._recent[-1][0]))

    def _measured_bound(self, n: int, target_s: float, done: int) -> int:
        """``n``, or less where it is beyond the largest recent chunk and that chunk's time per token forbids it.

        A line through small chunks is mostly their fixed cost: its slope says
        nothing about big ones, and a fresh process grew from such a line into
        a chunk many times its budget. Beyond the sizes measured, a token costs
        no less than it did in the largest recent chunk (an upper bound where
        the fixed part is >= 0), plus the fitted growth with the context since,
        so growth stays within what was measured.
        """
        measured = self._samples + self._suspects
        if not measured:
            return n
        ref_n, ref_start, ref_s = max(reversed(measured), key=lambda s: s[0])
        if n <= ref_n:
            return n
        per_context = self._model[2] if self._model else 0.0
        per_token = ref_s / ref_n + per_context * (done + n / 2 - ref_start - ref_n / 2)
        return max(ref_n, min(n, int(target_s / per_token)))

    def _seen_size(self, size: int, done: int, remaining: int) -> int:
        """``size``, or up to 4x smaller where only that chunk from ``done`` ran before.

        The cost carried from the end of a long prompt (attention makes late
        chunks slower) wobbles the plan of the next run between neighbouring
        powers of two; a smaller chunk already built costs a little
        throughput, a new one a graph build inside a piece (72 ms at 32k).
        """
        for candidate in (size, size // 2, size // 4):
            if candidate >= 1 and (done, _aligned(candidate, done, remaining)) in (self.shapes_seen or ()):
                return candidate
        return size


def _aligned(size: int, done: int, remaining: int) -> int:
    """The chunk from ``done`` that ends on the next multiple of ``size`` (or the prompt's end)."""
    return min((done // size + 1) * size - done, remaining)


def _size_within(seconds: float, start: int, per_token: float, per_context: float) -> int:
    """The most tokens from ``start`` whose per-token part fits ``seconds`` (the model's quadratic)."""
    if seconds <= 0:
        return 0
    a, b = per_context / 2, per_token + per_context * start
    if a == 0:
        return int(seconds / b) if b > 0 else MAX_PREFILL_CHUNK
    return int((-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a))
