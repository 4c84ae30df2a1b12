"""One KV cache and its metadata in one file, written and read in budget-sized pieces.

The file is mlx-lm's prompt-cache format: a safetensors file laid out the way
``mlx_lm.models.cache.save_prompt_cache`` writes it (the tensors of
``tree_flatten([c.state for c in cache])``; in ``__metadata__`` the caller's
strings under ``0.<key>``, the cache class names under ``1.<i>`` and the list
of state entries that are scalars under ``2.<k>``), so ``load_prompt_cache``
reads these files and :func:`load` reads its.

A file is data, never code: the header is parsed here, in Python, and every
field is checked (sizes, dtypes, shapes, offsets, the scalar list, the class
names against a whitelist, each layer's state) before a byte of tensor data is
read or handed to MLX; a malformed safetensors header can crash MLX's own
parser (DESIGN.md: 5 of 60 mutated GGUF files did). Tensor bytes move between
the file and evaluated MLX arrays through the buffer protocol, in pieces sized
from the measured throughput so that one takes a share of ``pace.budget_s``,
with ``pace.checkpoint()`` between them; ``readinto``/``write`` on those pieces
release the GIL. A save goes to a temporary file in the same folder that
replaces ``path`` only once complete: a stopped or failed save leaves no
partial file and keeps the old one.

Example::

    n = save("gen.kvcache", cache, {"mlx_notebook": json.dumps(state)}, pace)
    meta = read_metadata("gen.kvcache")      # cheap: check the model first
    cache, meta = load("gen.kvcache", pace)

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import ctypes
import json
import math
import numbers
import os
import secrets
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from ..budget import SAVE_CLEANUP_SHARE, SAVE_PIECE_SHARE
from ..control import Pace
from ..errors import InvalidArgumentError
from .chunks import with_room

# The first piece, before any throughput is measured (~4 ms at 1 GB/s).
FIRST_PIECE = 4 << 20
MIN_PIECE = 256 << 10
MAX_PIECE = 1 << 30
# The safetensors format's own bound on the JSON header.
MAX_HEADER = 100 << 20

# The classes a file may name, and how their ``state`` flattens: the array
# entries (keys and values; "0", "1" alone when the layer is empty) and the
# integer scalars, in ``state`` order.
_ARRAYS_QUANTIZED = ("0.0", "0.1", "0.2", "1.0", "1.1", "1.2")
_CLASSES: dict[str, tuple[Any, tuple[str, ...], tuple[str, ...]]] = {
    "KVCache": (KVCache, ("0", "1"), ("2",)),
    "ConcatenateKVCache": (ConcatenateKVCache, ("0", "1"), ()),
    "QuantizedKVCache": (QuantizedKVCache, _ARRAYS_QUANTIZED, ("2", "3", "4")),
    "RotatingKVCache": (RotatingKVCache, ("0", "1"), ("2", "3", "4", "5")),
}
# safetensors dtype -> (bytes per element, MLX dtype, unsigned dtype of that size for the buffer protocol).
_DTYPES: dict[str, tuple[int, mx.Dtype, mx.Dtype]] = {
    "BOOL": (1, mx.bool_, mx.uint8),
    "U8": (1, mx.uint8, mx.uint8),
    "I8": (1, mx.int8, mx.uint8),
    "U16": (2, mx.uint16, mx.uint16),
    "I16": (2, mx.int16, mx.uint16),
    "F16": (2, mx.float16, mx.uint16),
    "BF16": (2, mx.bfloat16, mx.uint16),
    "U32": (4, mx.uint32, mx.uint32),
    "I32": (4, mx.int32, mx.uint32),
    "F32": (4, mx.float32, mx.uint32),
    "U64": (8, mx.uint64, mx.uint64),
    "I64": (8, mx.int64, mx.uint64),
    "F64": (8, mx.float64, mx.uint64),
    "C64": (8, mx.complex64, mx.uint64),
}
_NAMES = {mlx: name for name, (_, mlx, _) in _DTYPES.items()}
_FLOATS = {"F16", "BF16", "F32"}
_INTS = {"U8": "<B", "I8": "<b", "U16": "<H", "I16": "<h", "U32": "<I", "I32": "<i", "U64": "<Q", "I64": "<q"}
_QUANT_BITS = {2, 3, 4, 5, 6, 8}
_QUANT_GROUPS = {32, 64, 128}
_FIX = "save it again"


class KVFileError(InvalidArgumentError):
    """A KV cache file (or a cache given to :func:`save`) cannot be written or read as one."""


@dataclass(frozen=True)
class _Tensor:
    """One header entry: ``start``/``end`` are offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _Layer:
    """One checked layer: its class, its array entries (full names) and scalar values."""

    cls: Any
    arrays: tuple[str, ...]
    scalars: tuple[int, ...]
    empty: bool


