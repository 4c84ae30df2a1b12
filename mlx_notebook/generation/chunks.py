"""Prefill chunk sizes: as large as fits the stop budget, in shapes the device has seen.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import mlx.core as mx

from .fit import nonnegative_fit

MAX_PREFILL_CHUNK = 2048  # a power of two (see ChunkPlanner)
FIRST_PREFILL_CHUNK = 8
KV_STEP = 256  # mlx-lm's KVCache.step
# Recent chunks the cost is fitted to.
FIT_WINDOW = 8
# A chunk over this many times the fit of the others is a preemption, left out of the fit.
SPIKE = 1.8
# Where no token fits the target: a chunk's tokens cost this many times its fixed part.
BALANCE = 1.0
# The last two chunks both off the fit by this factor: the device changed, and only they are kept.
SHIFT = 2.0


def with_room(n: int, room: int) -> int:
    """Positions of a cache buffer that holds ``n`` and has room for ``room`` more, in whole ``KV_STEP``s."""
    return (n + room + KV_STEP - 1) // KV_STEP * KV_STEP


def builds_kernels_per_shape() -> bool:
    """Whether the device builds attention kernels per input shape (the CUDA backend's cuDNN graphs)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and cuda.is_available()


class ChunkPlanner:
    """Sizes prefill chunks from a cost model fitted to the recent chunks.

    The model is ``t = fixed + n * (per_token + per_context * position)``,
    each part >= 0 (:func:`~.fit.nonnegative_fit`, by relative error). A plain
    per-token rate fails on accelerators: a chunk of 8 tokens costs about as
    much as one of 200 (reading the weights dominates), so the rate of a small
    chunk predicts tiny chunks forever; the fixed part lets the size grow to
    what fits. The context part follows attention, which makes a token at 16k
    cost many times one at 0 (an affine fit lagged it, and late chunks ran past
    the budget). Preemptions (a chunk over :data:`SPIKE` x the fit of the
    others) are left out; two surprises the same way mean load came or went,
    and the fit restarts from them (a lower-envelope fit had cut chunks to
    6-21 tokens at load ~11 on 2 cores: 122 s for a prefill of 14 s quiet).

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

    A prompt starts from the last prompt's chunks (``history``), not from its
    fit alone: the fit's context part and the chunks' measured time per token
    come with them. Carried as ``(fixed, per_token)``, a fit that had put the
    late chunks' cost into the context part gave a per-token part of 0, and
    the next prompt opened with a 2,048-token chunk (the tiny test model at
    budget 0.05 on this CPU: stops 0.4-0.8 s into it, the fault campaign's).

    Args:
        cost: A ``(fixed_s, per_token_s)`` from an earlier generation, or
          ``None``; ignored where ``history`` is given. Default: ``None``.
        shapes_seen: ``(start, size)`` pairs run before with this model, updated
          here; ``None`` where shapes cost nothing new (no first-use rule).
          Default: ``None``.
        history: ``(n, start, seconds)`` of an earlier prompt's last chunks
          (:attr:`history`). Default: none.
    """

    def __init__(
        self,
        cost: tuple[float, float] | None = None,
        shapes_seen: set[tuple[int, int]] | None = None,
        *,
        history: Sequence[tuple[int, int, float]] = (),
    ) -> None:
        self.cost: tuple[float, float] | None = (cost[0], cost[1]) if cost is not None else None
        self.per_context = 0.0  # seconds a token costs more per position of context before it
        self.shapes_seen = shapes_seen
        self._samples: list[tuple[int, int, float]] = list(history)[-FIT_WINDOW:]  # (n, start, seconds)
        self._last = 0
        self._grow_blind = False
        if self._samples:
            self._fit()

    @property
    def history(self) -> tuple[tuple[int, int, float], ...]:
        """The chunks the fit stands on, ``(n, start, seconds)``: what the next prompt starts from."""
        return tuple(self._samples)

    def predict(self, n: int, start: int) -> float | None:
        """Seconds the fitted cost gives a chunk of ``n`` tokens from ``start`` (``None`` before a fit)."""
        if self.cost is None:
            return None
        return _cost([*self.cost, self.per_context], n, start)

    def observe(self, n: int, seconds: float, *, start: int) -> None:
        """Record that the chunk of ``n`` tokens from ``start`` took ``seconds``."""
        self._last = n
        if self.shapes_seen is not None and (start, n) not in self.shapes_seen:
            self.shapes_seen.add((start, n))
            if self.cost is None or seconds > 2 * (self.cost[0] + n * self.cost[1]):
                self._grow_blind = True
                return
        self._grow_blind = False
        self._samples = (self._samples + [(n, start, seconds)])[-FIT_WINDOW:]
        if len(self._samples) >= 3 and self._off(*self._samples[-1]) == self._off(*self._samples[-2]) != 0:
            # The last two both far from the fit, the same way: the device changed (load came or went).
            # (One each way is a preemption and noise.)
            self._samples = self._samples[-2:]
        self._fit()

    def _off(self, n: int, start: int, seconds: float) -> int:
        """1 if the chunk took over :data:`SHIFT` x the fit, -1 if under 1 / :data:`SHIFT` of it, else 0."""
        predicted = self.predict(n, start)
        if predicted is None or predicted / SHIFT <= seconds <= predicted * SHIFT:
            return 0
        return 1 if seconds > predicted else -1

    def _fit(self) -> None:
        """Fit ``fixed + n * (per_token + per_context * position)`` to the recent chunks, by relative error.

        The fixed part is fitted only when the sizes differ enough to tell it
        from the per-token part (alike sizes: all per-token, the pessimistic
        reading for bigger chunks), the context part only when the positions
        do. A chunk far slower than the fit of the others (a preemption) is
        left out while the others agree.
        """
        samples = self._samples
        coef = self._fit_of(samples)
        for _ in range(len(samples) // 4):  # a quarter of the window may be preemptions
            if coef is None or len(samples) < 4:
                break
            ratios = [t / max(1e-12, _cost(coef, n, s)) for n, s, t in samples]
            worst = max(range(len(samples)), key=lambda i: ratios[i])
            if ratios[worst] <= SPIKE:
                break
            samples = samples[:worst] + samples[worst + 1 :]
            coef = self._fit_of(samples)
        if coef is None:
            n, _, seconds = self._samples[-1]
            coef = [0.0, seconds / n, 0.0]
        self.cost = (coef[0], coef[1])
        self.per_context = coef[2]

    @staticmethod
    def _fit_of(samples: list[tuple[int, int, float]]) -> list[float] | None:
        sizes = [n for n, _, _ in samples]
        middles = [s + n / 2 for n, s, _ in samples]
        allowed = [
            max(sizes) >= 1.5 * min(sizes),
            True,
            len(samples) >= 3 and max(middles) - min(middles) >= 2 * KV_STEP,
        ]
        # Relative errors: each chunk weighted by its expected time. By its measured time first, then by
        # the first fit's prediction (a chunk measured fast would otherwise weigh most, and pull the fit low).
        scale = [t for _, _, t in samples]
        coef = None
        for _ in range(2):
            rows = [[1 / w, n / w, n * m / w] for w, n, m in zip(scale, sizes, middles)]
            coef = nonnegative_fit(rows, [t / w for w, (_, _, t) in zip(scale, samples)], allowed)
            if coef is None:
                return None
            scale = [max(1e-9, _cost(coef, n, s)) for n, s, _ in samples]
        return coef

    def next_chunk(self, target_s: float, done: int, remaining: int) -> int:
        """The next chunk size for a piece budget of ``target_s`` seconds."""
        if self._grow_blind:
            n = self._last * 4
        elif self.cost is None:
            n = FIRST_PREFILL_CHUNK
        else:
            fixed, per_token = self.cost
            if target_s <= fixed or self._tiny_and_over(target_s):
                # Not even one token fits (by the fit, or tiny chunks mostly ran over): every chunk
                # waits its fixed part anyway. Tokens that cost BALANCE x that part keep most of the
                # time for tokens, a piece about 2.5x the fixed part; reached by at most doubling the
                # largest chunk measured (the budget is lost already; the time is not).
                largest = max((x for x, _, _ in self._samples), default=max(self._last, FIRST_PREFILL_CHUNK))
                n = _tokens_within(BALANCE * fixed, per_token, self.per_context, done) or 2 * largest
                n = max(FIRST_PREFILL_CHUNK, min(n, 2 * largest))
            else:
                n = _tokens_within(target_s - fixed, per_token, self.per_context, done) or MAX_PREFILL_CHUNK
                if self._last:
                    # At most 4x growth a chunk: the cost model extrapolates.
                    n = min(n, self._last * 4)
                n = self._measured_bound(n, target_s)
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

    def _tiny_and_over(self, target_s: float) -> bool:
        """Whether the recent chunks are all tiny and still mostly over the target: shrinking cannot help.

        Chunks of alike sizes cannot tell a fixed cost from a per-token one,
        and the fit reads them all per-token (the pessimistic reading): under
        load a 1-token chunk over the target then kept every chunk at 1 token,
        each paying the whole fixed part. The way out is to grow.
        """
        recent = self._samples[-3:]
        return (
            len(recent) == 3
            and max(n for n, _, _ in recent) <= FIRST_PREFILL_CHUNK
            and statistics.median(t for _, _, t in recent) > target_s
        )

    def _measured_bound(self, n: int, target_s: float) -> int:
        """``n``, or less where it is beyond the largest recent chunk and that chunk's time per token forbids it.

        A line through small chunks is mostly their fixed cost: its slope says
        nothing about big ones, and a fresh process grew from such a line into
        a chunk many times its budget. Beyond the sizes measured, a token costs
        no less than it did in the largest recent chunk (an upper bound where
        the fixed part is >= 0), so growth stays within what was measured.
        """
        if not self._samples:
            return n
        ref_n = max(x for x, _, _ in self._samples)
        if n <= ref_n:
            return n
        # The median over the larger chunks: one measured fast by chance does not open the way.
        per_token = statistics.median(t / x for x, _, t in self._samples if x >= ref_n / 2)
        return max(int(ref_n), min(n, int(target_s / per_token)))

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


def padded_to_seen(n: int, done: int, remaining: int, shapes_seen: set[tuple[int, int]] | None) -> int:
    """``n``, or more where ``n`` is a prompt's rest and a chunk at most twice as long from ``done`` ran before.

    A prompt's last chunk is as long as what is left of it, a length no
    earlier prompt may have had: on devices that build kernels per shape its
    attention graph was built inside its piece (the first 8k prompt to join
    a batch on an H200: 112 ms in one group of layers, budget 0.01). Fed up
    to the end of an aligned chunk already built (padded; the cache is cut
    back after it, see :func:`~.prefill.prefill`) it costs at most twice its
    tokens and builds nothing.
    """
    if shapes_seen is None or n < remaining:
        return n
    size = 1 << max(0, (n - 1).bit_length())  # the smallest power of two >= n
    while size <= MAX_PREFILL_CHUNK:
        padded = (done // size + 1) * size - done
        if padded > 2 * n:
            break
        if padded >= n and (done, padded) in shapes_seen:
            return padded
        size *= 2
    return n


def _cost(coef: list[float], n: int, start: int) -> float:
    """Seconds ``[fixed, per_token, per_context]`` give a chunk of ``n`` tokens from ``start``."""
    return coef[0] + n * (coef[1] + coef[2] * (start + n / 2))


def _tokens_within(seconds: float, per_token: float, per_context: float, start: int) -> int:
    """Tokens from ``start`` whose own cost (fixed part aside) fits ``seconds``; 0 when a token costs nothing."""
    a, b = per_context / 2, per_token + per_context * start
    if a <= 0:
        return int(seconds / b) if b > 0 else 0
    return int((-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a))


def _aligned(size: int, done: int, remaining: int) -> int:
    """The chunk from ``done`` that ends on the next multiple of ``size`` (or the prompt's end)."""
    return min((done // size + 1) * size - done, remaining)
