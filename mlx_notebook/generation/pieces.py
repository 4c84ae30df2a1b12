"""Pieces of prefill work: a whole chunk, or a group of layers of a chunk.

Shrinking prompt chunks bounds the stop latency but costs matmul efficiency.
Every mlx-lm model of the common layout (embedding, a ``layers`` list, final
norm, head) calls its layers one after the other, so instead of rewriting
each architecture's forward pass we swap that list, for the duration of one
chunk and for the calling thread only (:class:`_ThreadLayers`), for thin
wrappers that evaluate the hidden state every ``group`` layers and call the
cancel checkpoint there. On a GPU one group stays in flight while
the next is queued, so the device never idles between pieces; on the CPU
none does (:func:`queued_groups`).

A pause blocks inside the forward pass (the KV cache stays consistent and
resume simply continues); a stop raises out of it, and that generation's
cache is discarded by the caller (the model itself is untouched).

Models whose forward pass does not go through such a list fall back to
whole-chunk pieces; ``runner.pieces`` says which one is in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..control import Pace
from ..loading.store import LoadedModel
from .fit import linear_fit
from .stats import PrefillPieces


class ChunkRunner:
    """One piece per chunk: run the model on it and evaluate the cache."""

    pieces = PrefillPieces.CHUNKS
    chunk_budget_factor = 1.0
    # Seconds of the last run spent outside it (in checkpoints): none here.
    outside_s = 0.0

    def __init__(self, model: nn.Module, cache: list[Any]) -> None:
        self.model = model
        self.cache = cache

    def run(self, inputs: mx.array) -> None:
        """Run the model on one chunk and evaluate the cache."""
        self.model(inputs, cache=self.cache)
        mx.eval([c.state for c in self.cache])


class _ThreadLayers(list):
    """A model's ``layers`` list that each thread may see replaced by its own list (wrappers) for a while.

    The worker thread decodes (a step may be built in marked pieces) while a
    prefill thread feeds a joining prompt in groups of layers (see
    :mod:`.prefill_thread`): replacing the model's list itself would send one
    thread's forward pass through the other's hooks. The list holds the real
    layers; a thread's replacement is what that thread iterates, indexes and
    counts.
    """

    def __init__(self, layers: list[Any]) -> None:
        super().__init__(layers)
        self._local = threading.local()

    def swapped(self) -> list[Any] | None:
        return getattr(self._local, "layers", None)

    def swap(self, layers: list[Any] | None) -> list[Any] | None:
        """Make ``layers`` (``None``: the real ones) what this thread sees; return what it saw before."""
        before = self.swapped()
        self._local.layers = layers
        return before

    def __iter__(self) -> Iterator[Any]:
        swapped = self.swapped()
        return iter(swapped) if swapped is not None else super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        swapped = self.swapped()
        return swapped[index] if swapped is not None else super().__getitem__(index)

    def __len__(self) -> int:
        swapped = self.swapped()
        return len(swapped) if swapped is not None else super().__len__()


def _thread_layers(owner: nn.Module) -> _ThreadLayers:
    """``owner``'s layers list, made a :class:`_ThreadLayers` on first use.

    Made one, it is a new list holding the same layers: a reference to the
    old list taken before no longer reaches the forward pass. Models handed
    out (:meth:`.worker.Worker.load_model`) get theirs first (:func:`share_layers`).
    """
    layers = owner.layers
    if not isinstance(layers, _ThreadLayers):
        layers = _ThreadLayers(layers)
        owner.layers = layers
    return layers


_OWNER_PATHS = ("model", "language_model.model", "backbone", "transformer")


def _owners(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of ``model`` at the usual paths whose ``layers`` is a non-empty list of modules."""
    for path in _OWNER_PATHS:
        owner: Any = model
        for part in path.split("."):
            owner = getattr(owner, part, None) if owner is not None else None
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, list) and layers and all(isinstance(layer, nn.Module) for layer in layers):
            yield owner


def share_layers(model: nn.Module) -> None:
    """Give ``model``'s layers list its final form now, before anyone holds a reference to it.

    The engine makes it a :class:`_ThreadLayers` at its first piece of work;
    a caller who took ``model.model.layers`` before that and edits it (a
    layer swapped for a test's fault, or back) would edit a list the forward
    pass no longer reads (session 37's fault campaign: a layer broken before
    a model's first prefill stayed broken after it was put back).
    """
    for owner in _owners(model):
        _thread_layers(owner)


class _CheckpointedLayer:
    """Calls the real layer, then the runner's hook with the layer's output."""

    def __init__(self, layer: nn.Module, index: int, hook: Callable[[int, mx.array], None]) -> None:
        self._layer = layer
        self._index = index
        self._hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._layer(*args, **kwargs)
        self._hook(self._index, out)
        return out

    def __getattr__(self, name: str) -> Any:
        # Forward attributes models read off their layers (use_sliding, ...).
        return getattr(self._layer, name)


