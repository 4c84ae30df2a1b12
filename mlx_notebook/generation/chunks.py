"""Prefill chunk sizes: as large as fits the stop budget, in shapes the device has seen.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import mlx.core as mx

from .fit import linear_fit

MAX_PREFILL_CHUNK = 2048  # a power of two (see ChunkPlanner)
FIRST_PREFILL_CHUNK = 8
KV_STEP = 256  # mlx-lm's KVCache.step


def with_room(n: int, room: int) -> int:
    """Positions of a cache buffer that holds ``n`` and has room for ``room`` more, in whole ``KV_STEP``s."""
    return (n + room + KV_STEP - 1) // KV_STEP * KV_STEP


def builds_kernels_per_shape() -> bool:
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

    def __init__(
        self, cost: tuple[float, float] | None = None, shapes_seen: set[tuple[int, int]] | None = None
    ) -> None:
        self.cost: tuple[float, float] | None = (cost[0], cost[1]) if cost is not None else None
        self.shapes_seen = shapes_seen
        self._samples: list[tuple[float, float]] = []
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
        sizes = [x for x, _ in self._samples]
        if line is None or max(sizes) < 1.5 * min(sizes):
            # Sizes too alike to tell how the time splits (context growth
            # alone tilts the line): all per-token is the pessimistic reading
            # for bigger chunks.
            self.cost = (0.0, seconds / n)
            return
        if line[1] <= 0:
            # Bigger chunks were no slower: the time is fixed cost (or noise
            # over it). Reading it as per-token cost instead shrank the chunks
            # toward one token under CPU load, each paying the fixed cost again.
            # The fastest recent chunk bounds the fixed part: only when even it
            # missed the target do chunks grow past what was measured.
            self.cost = (min(t for _, t in self._samples), 0.0)
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
            if target_s <= fixed:
                n = 1
            else:
                n = int((target_s - fixed) / per_token) if per_token > 0 else MAX_PREFILL_CHUNK
            if self._last:
                # At most 4x growth a chunk: the cost model extrapolates.
                n = min(n, self._last * 4)
            n = self._measured_bound(n, target_s)
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
        ref_n, ref_s = max(reversed(self._samples), key=lambda s: s[0])
        if n <= ref_n:
            return n
        return max(int(ref_n), min(n, int(target_s * ref_n / ref_s)))

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
