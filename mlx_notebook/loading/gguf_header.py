"""Read a GGUF header with llama.cpp's ``gguf`` reader, checked before MLX ever sees the file.

``mx.load`` crashes the process (SIGSEGV) on some malformed headers, and a model
file is input, so :func:`read_header` stops a bad file first, in two steps:

1. a 24-byte pre-check of our own: magic, version, byte order, and tensor and
   key/value counts that fit in the file. ``gguf.GGUFReader`` walks absurd counts
   item by item (a numpy view per item, many times the file's size in memory
   when the bytes it walks are zeros), and MLX's reader crashes on them;
2. ``gguf.GGUFReader`` parses the rest (bad type tags, truncation, invalid UTF-8
   and duplicates raise there), then we check what MLX's reader needs beyond
   what ``gguf`` checks: at most 4 dimensions (gguflib's fixed array), int32
   sizes, tensor types ``mx.load`` converts or :mod:`.gguf_quants` dequantizes,
   aligned offsets (MLX divides by a uint32 alignment), data inside the file.

Every reader of tensor data (``mx.load``, :mod:`.gguf_blocks`, the rotary-factor
tensors :mod:`.gguf_model` reads) runs only on a header this module accepted.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelFormatError, ModelNotFoundError
from .gguf_quants import MLX_READS, TARGETS

__all__ = ["FIX_DOWNLOAD", "FIX_OTHER", "FIX_TYPE", "GGUFInfo", "GGUFTensor", "QUANT_BITS", "read_header"]

FIX_DOWNLOAD = "re-download it"
FIX_FOLDER = "give a .gguf file or an MLX model folder"
FIX_OTHER = "use an MLX model folder instead (mlx_lm.convert makes one)"
FIX_TYPE = "use a Q4_K_M, Q5_K_M, Q6_K, Q8_0 or F16 file"

# The ggml types mlx-notebook reads: mx.load's own (F32, F16, BF16, Q4_0, Q4_1,
# Q8_0), and the K-quants and IQ types gguf dequantizes (.gguf_quants); every
# quantized one becomes an MLX affine triplet with group size 32, of these bits.
_SUPPORTED_TYPES = MLX_READS + tuple(TARGETS)
QUANT_BITS = {name: target.bits for name, target in TARGETS.items()}
_MAX_DIMS = 4  # gguflib keeps dims in a fixed array of 4; more overflows it.
_MAX_INT32 = 2**31 - 1  # MLX shapes and gguflib's counts are int32.
_HEADER_BYTES = 24  # magic, version, tensor count, key/value count
_MIN_KV_BYTES = 8 + 4 + 1  # key length, type tag, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the GGUF header describes it.

    Attributes:
        name: The GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
        type_name: The ggml type, e.g. ``"Q4_1"``.
        shape: The shape in MLX / numpy order (the GGUF dims reversed).
        offset: Absolute byte offset of the data in the file.
        nbytes: Size of the data in the file.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFInfo:
    """What :func:`read_header` read from a valid GGUF header.

    Attributes:
        path: The file.
        version: GGUF version (2 or 3).
        architecture: ``general.architecture``, e.g. ``"llama"``.
        metadata: Every key/value pair: numbers, strings, bools, and lists for arrays.
        tensors: The tensor infos by name, in file order.
        alignment: Data alignment in bytes (``general.alignment``, default 32).
        data_offset: Byte offset where the tensor data section starts.
        file_size: Size of the file in bytes.
        reader: The parsed ``gguf.GGUFReader``, kept so that transformers'
            metadata reader (:mod:`.gguf_model`) need not parse the file again.
    """

    path: Path
    version: int
    architecture: str
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GGUFTensor] = field(repr=False)
    alignment: int
    data_offset: int
    file_size: int
    reader: Any = field(default=None, repr=False, compare=False)


def open_checked(path: Path, label: str) -> tuple[Any, int]:
    """The open file and its size, or the one-line error a missing or unreadable path deserves."""
    if not path.exists():
        raise ModelNotFoundError(f"{label}: no such file; {FIX_FOLDER}")
    if path.is_dir():
        raise ModelFormatError(f"{label}: is a folder, not a GGUF file; {FIX_FOLDER}")
    try:
        fileobj = open(path, "rb")
    except OSError as exc:
        raise ModelFormatError(f"{label}: cannot read it ({exc.strerror}); {FIX_FOLDER}") from None
    return fileobj, os.fstat(fileobj.fileno()).st_size


def read_header(path: str | os.PathLike[str]) -> GGUFInfo:
    """Parse and check a GGUF header with ``gguf.GGUFReader``, without MLX.

    Args:
        path: The ``.gguf`` file.

    Returns:
        The parsed header.

    Raises:
        ModelNotFoundError: The file does not exist.
        ModelFormatError: The file is not a GGUF file, is corrupt or truncated, or
            holds tensors MLX cannot read. The one-line message names the file,
            says what is wrong and what to do instead.
    """
    path = Path(path)
    label = path.name or str(path)
    fileobj, size = open_checked(path, label)
    with fileobj:
        version = _precheck(fileobj.read(_HEADER_BYTES), size, label)

    try:
        reader = _reader(path)
        # Strings are decoded here, not while parsing: bad UTF-8 shows up now.
        metadata = {name: value.contents() for name, value in reader.fields.items() if not name.startswith("GGUF.")}
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as exc:
        detail = " ".join(str(exc).split())[:200]
        if isinstance(exc, IndexError) or "reshape" in detail or "larger dtype" in detail:
            # numpy's words for a read past the end of the mapped file.
            detail = "a header field or tensor runs past the end of the file"
        raise ModelFormatError(f"{label}: corrupt or truncated GGUF file ({detail}); {FIX_DOWNLOAD}") from None
    tensors = {}
    for tensor in reader.tensors:
        tensors[tensor.name] = _check_tensor(label, tensor, reader.alignment, reader.data_offset, size)
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise ModelFormatError(
            f"{label}: GGUF file without general.architecture, so its model type is unknown; {FIX_OTHER}"
        )
    return GGUFInfo(path, version, architecture, metadata, tensors, reader.alignment, reader.data_offset, size, reader)


_GET_PARAMETERS = ["self", "offset", "dtype", "count", "override_order"]  # gguf 0.19's GGUFReader._get


def _reader(path: Path) -> Any:
    """``gguf.GGUFReader(path)``, parsing ~3x faster.

    The reader slices its ``np.memmap`` once per value, and numpy runs Python
    code (``memmap.__array_finalize__``) for every slice of a memmap: a real
    tokenizer's 150k tokens and 150k merges took ~10 s to parse on a 2-core CPU,
    ~3.5 s through a plain ndarray view of the same map. Same values, same
    errors (a read past the end still fails in the reader's own checks).
    ``_get`` is gguf's private method: a gguf whose ``_get`` takes other
    arguments gets its own reader, slower but right.
    """
    import inspect

    import gguf
    import numpy as np

    if list(inspect.signature(gguf.GGUFReader._get).parameters) != _GET_PARAMETERS:
        return gguf.GGUFReader(path)

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader(path)


def _precheck(head: bytes, size: int, label: str) -> int:
    """The GGUF version, once the first 24 bytes say the file can be handed to a reader."""
    if size == 0:
        raise ModelFormatError(f"{label}: empty file, not a GGUF file; {FIX_FOLDER}")
    if head[:4] != b"GGUF":
        raise ModelFormatError(f"{label}: not a GGUF file (bad magic); {FIX_FOLDER}")
    if len(head) < _HEADER_BYTES:
        raise ModelFormatError(
            f"{label}: truncated GGUF file (the header needs {_HEADER_BYTES} bytes, file has {size}); {FIX_DOWNLOAD}"
        )
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", head, 4)
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16:
            # gguf reads it, but MLX's reader does not swap bytes.
            raise ModelFormatError(
                f"{label}: big-endian GGUF file, which mlx-notebook cannot read; "
                f"use a little-endian (ordinary) GGUF file"
            )
        raise ModelFormatError(
            f"{label}: GGUF version {version} is not supported (versions 2 and 3 are); "
            f"re-convert it with a current llama.cpp, or {FIX_OTHER}"
        )
    if _HEADER_BYTES + kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > size:
        raise ModelFormatError(
            f"{label}: truncated or corrupt GGUF file (header says {tensor_count} tensors and "
            f"{kv_count} metadata entries, file ends at byte {size}); {FIX_DOWNLOAD}"
        )
    return int(version)


def _check_tensor(label: str, tensor: Any, alignment: int, data_offset: int, size: int) -> GGUFTensor:
    """What MLX's reader needs of one tensor that ``gguf`` does not check."""
    import gguf

    name = tensor.name
    dims = [int(d) for d in tensor.shape]
    if not 1 <= len(dims) <= _MAX_DIMS:
        raise ModelFormatError(
            f"{label}: tensor '{name}' has {len(dims)} dimensions (GGUF allows 1 to {_MAX_DIMS}; "
            f"corrupt file); {FIX_DOWNLOAD}"
        )
    if any(d < 1 or d > _MAX_INT32 for d in dims):
        raise ModelFormatError(
            f"{label}: tensor '{name}' has invalid dimensions {dims} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    type_name = tensor.tensor_type.name
    if type_name not in _SUPPORTED_TYPES:
        raise ModelFormatError(
            f"{label}: tensor '{name}' has type {type_name}, which mlx-notebook cannot read; {FIX_TYPE}"
        )
    block_values = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
    if dims[0] % block_values:
        raise ModelFormatError(
            f"{label}: tensor '{name}' rows of {dims[0]} values do not fill whole {type_name} "
            f"blocks of {block_values} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    # mx.load counts the packed uint32 words of a quantized tensor in an int (our
    # block reader's output is the same size: MLX shapes are int32 too).
    if type_name in QUANT_BITS and math.prod(dims) * QUANT_BITS[type_name] // 32 > _MAX_INT32:
        raise ModelFormatError(f"{label}: tensor '{name}' is too large for MLX's GGUF reader; {FIX_OTHER}")
    offset = int(tensor.data_offset) - data_offset
    if offset % alignment:
        raise ModelFormatError(
            f"{label}: tensor '{name}' data offset {offset} is not a multiple "
            f"of the alignment {alignment} (corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    if end > size:
        raise ModelFormatError(
            f"{label}: truncated GGUF file (tensor '{name}' data ends at byte {end}, "
            f"file ends at byte {size}); {FIX_DOWNLOAD}"
        )
    return GGUFTensor(name, type_name, tuple(reversed(dims)), int(tensor.data_offset), int(tensor.n_bytes))