@dataclass(frozen=True)
class _Plan:
    """A checked file: what :func:`load` reads."""

    tensors: dict[str, _Tensor]
    layers: list[_Layer]
    metadata: dict[str, str]


def _bad(path: object, what: str, fix: str = _FIX) -> KVFileError:
    return KVFileError(f"{path}: {what}; {fix}")


# -- sizing pieces -------------------------------------------------------------


class _Pieces:
    """Sizes pieces of bytes from the throughput measured so far; checkpoints between them."""

    def __init__(self, pace: Pace) -> None:
        self.pace = pace
        self.piece_s = max(pace.budget_s * SAVE_PIECE_SHARE, 1e-3)
        self.size = FIRST_PIECE
        self._last = time.perf_counter()

    def next(self, remaining: int) -> int:
        return min(remaining, self.size)

    def took(self, nbytes: int, seconds: float) -> None:
        """Resize after a piece of ``nbytes`` took ``seconds`` (growth at most 2x per piece)."""
        if nbytes < self.size // 2:
            return  # a tensor's short tail says little about the rate
        target = nbytes / max(seconds, 1e-6) * self.piece_s
        self.size = int(min(max(target, MIN_PIECE, self.size / 4), 2 * self.size, MAX_PIECE))

    def checkpoint(self) -> None:
        """``pace.checkpoint()``, at most every half piece (many tiny tensors need not each be one)."""
        now = time.perf_counter()
        if now - self._last >= self.piece_s / 2 or self.pace.requested:
            self.pace.checkpoint()
            self._last = time.perf_counter()


# -- the header ------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _index(s: str) -> int | None:
    """``s`` as a list index written the way ``tree_flatten`` writes one, else ``None``."""
    if s.isascii() and s.isdigit() and str(int(s)) == s:
        return int(s)
    return None