def queued_groups() -> int:
    """Layer groups a prefill keeps queued beyond the one it waits on: one on a GPU, none on the CPU.

    On a GPU a queued group keeps the device busy while the host builds the
    next. On the CPU the host's build and the compute share the cores, so a
    queued group overlaps little, and it halves what each group, and so each
    chunk, may take: chunks of ~30 tokens where ~70 fit, each paying a small
    matmul's lower efficiency. A 3,000-token prefill of the default model on 2
    cores beside two busy loops: 55.7-56.6 s with none queued against
    61.2-64.1 s with one (quiet 31.5-32.0 against 30.2-31.7; stops under that
    load p95 78-86 ms against 77; session 60).
    """
    return 0 if mx.default_device().type == mx.cpu else 1


class LayerRunner:
    """Pieces of ``group`` layers of one chunk, with a checkpoint between groups.

    Args:
        owner: The module whose ``layers`` list the forward pass iterates.
        model: The full model.
        cache: The KV cache (one entry per layer).
        pace: Checkpoint between groups, and the budget a group is sized to.
    """

    pieces = PrefillPieces.LAYERS
    # Groups queued on the device beyond the one being waited on. More keeps
    # the device busier; each one adds a group to the worst stop latency.
    # None: by device (queued_groups); benchmarks set a number to compare.
    max_in_flight: int | None = None

    def __init__(self, owner: nn.Module, model: nn.Module, cache: list[Any], pace: Pace) -> None:
        self.owner = owner
        self.model = model
        self.cache = cache
        self.pace = pace
        self.n_layers = len(owner.layers)
        self.queued = self.groups_queued()
        # Chunks may be as long as the groups a stop can wait for (the one
        # being waited on plus those queued), one layer each, fit the budget.
        self.chunk_budget_factor = max(1.0, self.n_layers / (self.queued + 1))
        self.group = 1
        # (mean context position, seconds per layer per token) of recent chunks.
        self._samples: list[tuple[float, float]] = []
        self._in_flight: list[mx.array] = []
        self._calls = 0
        self._wrapped: list[Any] = []
        self._outer: list[Any] | None = None  # what this thread saw before the swap
        self.outside_s = 0.0

    @classmethod
    def groups_queued(cls) -> int:
        """Groups kept queued behind the one waited on: :attr:`max_in_flight` where set, else :func:`queued_groups`."""
        return queued_groups() if cls.max_in_flight is None else cls.max_in_flight

    def _context(self) -> int:
        return int(getattr(self.cache[0], "offset", 0) or 0)

    def _per_layer_token(self, position: float) -> float | None:
        """Predicted seconds per layer per token at mean context ``position``.

        Attention makes a token's cost grow with the context before it (at 8k
        tokens it is most of a small model's cost), so the last chunk's rate
        underestimates the next: fit ``a + b * position`` over recent chunks.
        """
        if not self._samples:
            return None
        last = self._samples[-1][1]
        line = linear_fit(self._samples)
        if line is None or line[1] <= 0:
            return last
        intercept, slope = line
        # Never below the last measured rate: the context only grows.
        return max(last, intercept + slope * position)

    def _plan(self, n_tokens: int) -> None:
        per = self._per_layer_token(self._context() + n_tokens / 2)
        if per is None:
            self.group = max(1, self.pace.choose(1))
            return
        # The group being waited on and those queued behind it all stand
        # between a stop and the parked worker: they share the budget.
        fit = int(self.pace.budget_s / (self.queued + 1) / max(per * n_tokens, 1e-9))
        # Ranks of a cluster must cut the same groups (their forward passes meet in collectives).
        self.group = max(1, self.pace.choose(min(fit, self.n_layers)))

    def _hook(self, index: int, hidden: mx.array) -> None:
        self._calls += 1
        if (index + 1) % self.group != 0 or index + 1 == self.n_layers:
            return
        mx.async_eval(hidden)
        self._in_flight.append(hidden)
        # Others' decode step may run in the checkpoint: it would wait for
        # every group queued before it, so then none stays queued, or (the
        # pace's gate) they stay queued and the step is queued behind them on
        # the device. Asked again after each wait: the others' turn may come
        # while a group finishes.
        shared, gate = self.pace.shared, self.pace.gate
        while self._in_flight and (len(self._in_flight) > self.queued or (shared is not None and shared())):
            if gate is not None and len(self._in_flight) <= self.queued:
                # Their step goes on the device behind these groups, not behind this thread's wait for them.
                gate(self._in_flight[-1])
                break
            mx.eval(self._in_flight.pop(0))
        # The checkpoint may run other generations' decode steps (and a pause
        # blocks in it): they see the real layers, and their time and the
        # pause are not this chunk's cost.
        t0 = time.perf_counter()
        layers = _thread_layers(self.owner)
        layers.swap(self._outer)
        try:
            self.pace.checkpoint()
        finally:
            layers.swap(self._wrapped)
            self.outside_s += time.perf_counter() - t0

    def seed(self, per_layer_token_s: float) -> None:
        """Size the first groups from a cost measured elsewhere (a decode step's), not from one layer."""
        self._samples = [(float(self._context()), per_layer_token_s)]

    def run(self, inputs: mx.array) -> None:
        """Run the model on one chunk in groups of layers and evaluate the cache."""
        self._forward(inputs)

    def logits(self, inputs: mx.array) -> mx.array:
        """Like :meth:`run`, and the logits of the chunk's last token (evaluated)."""
        out = self._forward(inputs)[:, -1, :]
        mx.eval(out)
        return out

    def _forward(self, inputs: mx.array) -> mx.array:
        n_tokens = inputs.shape[-1]
        position = self._context() + n_tokens / 2
        self._plan(n_tokens)
        layers = _thread_layers(self.owner)
        wrapped = [_CheckpointedLayer(layer, i, self._hook) for i, layer in enumerate(layers)]
        self._calls = 0
        self._in_flight = []
        self._wrapped, self.outside_s = wrapped, 0.0
        t0 = time.perf_counter()
        self._outer = layers.swap(wrapped)
        try:
            out: mx.array = self.model(inputs, cache=self.cache)
        finally:
            # Restore even when a stop raises out of the forward pass, and
            # drop the wrappers: they refer back to this runner (its hook),
            # which holds the KV cache; a cycle would keep the cache until
            # the garbage collector runs.
            layers.swap(self._outer)
            self._in_flight = []
            self._wrapped, self._outer = [], None
        mx.eval([c.state for c in self.cache])
        elapsed = time.perf_counter() - t0 - self.outside_s
        if self._calls == 0:
            # The forward pass did not iterate the list: nothing to cut.
            self.pieces = PrefillPieces.CHUNKS
            self.chunk_budget_factor = 1.0
        self._samples = (self._samples + [(position, elapsed / (n_tokens * self.n_layers))])[-6:]
        return out


