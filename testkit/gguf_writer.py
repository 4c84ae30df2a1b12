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


# ------------------------------------------------- whole models, through gguf's writer

# Families as llama.cpp writes them: GGUF architecture, general.name, tokenizer.ggml.pre,
# and what the layers carry (q/k/v biases for Qwen2, q/k norms and a wider head for Qwen3).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": dict(arch="qwen2", name="Qwen2.5-0.5B-Instruct", pre="qwen2", style="qwen", vocab=151936, bias=True),
    "qwen3": dict(arch="qwen3", name="Qwen3-0.6B", pre="qwen2", style="qwen", vocab=151936, qk_norm=True, head_dim=32),
    # Mistral Nemo: llama architecture, a byte-level "tekken" vocabulary, its own output matrix.
    "mistral": dict(
        arch="llama", name="Mistral-Nemo-Instruct-2407", pre="tekken", style="llama", vocab=131072, tied=False
    ),
}
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def family_tokenizer(family: str) -> dict[str, Any]:
    """The family's real-size ``tokenizer.json`` content (testkit.real_tokenizer), specials renamed."""
    from .real_tokenizer import tokenizer_json

    spec = FAMILIES[family]
    tok = tokenizer_json(spec["vocab"], n_special=26 if spec["style"] == "qwen" else 256, style=spec["style"])
    if family == "mistral":
        for added, content in zip(tok["added_tokens"], MISTRAL_SPECIALS):
            added["content"] = content
    return tok


def family_weights(family: str, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> tuple[dict, dict]:
    """``(config, weights)``: an mlx-lm config and random float32 weights under Hugging Face names."""
    spec = FAMILIES[family]
    heads, kv_heads, intermediate = 4, 2, 2 * hidden
    head_dim = spec.get("head_dim", hidden // heads)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def gain(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(spec["vocab"], hidden) * 8, "model.norm.weight": gain(hidden)}
    if not spec.get("tied", True):
        w["lm_head.weight"] = mat(spec["vocab"], hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = gain(hidden)
        w[p + "post_attention_layernorm.weight"] = gain(hidden)
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            w[p + f"self_attn.{proj}_proj.weight"] = mat(rows, hidden)
            if spec.get("bias"):
                w[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        w[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim)
        if spec.get("qk_norm"):
            w[p + "self_attn.q_norm.weight"] = gain(head_dim)
            w[p + "self_attn.k_norm.weight"] = gain(head_dim)
        w[p + "mlp.gate_proj.weight"] = mat(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = mat(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = mat(hidden, intermediate)
    config = {
        "model_type": "llama" if family == "mistral" else family,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": spec["vocab"],
        "max_position_embeddings": 4096,
        "tie_word_embeddings": spec.get("tied", True),
    }
    return config, w


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows of a llama model into the interleaved rotary layout."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_family_gguf(path: Path, family: str, config: dict, weights: dict, *, quantize: bool = False) -> Path:
    """Write a model of ``family`` with ``gguf.GGUFWriter``, as llama.cpp's converter would.

    Args:
        path: The ``.gguf`` file to write.
        family: A key of :data:`FAMILIES`.
        config: From :func:`family_weights`.
        weights: From :func:`family_weights` (Hugging Face names, float32).
        quantize: Store the 2-D weights as Q8_0 (else F16); norms and biases stay F32.

    Returns:
        ``path``.
    """
    import gguf

    spec = FAMILIES[family]
    arch = spec["arch"]
    tok = family_tokenizer(family)
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    by_id.update({t["id"]: t["content"] for t in tok["added_tokens"]})
    tokens = [by_id[i] for i in range(len(by_id))]
    added = {t["id"] for t in tok["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(spec["name"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    if family == "mistral":
        ids = {t: i for i, t in enumerate(tokens)}
        writer.add_bos_token_id(ids["<s>"])
        writer.add_eos_token_id(ids["</s>"])
        writer.add_add_bos_token(True)
        writer.add_chat_template(MISTRAL_TEMPLATE)
    else:
        from .tiny_model import CHAT_TEMPLATE

        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config["num_hidden_layers"]
    )
    for name, array in weights.items():
        stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert stored is not None, name
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            array = _llama_cpp_permute(array, heads)
        if array.ndim == 1:
            writer.add_tensor(stored, array.astype(np.float32))
        elif quantize:
            q = gguf.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(stored, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(stored, array.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