def _read_header(f: BinaryIO, size: int, path: object) -> tuple[dict[str, Any], int]:
    """The JSON header and where the data starts, checked for size and syntax."""
    if size < 8:
        raise _bad(path, f"it has {size} bytes, too few for a safetensors file")
    n = struct.unpack("<Q", _read_exactly(f, 0, 8, path))[0]
    if n < 2 or n > MAX_HEADER or n > size - 8:
        raise _bad(
            path,
            f"its header length {n:,} does not fit a {size:,}-byte file (the file is truncated or not a safetensors file)",
        )
    raw = _read_exactly(f, 8, n, path)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise _bad(path, f"its header is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    return header, 8 + n


def _tensors(header: dict[str, Any], data_start: int, size: int, path: object) -> dict[str, _Tensor]:
    """Every tensor entry, checked: dtype, shape, byte range (in the file, matching, no overlap, no gap)."""
    data_len = size - data_start
    tensors: dict[str, _Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} is not a dtype/shape/data_offsets entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise _bad(path, f"tensor {name!r} has unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(d) and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name!r} has shape {str(shape)[:40]}, not a list of at most 8 sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise _bad(path, f"tensor {name!r} has data_offsets {str(offsets)[:40]}, not two integers")
        begin, end = offsets
        expected = math.prod(shape) * _DTYPES[dtype][0]
        if not 0 <= begin <= end or end - begin != expected:
            raise _bad(
                path, f"tensor {name!r} spans bytes [{begin}, {end}) but its {dtype} {tuple(shape)} needs {expected:,}"
            )
        if end > data_len:
            missing = end - max(begin, data_len)
            raise _bad(path, f"it is truncated: {missing:,} of {end - begin:,} bytes of tensor {name!r} are missing")
        tensors[name] = _Tensor(name, dtype, tuple(shape), data_start + begin, data_start + end)
    covered = data_start
    for t in sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.start):
        if t.start < covered:
            raise _bad(path, f"tensor {t.name!r} overlaps the tensor before it")
        if t.start > covered:
            raise _bad(path, f"{t.start - covered:,} bytes before tensor {t.name!r} belong to no tensor")
        covered = t.end
    if covered != size:
        raise _bad(path, f"its last {size - covered:,} bytes belong to no tensor")
    return tensors


def _metadata(header: dict[str, Any], path: object) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """The caller's metadata, the class names and the scalar entries ({tensor name: kind}) from ``__metadata__``."""
    raw = header.get("__metadata__", {})
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise _bad(path, "its __metadata__ is not an object of strings")
    user: dict[str, str] = {}
    classes: dict[int, str] = {}
    pairs: dict[int, dict[int, str]] = {}
    sentinel = False
    for key, value in raw.items():
        head, _, rest = key.partition(".")
        parts = rest.split(".")
        if head == "0" and rest:
            user[rest] = value
        elif head == "1" and len(parts) == 1 and _index(rest) is not None:
            classes[int(rest)] = value
        elif head == "2" and rest == "0" and value == "":
            sentinel = True
        elif head == "2" and len(parts) == 2 and _index(parts[0]) not in (None, 0) and parts[1] in ("0", "1"):
            pairs.setdefault(int(parts[0]), {})[int(parts[1])] = value
        else:
            raise _bad(path, f"its metadata has an entry {key[:40]!r} that a prompt cache does not have")
    if sorted(classes) != list(range(len(classes))):
        raise _bad(path, "its cache class list (metadata 1.*) has gaps")
    if not sentinel or sorted(pairs) != list(range(1, len(pairs) + 1)) or any(len(p) != 2 for p in pairs.values()):
        raise _bad(path, "its scalar list (metadata 2.*) is malformed")
    scalars: dict[str, str] = {}
    for pair in pairs.values():
        name, kind = pair[0], pair[1]
        if name in scalars:
            raise _bad(path, f"its scalar list names tensor {name[:40]!r} twice")
        scalars[name] = kind
    return user, [classes[i] for i in range(len(classes))], scalars


def _check_layers(
    classes: list[str],
    tensors: dict[str, _Tensor],
    scalars: dict[str, str],
    value_of: Callable[[_Tensor], int],
    path: object,
) -> list[_Layer]:
    """Every layer's state checked against its class; ``value_of`` reads an integer scalar."""
    for name, kind in scalars.items():
        t = tensors.get(name)
        if t is None:
            raise _bad(path, f"its scalar list names tensor {name[:40]!r}, which is not in the file")
        if kind == "scalar" and (t.shape != () or t.dtype not in _INTS):
            raise _bad(path, f"scalar {name!r} is a {t.dtype} {t.shape}, not an integer")
        if kind == "none" and t.nbytes:
            raise _bad(path, f"tensor {name!r} stands for None but holds {t.nbytes:,} bytes")
        if kind not in ("scalar", "none"):
            raise _bad(path, f"scalar {name!r} is of kind {kind[:20]!r}, which no KV cache state has")
    layers: list[_Layer] = []
    seen: set[str] = set()
    for i, cls_name in enumerate(classes):
        if cls_name not in _CLASSES:
            known = ", ".join(_CLASSES)
            raise _bad(
                path, f"layer {i} is a {cls_name[:40]!r}, not a known KV cache ({known})", "save a cache of these kinds"
            )
        cls, array_fields, scalar_fields = _CLASSES[cls_name]
        empty = scalars.get(f"{i}.0") == "none"
        if empty and cls is ConcatenateKVCache:
            raise _bad(path, f"layer {i} is an empty ConcatenateKVCache, which mlx-lm cannot rebuild")
        arrays = tuple(f"{i}.{k}" for k in (("0", "1") if empty else array_fields))
        names = arrays + tuple(f"{i}.{k}" for k in scalar_fields)
        for name in names:
            kind = scalars.get(name, "array")
            want = "none" if empty and name in arrays else "scalar" if name not in arrays else "array"
            if name not in tensors or kind != want:
                raise _bad(path, f"layer {i} ({cls_name}) lacks its {want} {name!r}")
        seen.update(names)
        values = tuple(value_of(tensors[f"{i}.{k}"]) for k in scalar_fields)
        _check_state(i, cls_name, [tensors[a] for a in arrays], values, empty, path)
        layers.append(_Layer(cls, arrays, values, empty))
    extra = sorted(set(tensors) - seen)
    if extra:
        raise _bad(path, f"tensor {extra[0][:40]!r} belongs to no layer of the cache")
    return layers


def _check_state(
    i: int, cls_name: str, arrays: list[_Tensor], values: tuple[int, ...], empty: bool, path: object
) -> None:
    """One layer's arrays and scalars agree with each other the way mlx-lm's cache needs."""

    def fail(what: str) -> KVFileError:
        return _bad(path, f"layer {i} ({cls_name}) {what}")

    if cls_name == "QuantizedKVCache" and (values[2] not in _QUANT_BITS or values[1] not in _QUANT_GROUPS):
        raise fail(f"has {values[2]} bits in groups of {values[1]}, which MLX does not quantize")
    seq = 0
    if not empty:
        if any(len(t.shape) != 4 for t in arrays):
            raise fail("has keys or values that are not 4-D")
        if len({t.shape[:3] for t in arrays}) != 1:
            raise fail("has keys and values of different batch, heads or length")
        seq = arrays[0].shape[2]
        if cls_name == "QuantizedKVCache":
            group_size, bits = values[1], values[2]
            for w, scales, biases in (arrays[:3], arrays[3:]):
                if w.dtype != "U32" or scales.dtype not in _FLOATS or biases.dtype != scales.dtype:
                    raise fail("has quantized arrays of the wrong dtypes")
                if scales.shape != biases.shape or w.shape[3] * 32 != scales.shape[3] * group_size * bits:
                    raise fail("has packed values and scales that disagree on the head size")
        elif any(t.dtype not in _FLOATS for t in arrays):
            raise fail(f"has keys or values of dtype {arrays[0].dtype}/{arrays[1].dtype}, not a float")
    if cls_name == "RotatingKVCache":
        offset, keep, max_size, idx = values
        if offset < 0 or max_size < 1 or not 0 <= keep <= max_size or not 0 <= idx <= seq:
            raise fail(
                f"has offset {offset}, keep {keep}, max_size {max_size}, index {idx}, which do not fit {seq} positions"
            )
    elif cls_name in ("KVCache", "QuantizedKVCache") and not 0 <= values[0] <= seq:
        raise fail(f"has offset {values[0]} outside its {seq} positions")


def _plan(f: BinaryIO, path: object) -> _Plan:
    size = os.fstat(f.fileno()).st_size
    header, data_start = _read_header(f, size, path)
    tensors = _tensors(header, data_start, size, path)
    user, classes, scalars = _metadata(header, path)

    def value_of(t: _Tensor) -> int:
        return int(struct.unpack(_INTS[t.dtype], _read_exactly(f, t.start, t.nbytes, path))[0])

    layers = _check_layers(classes, tensors, scalars, value_of, path)
    return _Plan(tensors, layers, user)


def _read_exactly(f: BinaryIO, at: int, n: int, path: object) -> bytes:
    f.seek(at)
    data = f.read(n)
    if data is None or len(data) != n:
        raise _bad(path, f"it ended while reading bytes [{at}, {at + n}) (the file changed or is truncated)")
    return data


def _open(path: str | os.PathLike[str]) -> BinaryIO:
    try:
        return open(path, "rb", buffering=0)
    except OSError as e:
        raise _bad(path, f"cannot be opened ({e.strerror or e})", "give the path of a saved KV cache file") from None


# -- reading ---------------------------------------------------------------------


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata a file was saved with, after checking its header (reads no tensor data).

    Cheap whatever the cache size: use it to check the model or a fingerprint
    before :func:`load` reads gigabytes.

    Args:
        path: A file written by :func:`save` or ``mlx_lm.models.cache.save_prompt_cache``.

    Returns:
        The ``metadata`` given to the save.

    Raises:
        KVFileError: The file is missing, malformed or not a KV cache.
    """
    with _open(path) as f:
        return _plan(f, path).metadata


def load(path: str | os.PathLike[str], pace: Pace, *, room: int = 0) -> tuple[list[Any], dict[str, str]]:
    """Read a KV cache and its metadata, in budget-sized pieces with checkpoints between them.

    Runs on the thread that owns the MLX stream. The whole header is checked
    before any tensor is allocated; tensor bytes are then read straight into
    the memory of new, evaluated MLX arrays, allocated on a helper thread
    (:class:`_Buffers`).

    Args:
        path: A file written by :func:`save` or ``mlx_lm.models.cache.save_prompt_cache``.
        pace: The stop budget and checkpoints (``unpaced()`` when nobody stops it).
        room: Positions to leave free after each ``KVCache`` / ``QuantizedKVCache``
          layer's tokens (rounded up to whole ``KV_STEP``s, as
          :func:`.prefix_cache.restore` rounds), so that the tokens that follow
          are written in place: no copy of the whole cache before them.
          Default: 0 (the file's shapes).

    Returns:
        The cache layers (``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache``
        or ``ConcatenateKVCache``), ready for the model, and the metadata.

    Raises:
        KVFileError: The file is missing, malformed or not a KV cache.
        Cancelled: A stop was requested; what was read is freed with the exception (after the
          caller reported the stop), nothing else refers to it.
    """
    with _open(path) as f:
        plan = _plan(f, path)
        pace.checkpoint()
        pieces = _Pieces(pace)
        # On a stop, what was read goes with this frame once the caller has handled the
        # stop: freeing up to GBs here (10-55 ms at 1 GB) would delay the report.
        arrays: dict[str, mx.array] = {}
        sizes = _positions_with_room(plan, room)
        wanted = {name for layer in plan.layers if not layer.empty for name in layer.arrays}
        tensors = [t for t in sorted(plan.tensors.values(), key=lambda t: t.start) if t.name in wanted]
        # Each tensor's memory is allocated on a helper thread while the one before it is read.
        buffers: list[Future[mx.array] | None] = [_BUFFERS.allocate(tensors[0], sizes)] if tensors else []
        for i, t in enumerate(tensors):
            if i + 1 < len(tensors):
                buffers.append(_BUFFERS.allocate(tensors[i + 1], sizes))
            out = _BUFFERS.wait(buffers[i], pieces)
            buffers[i] = None
            arrays[t.name] = _read_tensor(f, t, out, sizes.get(t.name, 0), pieces, path)
        cache = [_build(layer, [arrays.get(name) for name in layer.arrays]) for layer in plan.layers]
    return cache, dict(plan.metadata)


def _positions_with_room(plan: _Plan, room: int) -> dict[str, int]:
    """Tensor name -> positions its buffer holds (axis 2), for the tensors read with room after their tokens."""
    sizes: dict[str, int] = {}
    if room <= 0:
        return sizes
    for layer in plan.layers:
        if layer.empty or layer.cls not in (KVCache, QuantizedKVCache):
            continue  # a rotating cache's buffer is its window; a concatenating one has no offset
        offset = layer.scalars[0]
        for name in layer.arrays:
            t = plan.tensors[name]
            if t.nbytes:  # 4-D (checked), no axis of length 0
                sizes[name] = max(t.shape[2], with_room(offset, room))
    return sizes


def _build(layer: _Layer, got: list[mx.array | None]) -> Any:
    """The cache object of one checked layer (``from_state``, as ``load_prompt_cache`` does)."""
    keys: Any = None
    values: Any = None
    if layer.empty:
        pass
    elif len(got) == 6:
        keys, values = tuple(got[:3]), tuple(got[3:])
    else:
        keys, values = got
    return layer.cls.from_state((keys, values, *layer.scalars))


class _Buffers:
    """Tensors' memory, allocated and zeroed on a helper thread, so that a stop need not wait for it.

    MLX has no uninitialized array: a tensor's buffer is an ``mx.zeros``
    evaluated in one piece, whose first touch of fresh pages took 33-55 ms
    for 64 MB on the 2-core CPU and stalled to 0.11-0.21 s in 2 of 20 rounds
    (page faults under memory pressure), past a 0.1 s budget. The helper
    fills the next tensor's buffer while the current one is read; the worker
    waits for it with checkpoints. A stopped load leaves the helper to finish
    a fill nobody reads: CPU work on the CPU stream (never the GPU's), freed
    when it ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def allocate(self, t: _Tensor, sizes: dict[str, int]) -> Future[mx.array]:
        """A zeroed buffer for ``t``: its bytes, or with room (``sizes``, positions on axis 2)."""
        nbytes = t.nbytes if t.name not in sizes else t.nbytes // t.shape[2] * sizes[t.name]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlx-notebook-kv-alloc")
            return self._pool.submit(_zeros, nbytes // _DTYPES[t.dtype][0], _DTYPES[t.dtype][2])

    def settled(self, timeout: float) -> None:
        """Wait until the fills asked for so far have ended (a stopped load's memory is freed then)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.submit(lambda: None).result(timeout)

    @staticmethod
    def wait(buffer: Future[mx.array] | None, pieces: _Pieces) -> mx.array:
        assert buffer is not None
        while True:
            try:
                return buffer.result(timeout=pieces.piece_s / 2)
            except FuturesTimeout:
                pieces.checkpoint()


def _zeros(n: int, storage: mx.Dtype) -> mx.array:
    """An evaluated zero array of ``n`` elements, on this (helper) thread's CPU stream."""
    out = mx.zeros((n,), storage, stream=mx.cpu)
    mx.eval(out)
    return out


_BUFFERS = _Buffers()


def _read_tensor(f: BinaryIO, t: _Tensor, out: mx.array, size: int, pieces: _Pieces, path: object) -> mx.array:
    """One tensor read into ``out`` (evaluated, zeroed), piece by piece.

    ``size``: 0 when ``out`` has the tensor's shape; else the positions
    ``out`` holds on axis 2 (``[batch, heads, positions, ...]``), where each
    of the file's ``batch * heads`` rows of positions starts a row of ``size``.
    """
    dtype = _DTYPES[t.dtype][1]
    view = memoryview(out).cast("B")  # type: ignore[arg-type]
    rows = t.shape[0] * t.shape[1] if size else 1
    row = t.nbytes // rows
    stride = row // t.shape[2] * size if size else row
    try:
        f.seek(t.start)
        for r in range(rows):
            done = 0
            while done < row:
                n = pieces.next(row - done)
                t0 = time.perf_counter()
                at = r * stride + done
                _readinto(f, view[at : at + n], path, t)
                pieces.took(n, time.perf_counter() - t0)
                done += n
                pieces.checkpoint()
    except BaseException:
        del out  # a traceback keeps this frame: drop the half-read array now
        raise
    finally:
        view.release()
    shape = t.shape if not size else (t.shape[0], t.shape[1], size, *t.shape[3:])
    result = out.view(dtype).reshape(shape)
    del out
    mx.eval(result)
    return result


def _readinto(f: BinaryIO, buf: memoryview, path: object, t: _Tensor) -> None:
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])  # type: ignore[attr-defined]
        if not n:
            raise _bad(path, f"it ended inside tensor {t.name!r} (the file changed while it was read)")
        got += n


# -- writing ---------------------------------------------------------------------


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes of tensor data :func:`save` writes for ``cache`` (the file adds a small header)."""
    return sum(a.nbytes for _, a in _flatten(cache, check=False) if isinstance(a, mx.array))


def _flatten(cache: list[Any], *, check: bool = True) -> Iterator[tuple[str, Any]]:
    """``tree_flatten([c.state for c in cache])``: (name, array or int or None)."""
    for i, layer in enumerate(cache):
        name = type(layer).__name__
        if check and (name not in _CLASSES or type(layer) is not _CLASSES[name][0]):
            known = ", ".join(_CLASSES)
            raise KVFileError(f"cache layer {i} is a {name}, which a KV file cannot hold; use {known}")
        for j, field in enumerate(layer.state):
            if isinstance(field, (tuple, list)):
                for k, a in enumerate(field):
                    yield f"{i}.{j}.{k}", a
            else:
                yield f"{i}.{j}", field


def save(path: str | os.PathLike[str], cache: list[Any], metadata: dict[str, str], pace: Pace) -> int:
    """Write a KV cache and string metadata to one file, in budget-sized pieces.

    Runs on the thread that owns the MLX stream (the cache's arrays are
    evaluated first). The bytes go to a temporary file in the same folder,
    which replaces ``path`` once complete. The file is not ``fsync``-ed: it
    survives the process, not a power cut.

    Args:
        path: Where to write (conventionally ``*.safetensors`` for mlx-lm).
        cache: The model's cache layers (``KVCache``, ``QuantizedKVCache``,
          ``RotatingKVCache`` or ``ConcatenateKVCache``).
        metadata: Strings kept with the cache; keys must not contain ``.`` nor be
          all digits (mlx-lm would read them back as nested entries).
        pace: The stop budget and checkpoints (``unpaced()`` when nobody stops it).

    Returns:
        The size of the file in bytes.

    Raises:
        KVFileError: The cache or metadata cannot be saved, or the file cannot be written.
        Cancelled: A stop was requested; ``path`` is as it was before the call.
    """
    meta = _check_metadata(metadata)
    entries = list(_flatten(cache))
    arrays = [a for _, a in entries if isinstance(a, mx.array)]
    mx.eval(arrays)
    pace.checkpoint()
    header: dict[str, Any] = {}
    blobs: list[tuple[str, Any]] = []  # (name, mx.array or bytes), in file order
    scalar_list: list[tuple[str, str]] = []
    offset = 0
    blob: Any
    for name, value in entries:
        if isinstance(value, mx.array):
            if value.dtype not in _NAMES:
                raise KVFileError(f"cache tensor {name} is of dtype {value.dtype}, which safetensors cannot hold")
            dtype, shape, nbytes, blob = _NAMES[value.dtype], list(value.shape), value.nbytes, value
        elif value is None:
            dtype, shape, nbytes, blob = "F32", [0], 0, b""
            scalar_list.append((name, "none"))
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            wide = not -(2**31) <= int(value) < 2**31
            dtype, shape, blob = ("I64" if wide else "I32"), [], struct.pack("<q" if wide else "<i", int(value))
            nbytes = len(blob)
            scalar_list.append((name, "scalar"))
        else:
            raise KVFileError(
                f"cache entry {name} is a {type(value).__name__}, which a KV file cannot hold; save KVCache-like layers"
            )
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        blobs.append((name, blob))
        offset += nbytes
    flat_meta = {f"0.{k}": v for k, v in meta.items()}
    flat_meta.update({f"1.{i}": type(layer).__name__ for i, layer in enumerate(cache)})
    flat_meta["2.0"] = ""
    for k, (name, kind) in enumerate(scalar_list, 1):
        flat_meta[f"2.{k}.0"], flat_meta[f"2.{k}.1"] = name, kind
    header["__metadata__"] = flat_meta
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # tensor data 8-byte aligned, as the format recommends
    size = 8 + len(raw) + offset
    _check_own_header(header, raw, size, cache, path)
    return _write(path, struct.pack("<Q", len(raw)) + raw, blobs, size, pace)


def _check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if not isinstance(metadata, dict):
        raise KVFileError(f"metadata is a {type(metadata).__name__}; give a dict of strings")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise KVFileError(
                f"metadata entry {key!r} is not a string pair; encode values as strings (e.g. json.dumps)"
            )
        if not key or "." in key or _index(key) is not None:
            raise KVFileError(
                f"metadata key {key!r} is empty, holds a '.' or is a number; mlx-lm would misread it, rename it"
            )
    return dict(metadata)


def _check_own_header(header: dict[str, Any], raw: bytes, size: int, cache: list[Any], path: object) -> None:
    """Run the reader's checks on the header about to be written: never write a file load() refuses."""
    data_start = 8 + len(raw)
    tensors = _tensors(header, data_start, size, path)
    _, classes, scalars = _metadata(header, path)
    values = {f"{i}.{j}": v for i, layer in enumerate(cache) for j, v in enumerate(layer.state)}

    def value_of(t: _Tensor) -> int:
        return int(values[t.name])

    try:
        _check_layers(classes, tensors, scalars, value_of, path)
    except KVFileError as e:
        raise KVFileError(f"the cache cannot be saved as it is: {str(e).split(': ', 1)[-1]}") from None


