"""Read large safetensors weights in row blocks, so a stop during a load waits for one block.

MLX loads a safetensors tensor lazily as one ``Load``: evaluating it reads
the whole tensor (and, on CUDA, copies it to the device) in one go. A 1 GB
embedding is then 90-340 ms that a stop has to wait for on an H200. Here a
large tensor is read instead as blocks of rows, each an eager ``mx.load`` of
a one-tensor "file" that is a window onto the real file (MLX reads straight
into its own buffer, no extra copy), and the blocks are joined on the device
(a copy at device bandwidth, ~2 ms per GB on an H200).

Only used on GPU streams: on MLX's CPU backend the join costs more than the
read it splits up (measured on a 2-core x86 CPU: a 128 MB tensor reads in
~50 ms, the join takes ~150 ms), and CPU models are small.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import glob
import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import mlx.core as mx

# mlx-lm model types whose ``sanitize`` only drops weights (rotary tables, a
# tied head): their parameters are the file's tensors unchanged, by name. For
# other types a weight may be transformed under its own name, so its file
# bytes are not the parameter and the block path is not used.
BLOCK_SAFE_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "starcoder2"}
)

_DTYPES = {
    "BF16": mx.bfloat16,
    "F16": mx.float16,
    "F32": mx.float32,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file.

    Args:
        path: The file.
        dtype: The safetensors dtype code (``"BF16"``, ...).
        shape: The tensor's shape.
        offset: Absolute byte offset of its data in the file.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def matches(self, array: mx.array) -> bool:
        """Whether ``array`` can be these bytes: same shape and dtype, rows to split."""
        return (
            _DTYPES.get(self.dtype) == array.dtype
            and tuple(array.shape) == self.shape
            and len(self.shape) >= 1
            and self.shape[0] >= 2
        )

    @property
    def row_bytes(self) -> int:
        size = _DTYPES[self.dtype].size
        for dim in self.shape[1:]:
            size *= dim
        return size


def index_folder(folder: Path) -> dict[str, StoredTensor]:
    """Map tensor names to their place in the folder's ``model*.safetensors`` (mlx-lm's glob)."""
    index: dict[str, StoredTensor] = {}
    for path in sorted(glob.glob(str(Path(folder) / "model*.safetensors"))):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin = meta["data_offsets"][0]
            index[name] = StoredTensor(path, meta["dtype"], tuple(meta["shape"]), 8 + header_len + begin)
    return index


class _RowWindow(io.RawIOBase):
    """Rows ``[first, first + count)`` of a stored tensor, seen as a one-tensor safetensors file."""

    def __init__(self, fd: int, stored: StoredTensor, first: int, count: int) -> None:
        super().__init__()
        nbytes = count * stored.row_bytes
        shape = [count, *stored.shape[1:]]
        header = json.dumps({"w": {"dtype": stored.dtype, "shape": shape, "data_offsets": [0, nbytes]}})
        header_bytes = header.encode() + b" " * (-len(header) % 8)
        self._head = struct.pack("<Q", len(header_bytes)) + header_bytes
        self._fd = fd
        self._data_at = stored.offset + first * stored.row_bytes
        self._size = len(self._head) + nbytes
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        if self._pos < len(self._head):
            done = min(len(view), len(self._head) - self._pos)
            view[:done] = self._head[self._pos : self._pos + done]
            self._pos += done
        while done < len(view) and self._pos < self._size:
            # os.preadv releases the GIL while the kernel copies.
            got = os.preadv(self._fd, [view[done:]], self._data_at + self._pos - len(self._head))
            if got <= 0:
                break
            done += got
            self._pos += got
        return done


def read_rows(fd: int, stored: StoredTensor, first: int, count: int) -> mx.array:
    """Read ``count`` rows from ``first`` into an evaluated array on the default stream."""
    # mx.load reads any binary file object (typed as BinaryIO), eagerly.
    loaded = mx.load(cast(BinaryIO, _RowWindow(fd, stored, first, count)), format="safetensors")
    block = cast(dict[str, mx.array], loaded)["w"]
    mx.eval(block)
    return block
