"""KV caches of past generations, kept to start new ones from a shared prompt prefix.

Iterating on the last line of a long prompt prefills the whole document again
on every run. A finished (or stopped) generation leaves its cache here, keyed
by the tokens it holds; a new prompt on the same model starts from the
longest cached prefix and prefills only the rest.

An entry is never changed once stored: a hit gets a trimmed *view* (new
``KVCache`` objects over slices of the stored arrays; an entry may hold
positions past its tokens, e.g. a step built ahead, which no view reaches).
MLX arrays are values, so the new generation's writes replace its own slices
and never reach the entry. Entries are evicted least recently used first to stay under
``limit_bytes``; an entry whose tokens are a prefix of a newer entry's is
dropped when that one is stored (the newer one serves both).

The first write to a view copies it (``KVCache`` grows its buffer by
concatenation): for an 8k-token prompt of an 8B model that is ~1.2 GB in one
piece, inside the first prefill chunk or decode step. :func:`restore` makes
that copy in budget-sized pieces of layers, with a checkpoint between them,
into buffers with room for the rest of the prompt and the first tokens.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..control import Pace
from . import kv_capacity
from .batch_cache import Cache, length
from .chunks import with_room
from .kv_settings import KVSettings

PLAIN = KVSettings()

GB = 1e9
# Default bound of each model's prompt cache. A 4k-token prompt of an 8B
# model (8 KV heads x 128 dims x 32 layers, bf16) is ~0.5 GB; SmolLM2's is 80 MB.
DEFAULT_PROMPT_CACHE_GB = 2.0


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: Cache
    nbytes: int
    kv: tuple[Any, ...]

    @property
    def key(self) -> tuple[tuple[Any, ...], tuple[int, ...]]:
        return (self.kv, self.tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """A byte-bounded LRU of one model's KV caches, keyed by their tokens.

    Args:
        limit_bytes: The most bytes of cache kept; 0 keeps nothing.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        # Keyed by (KV settings, tokens).
        self._entries: OrderedDict[tuple[tuple[Any, ...], tuple[int, ...]], _Entry] = OrderedDict()
        # Stored since the last prune(), and entries they replaced (freed there).
        self._fresh: list[tuple[tuple[Any, ...], tuple[int, ...]]] = []
        self._dropped: list[_Entry] = []
        # The worker stores and fetches; %mlxgen_models reads the size from the kernel thread.
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def arrays(self) -> list[mx.array]:
        """The arrays the entries hold (a quantized layer's triples flattened): what memory accounting reads."""
        with self._lock:
            caches = [e.cache for e in self._entries.values()]
        return [a for cache in caches for a in _arrays(cache)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def fetch(self, prompt: list[int], kv: KVSettings = PLAIN) -> tuple[Cache | None, int]:
        """A cache holding the longest cached prefix of ``prompt`` (at most all but its last token).

        Only entries made with the same KV settings (``kv``) serve it; a
        quantized entry serves only prefixes at least ``quantized_kv_start``
        long (a shorter one was not quantized yet in the run that made it).

        Returns:
            ``(cache, n)``: a fresh cache with the first ``n`` tokens of
            ``prompt`` in it, or ``(None, 0)`` on a miss.
        """
        usable_max = len(prompt) - 1
        with self._lock:
            best: _Entry | None = None
            best_n = 0
            for entry in self._entries.values():
                if entry.kv != kv.key():
                    continue
                n = min(common_prefix(entry.tokens, prompt), usable_max)
                if _quantized(entry.cache) and n < kv.quantized_start:
                    continue
                if n > best_n:
                    best, best_n = entry, n
            if best is None:
                return None, 0
            self._entries.move_to_end(best.key)
        return _view(best.cache, best_n), best_n

    def store(self, tokens: list[int], cache: Cache, kv: KVSettings = PLAIN, *, prune: bool = True) -> None:
        """Keep ``cache`` (no longer written by anyone), whose first positions hold ``tokens``, made with ``kv``.

        ``prune=False`` leaves dropping the entries it makes redundant, and
        those over the bound, to :meth:`prune`: freeing a 32k-token cache's
        arrays holds the GIL for milliseconds, so the worker stores before it
        reports a generation ended (whoever reads the cache next finds it) and
        prunes after.
        """
        if self.limit_bytes <= 0 or not tokens or not storable(cache) or length(cache) < len(tokens):
            return
        key = (kv.key(), tuple(tokens))
        nbytes = _held_bytes(cache)
        if nbytes > self.limit_bytes:
            return
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self._dropped.append(replaced)  # freed by prune(), like the entries this one serves
            # The whole cache, not a view cut to ``tokens``: fetch() cuts (views of 36 layers' quantized
            # triples took 1.3 ms on an H200), and the arrays a view refers to stay in memory anyway.
            self._entries[key] = _Entry(key[1], cache, nbytes, key[0])
            self._fresh.append(key)
        if prune:
            self.prune()

    def prune(self) -> None:
        """Drop the entries that newer ones serve (a stored prefix of their tokens), then the oldest over the bound."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
            dropped, self._dropped = self._dropped, []
            for new_kv, new in fresh:
                if (new_kv, new) not in self._entries:
                    continue
                for old_kv, old in list(self._entries):
                    served = len(old) < len(new) and new[len(old) - 1] == old[-1] and new[: len(old)] == old
                    if old_kv == new_kv and served:
                        dropped.append(self._entries.pop((old_kv, old)))
            dropped.extend(self._evict())
        dropped.clear()  # the arrays are freed here, outside the lock

    def set_limit(self, limit_bytes: int) -> None:
        """Change the bound, evicting at once."""
        with self._lock:
            self.limit_bytes = limit_bytes
            evicted = self._evict()
        evicted.clear()

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._fresh, self._dropped = [], []

    def _evict(self) -> list[_Entry]:
        """Drop the least recently used entries over the bound; return them (freed outside the lock)."""
        total = sum(e.nbytes for e in self._entries.values())
        evicted = []
        while self._entries and total > self.limit_bytes:
            _, entry = self._entries.popitem(last=False)
            total -= entry.nbytes
            evicted.append(entry)
        return evicted


def storable(cache: Cache) -> bool:
    """Whether ``cache`` can be kept and served as a prefix: plain or quantized ``KVCache`` layers.

    A rotating cache cannot: once it wraps, the positions it dropped are gone.
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache  # imported late: see batch_cache

    return bool(cache) and all(type(layer) in (KVCache, QuantizedKVCache) for layer in cache)


def _quantized(cache: Cache) -> bool:
    from mlx_lm.models.cache import QuantizedKVCache

    return any(type(layer) is QuantizedKVCache for layer in cache)


def _view(cache: Cache, n: int) -> Cache:
    """New single-sequence caches over the first ``n`` positions of ``cache``."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out = []
    for layer in cache:
        view: Any
        if type(layer) is QuantizedKVCache:
            view = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
        else:
            view = KVCache()
        if n and layer.keys is not None:
            view.keys, view.values = (_positions(a, 0, n) for a in (layer.keys, layer.values))
            view.offset = n
        out.append(view)
    return out


def _positions(a: Any, start: int, stop: int) -> Any:
    """Positions ``start:stop`` (axis 2) of keys or values: an array, or a quantized triple of them."""
    if isinstance(a, (tuple, list)):
        return tuple(x[..., start:stop, :] for x in a)
    return a[..., start:stop, :]


def restore(view: Cache, room: int, pace: Pace, *, piece_s: float) -> None:
    """Copy a hit's view (:meth:`PromptCache.fetch`) into buffers of its own, in place, piece by piece.

    Each layer's keys and values become a new buffer holding the cached
    positions and room for ``room`` more tokens (rounded up to ``KV_STEP``),
    so the prefill and the first steps write into it without copying it
    again. Layers are copied in groups, from one layer up: a group that took
    under half of ``piece_s`` doubles, one over ``piece_s`` halves (each
    group ends in an evaluation, whose fixed cost would inflate a time per
    layer; doubling keeps the groups few where a copy is cheap, ~5 for 32
    layers). ``pace.checkpoint()`` runs between groups.

    Raises:
        Cancelled: A stop was requested at a checkpoint (the layers copied so
          far hold the same tokens as the others: the cache stays usable).
    """
    # A layer read from a file with room already (kv_file.load's ``room``) is not copied again.
    layers = [layer for layer in view if layer.keys is not None and capacity(layer) < int(layer.offset) + room]
    if not layers:
        return
    n = int(layers[0].offset)
    size = with_room(n, room)
    group = 1
    i = 0
    while i < len(layers):
        t0 = time.perf_counter()
        chunk = layers[i : i + group]
        for layer in chunk:
            layer.keys, layer.values = (kv_capacity.grown(a, n, size) for a in (layer.keys, layer.values))
        mx.eval([layer.state for layer in chunk])
        took = time.perf_counter() - t0
        i += len(chunk)
        if took < piece_s / 2:
            group = 2 * len(chunk)
        elif took > piece_s:
            group = max(1, len(chunk) // 2)
        if i < len(layers):
            pace.checkpoint()


def capacity(layer: Any) -> int:
    """Positions ``layer``'s buffers hold (axis 2), written or not."""
    keys = layer.keys[0] if isinstance(layer.keys, (tuple, list)) else layer.keys
    return int(keys.shape[2])


def _held_bytes(cache: Cache) -> int:
    """Bytes of the arrays ``cache``'s layers hold (mlx-lm's ``nbytes`` of a quantized layer walks a tree: ~20 us)."""
    return sum(a.nbytes for a in _arrays(cache))


def _arrays(cache: Cache) -> list[mx.array]:
    """The keys and values ``cache``'s layers hold, a quantized layer's triples flattened."""
    out: list[mx.array] = []
    for layer in cache:
        for part in (layer.keys, layer.values):
            if part is not None:
                out.extend(part if isinstance(part, (tuple, list)) else (part,))
    return out


def trimmed(cache: Cache, n: int) -> Cache:
    """``cache`` cut to its first ``n`` tokens without copying (for storing)."""
    if length(cache) == n:
        return cache
    return _view(cache, n)


__all__ = ["DEFAULT_PROMPT_CACHE_GB", "PromptCache", "capacity", "restore", "storable", "trimmed"]