def _write(path: str | os.PathLike[str], head: bytes, blobs: list[tuple[str, Any]], size: int, pace: Pace) -> int:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise KVFileError(f"cannot write {target}: {e.strerror or e}; choose a writable folder") from None
    try:
        with open(fd, "wb", buffering=0) as f:
            _write_all(f, memoryview(head))
            pieces = _Pieces(pace)
            behind = _WriteBehind(fd)
            for _, blob in blobs:
                _write_blob(f, blob, pieces, behind)
            written = f.tell()
            behind.finish()
        if written != size:
            raise KVFileError(f"{target}: wrote {written:,} of {size:,} bytes; check the free disk space")
        pace.checkpoint()  # the last chance to stop: the file is complete, replacing it is cheap
        old = _keep_old(target)
        os.replace(tmp, target)
        if old is not None:
            _remove_soon(old, pace.budget_s * SAVE_CLEANUP_SHARE)
    except BaseException as e:
        _remove_soon(tmp, pace.budget_s * SAVE_CLEANUP_SHARE)
        if isinstance(e, OSError):
            raise KVFileError(
                f"cannot write {target}: {e.strerror or e}; free disk space or choose another folder"
            ) from None
        raise
    return size


def _bytes_of(a: mx.array) -> tuple[mx.array, memoryview]:
    """A C-contiguous byte view of an evaluated array (bf16 and friends through an unsigned view)."""
    storage = _DTYPES[_NAMES[a.dtype]][2]
    b = a.view(storage) if a.dtype != storage else a
    mx.eval(b)
    view = memoryview(b)  # type: ignore[arg-type]
    if not view.c_contiguous:
        view.release()
        b = mx.contiguous(b)
        mx.eval(b)
        view = memoryview(b)  # type: ignore[arg-type]
    return b, view.cast("B")