class BuildStopped(Exception):
    """A step's graph was left half built: every generation in it was stopped (``args[0]``: layers built)."""


class MarkedLayers:
    """While inside, ``owner``'s forward pass records its hidden state after every ``per`` layers (lazy).

    A decode step longer than a stop may wait is evaluated in these pieces
    (:class:`.decode_batch.DecodeBatch`): nothing is evaluated here, the
    marks are only the graph's intermediate arrays to evaluate in turn.
    """

    def __init__(
        self,
        owner: nn.Module,
        per: int,
        stopped: Callable[[], bool] | None = None,
        at_mark: Callable[[], None] | None = None,
    ) -> None:
        self.owner = owner
        self.per = per
        # Asked after each layer is built: True ends the build (BuildStopped), the layers left unbuilt.
        self.stopped = stopped
        # Called at each mark, while the build waits: the caller moves other work along (the step in flight).
        self.at_mark = at_mark
        self.marks: list[mx.array] = []
        self.built = 0  # layers whose part of the graph was built
        self._n = 0
        self._outer: list[Any] | None = None

    def _hook(self, index: int, hidden: Any) -> None:
        self.built = index + 1
        if (index + 1) % self.per == 0 and index + 1 < self._n and isinstance(hidden, mx.array):
            self.marks.append(hidden)
            if self.at_mark is not None:
                self.at_mark()
        if self.stopped is not None and index + 1 < self._n and self.stopped():
            raise BuildStopped(self.built)

    def __enter__(self) -> MarkedLayers:
        layers = _thread_layers(self.owner)
        self._n = len(layers)
        self._outer = layers.swap([_CheckpointedLayer(layer, i, self._hook) for i, layer in enumerate(layers)])
        return self

    def __exit__(self, *exc: object) -> None:
        # The wrappers refer back to this object: restore (and drop them) even when the forward raises.
        _thread_layers(self.owner).swap(self._outer)
        self._outer = None


def layer_owner(model: nn.Module, n_cache: int) -> nn.Module | None:
    """The module whose ``layers`` list ``model``'s forward pass iterates, one layer per cache entry."""
    for owner in _owners(model):
        if len(owner.layers) == n_cache:
            return owner
    return None


def prefill_runner(loaded: LoadedModel, cache: list[Any], pace: Pace) -> ChunkRunner | LayerRunner:
    """The best runner for this model: layer groups when the layout allows."""
    if loaded.layer_pieces:
        owner = layer_owner(loaded.model, len(cache))
        if owner is not None:
            return LayerRunner(owner, loaded.model, cache, pace)
    return ChunkRunner(loaded.model, cache)


__all__ = [
    "BuildStopped",
    "ChunkRunner",
    "LayerRunner",
    "MarkedLayers",
    "layer_owner",
    "prefill_runner",
    "share_layers",
]
