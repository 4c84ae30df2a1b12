"""Write small GGUF files for tests: header, metadata, tensor infos, aligned data.

Pure Python and numpy, so tests can build valid files and then break them at
known byte offsets. The quantizers pack blocks the way llama.cpp does, which is
what ``mx.load`` unpacks.

Example::

    layout = write_gguf(path, {"general.architecture": "llama"},
                        [f32("output_norm.weight", np.ones(64, np.float32))])
    layout.data_start  # byte offset of the tensor data section
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
_SCALAR = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}

# GGML tensor types used here.
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, BF16 = 0, 1, 2, 3, 8, 12, 30


@dataclass
class Tensor:
    """One tensor: GGUF dims are the numpy shape reversed (``ne[0]`` is the row length)."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    data: bytes


@dataclass
class Layout:
    """Byte offsets of the sections of a written file, for cutting and patching."""

    kv_start: int
    kv_offsets: list[int]  # start of each key/value pair
    tensor_info_start: int
    tensor_info_offsets: list[int]  # start of each tensor info
    data_start: int
    size: int


def typed(value_type: int, value: Any) -> tuple[int, Any]:
    """Give a metadata value an explicit GGUF type (``ARRAY`` takes ``(elem_type, list)``)."""
    return (value_type, value)


def _infer(value: Any) -> tuple[int, Any]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, bool):
        return BOOL, value
    if isinstance(value, int):
        return UINT32, value
    if isinstance(value, float):
        return FLOAT32, value
    if isinstance(value, str):
        return STRING, value
    if isinstance(value, list):
        elem = _infer(value[0])[0] if value else INT32
        if elem == UINT32:
            elem = INT32
        return ARRAY, (elem, value)
    raise TypeError(f"cannot infer a GGUF type for {value!r}")


def _string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(value_type: int, value: Any) -> bytes:
    if value_type == STRING:
        return _string(value)
    if value_type == ARRAY:
        elem_type, items = value
        body = b"".join(_value(elem_type, item) for item in items)
        return struct.pack("<IQ", elem_type, len(items)) + body
    return struct.pack(_SCALAR[value_type], value)


def gguf_bytes(
    metadata: dict[str, Any], tensors: list[Tensor], *, version: int = 3, alignment: int = 32
) -> tuple[bytes, Layout]:
    """Serialize a GGUF file; ``alignment`` must match any ``general.alignment`` given."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata)))
    kv_start, kv_offsets = len(out), []
    for key, raw in metadata.items():
        kv_offsets.append(len(out))
        value_type, value = _infer(raw)
        out += _string(key) + struct.pack("<I", value_type) + _value(value_type, value)
    info_start, info_offsets, offset = len(out), [], 0
    for tensor in tensors:
        info_offsets.append(len(out))
        out += _string(tensor.name) + struct.pack("<I", len(tensor.dims))
        out += struct.pack(f"<{len(tensor.dims)}Q", *tensor.dims)
        out += struct.pack("<IQ", tensor.ggml_type, offset)
        offset += -(-len(tensor.data) // alignment) * alignment
    out += bytes(-len(out) % alignment)
    data_start = len(out)
    for tensor in tensors:
        out += tensor.data + bytes(-len(tensor.data) % alignment)
    layout = Layout(kv_start, kv_offsets, info_start, info_offsets, data_start, len(out))
    return bytes(out), layout


def write_gguf(path: Path, metadata: dict[str, Any], tensors: list[Tensor], **kwargs: Any) -> Layout:
    """Write :func:`gguf_bytes` to ``path`` and return its layout."""
    data, layout = gguf_bytes(metadata, tensors, **kwargs)
    Path(path).write_bytes(data)
    return layout


# ---------------------------------------------------------------- tensor data


def _dims(array: np.ndarray) -> tuple[int, ...]:
    return tuple(reversed(array.shape))


def f32(name: str, array: np.ndarray) -> Tensor:
    return Tensor(name, F32, _dims(array), np.ascontiguousarray(array, "<f4").tobytes())


def f16(name: str, array: np.ndarray) -> Tensor:
    return Tensor(name, F16, _dims(array), np.ascontiguousarray(array, "<f2").tobytes())


def bf16(name: str, array: np.ndarray) -> Tensor:
    """Round-to-nearest-even bfloat16: the top half of each float32."""
    bits = np.ascontiguousarray(array, "<f4").view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return Tensor(name, BF16, _dims(array), rounded.tobytes())


def _blocks(array: np.ndarray) -> np.ndarray:
    assert array.shape[-1] % 32 == 0, "quantized rows must be a multiple of 32"
    return np.asarray(array, np.float32).reshape(-1, 32)


def _nibbles(q: np.ndarray) -> np.ndarray:
    # Byte j holds element j in its low nibble and element j + 16 in its high one.
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def q8_0(name: str, array: np.ndarray) -> Tensor:
    """Blocks of 32: one f16 scale, 32 int8 values."""
    x = _blocks(array)
    d = (np.abs(x).max(axis=1) / 127).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros(len(d), np.float32), where=d != 0)
    q = np.round(x * inv[:, None]).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    return Tensor(name, Q8_0, _dims(array), raw.tobytes())


def q4_0(name: str, array: np.ndarray) -> Tensor:
    """Blocks of 32: one f16 scale, 4-bit values centered on 8."""
    x = _blocks(array)
    signed_max = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    d = (signed_max / -8).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros(len(d), np.float32), where=d != 0)
    q = np.clip(np.trunc(x * inv[:, None] + 8.5), 0, 15).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), _nibbles(q)], axis=1)
    return Tensor(name, Q4_0, _dims(array), raw.tobytes())


def q4_1(name: str, array: np.ndarray) -> Tensor:
    """Blocks of 32: f16 scale and f16 minimum, 4-bit values."""
    x = _blocks(array)
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros(len(d), np.float32), where=d != 0)
    q = np.round((x - m.astype(np.float32)[:, None]) * inv[:, None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), _nibbles(q)], axis=1)
    return Tensor(name, Q4_1, _dims(array), raw.tobytes())


def dequantize(tensor: Tensor) -> np.ndarray:
    """The float32 values llama.cpp reads back from a quantized tensor (numpy shape)."""
    shape = tuple(reversed(tensor.dims))
    raw = np.frombuffer(tensor.data, np.uint8)
    if tensor.ggml_type == Q8_0:
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * blocks[:, 2:].view(np.int8)).reshape(shape)
    width = 18 if tensor.ggml_type == Q4_0 else 20
    blocks = raw.reshape(-1, width)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, width - 16 :]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    if tensor.ggml_type == Q4_0:
        return (d * (q - 8)).reshape(shape)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(shape)


def byte_alphabet() -> list[str]:
    """GPT-2's 256 byte-level characters, in byte order (byte 0x20 is 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]