def _keep_old(target: Path) -> Path | None:
    """A hidden hard link to the file ``target`` names now, so that replacing it frees no blocks.

    ``os.replace`` over a 1 GB file took 0.3 s here, freeing the old file's
    blocks after the last checkpoint; the link moves that to :func:`_remove_soon`.
    ``None`` when there is no old file or the filesystem has no hard links.
    """
    old = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.old")
    try:
        os.link(target, old)
    except OSError:
        return None
    return old


def _remove_soon(tmp: Path, wait_s: float) -> None:
    """Delete a stopped save's temporary file (or a replaced old file) on a helper thread, waiting at most ``wait_s``.

    Freeing the blocks of a written file is slow here (ext4 with ``discard``:
    0.25 s for 0.7 GB) and cannot be split; the file's name is hidden and
    unique, so it may outlive the call by that long. The thread is named
    ``kv-file-cleanup`` (tests join it).
    """

    def remove() -> None:
        try:
            os.unlink(tmp)
        except OSError:
            pass

    thread = threading.Thread(target=remove, name=f"kv-file-cleanup {tmp.name}", daemon=True)
    thread.start()
    thread.join(wait_s)


class _WriteBehind:
    """Pushes each written piece to the disk while the next one is written (Linux ``sync_file_range``).

    Without it, ext4 writes out a whole new file when it replaces an old one
    (``auto_da_alloc``): measured here, ``os.replace`` of a 1 GB file took 0.7 s
    that no checkpoint could split, and a stopped save's ``unlink`` freed up to
    1 GB of dirty pages. Waiting for piece k-1 after writing piece k keeps at
    most two pieces in flight, and the wait counts in the measured piece time.
    """

    _FLAGS_START = 2  # SYNC_FILE_RANGE_WRITE
    _FLAGS_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.prev: tuple[int, int] | None = None
        self.call = _sync_file_range()

    def wrote(self, at: int, n: int) -> None:
        if self.call is None:
            return
        self.call(self.fd, at, n, self._FLAGS_START)
        if self.prev is not None:
            self.call(self.fd, *self.prev, self._FLAGS_WAIT)
        self.prev = (at, n)

    def finish(self) -> None:
        if self.call is not None and self.prev is not None:
            self.call(self.fd, *self.prev, self._FLAGS_WAIT)
            self.prev = None


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (a ctypes call: it releases the GIL), or ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _write_blob(f: BinaryIO, blob: Any, pieces: _Pieces, behind: _WriteBehind) -> None:
    if isinstance(blob, bytes):
        _write_all(f, memoryview(blob))
        return
    if blob.nbytes == 0:
        return
    keep, view = _bytes_of(blob)
    try:
        done = 0
        while done < len(view):
            n = pieces.next(len(view) - done)
            t0 = time.perf_counter()
            at = f.tell()
            _write_all(f, view[done : done + n])
            behind.wrote(at, n)
            pieces.took(n, time.perf_counter() - t0)
            done += n
            pieces.checkpoint()
    finally:
        view.release()
        del keep


def _write_all(f: BinaryIO, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += f.write(data[done:]) or 0


__all__ = ["KVFileError", "cache_nbytes", "load", "read_metadata", "save"]
