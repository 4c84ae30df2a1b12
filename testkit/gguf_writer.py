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
# and what the layers carry (q/k/v biases for Qwen2, q/k norms and a wider head for Qwen3,
# fused qkv and gate_up for Phi-3, four norms per layer for gemma).
FAMILIES: dict[str, dict[str, Any]] = {
    # Llama 3.1: llama.cpp permutes q/k and stores its rope scaling as the rope_freqs tensor
    # (head_dim 64: several frequencies fall in the scaling's ramp, as in the real model).
    "llama": dict(
        arch="llama",
        name="Llama-3.1-8B-Instruct",
        pre="llama-bpe",
        style="llama",
        vocab=128256,
        tied=False,
        head_dim=64,
        llama3_scaling=True,
    ),
    # Phi-3-mini-4k: fused q/k/v and gate/up, no scaling.
    "phi3": dict(arch="phi3", name="Phi-3-mini-4k-instruct", pre="default", style="llama", vocab=32064, tied=False),
    # Phi-4-mini: rotates 3/4 of each head (rope.dimension_count), longrope factors as tensors.
    "phi3_partial": dict(
        arch="phi3", name="Phi-4-mini-instruct", pre="default", style="qwen", vocab=200064, partial=0.75, longrope=True
    ),
    # Gemma 2 / 3: norms stored +1, soft-capping (2), q/k norms, local layers' own base, linear scaling (3).
    "gemma2": dict(arch="gemma2", name="gemma-2-2b-it", pre="default", style="llama", vocab=256000, gemma=2),
    "gemma3": dict(
        arch="gemma3", name="gemma-3-4b-it", pre="default", style="llama", vocab=262144, gemma=3, qk_norm=True, layers=6
    ),
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


def family_tokenizer(family: str, *, vocab: int | None = None) -> dict[str, Any]:
    """The family's ``tokenizer.json`` content (testkit.real_tokenizer), specials renamed.

    Args:
        family: A key of :data:`FAMILIES`.
        vocab: Tokens; default: the family's real size.
    """
    from .real_tokenizer import tokenizer_json

    spec = FAMILIES[family]
    n_special = 26 if spec["style"] == "qwen" else 256
    tok = tokenizer_json(
        vocab or spec["vocab"], n_special=min(n_special, 26 if vocab else n_special), style=spec["style"]
    )
    if family == "mistral":
        for added, content in zip(tok["added_tokens"], MISTRAL_SPECIALS):
            added["content"] = content
    return tok


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _longrope_factors(n: int, seed: int) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(seed)
    long = np.sort(1 + 40 * rng.random(n)).astype(np.float32)
    short = np.sort(1 + 0.5 * rng.random(n)).astype(np.float32)
    return [float(v) for v in long], [float(v) for v in short]


def family_weights(
    family: str,
    *,
    hidden: int = 64,
    layers: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
) -> tuple[dict, dict]:
    """``(config, weights)``: an mlx-lm config and random float32 weights under Hugging Face names.

    Args:
        family: A key of :data:`FAMILIES`.
        hidden: Hidden size. Default: 64.
        layers: Layers; default: the family's test count (2; gemma3: 6, so one layer is global).
        intermediate: MLP size; default ``2 * hidden``.
        vocab: Embedding rows; default: the family's real vocabulary size.
        head_dim: Head size; default: the family's (Qwen3: 32), else ``hidden / 4``.
        seed: For the weights.
    """
    spec = FAMILIES[family]
    layers = layers or spec.get("layers", 2)
    heads, kv_heads, intermediate = 4, 2, intermediate or 2 * hidden
    head_dim = head_dim or spec.get("head_dim", hidden // heads)
    vocab = vocab or spec["vocab"]
    rng = np.random.default_rng(seed)
    gemma = spec.get("gemma")

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def gain(n: int) -> np.ndarray:
        # gemma multiplies by 1 + weight: its stored norms sit around 0, the others' around 1.
        return ((0 if gemma else 1) + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab, hidden) * 8, "model.norm.weight": gain(hidden)}
    if not spec.get("tied", True):
        w["lm_head.weight"] = mat(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = gain(hidden)
        w[p + "post_attention_layernorm.weight"] = gain(hidden)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = gain(hidden)
            w[p + "post_feedforward_layernorm.weight"] = gain(hidden)
        projections = {}
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            projections[proj] = mat(rows, hidden)
            if spec.get("bias"):
                w[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if spec["arch"] == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate(list(projections.values()))
        else:
            w.update({p + f"self_attn.{proj}_proj.weight": m for proj, m in projections.items()})
        w[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim)
        if spec.get("qk_norm"):
            w[p + "self_attn.q_norm.weight"] = gain(head_dim)
            w[p + "self_attn.k_norm.weight"] = gain(head_dim)
        if spec["arch"] == "phi3":
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([mat(intermediate, hidden), mat(intermediate, hidden)])
        else:
            w[p + "mlp.gate_proj.weight"] = mat(intermediate, hidden)
            w[p + "mlp.up_proj.weight"] = mat(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = mat(hidden, intermediate)
    config: dict[str, Any] = {
        "model_type": {"mistral": "llama", "phi3_partial": "phi3", "gemma3": "gemma3_text"}.get(family, spec["arch"]),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": spec.get("tied", True),
    }
    if spec.get("llama3_scaling"):
        config.update(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=dict(LLAMA3_SCALING))
    if spec.get("partial"):
        config["partial_rotary_factor"] = spec["partial"]
    if spec.get("longrope"):
        long, short = _longrope_factors(int(head_dim * spec.get("partial", 1)) // 2, seed)
        config.update(
            rope_theta=10000.0,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_scaling={"type": "longrope", "long_factor": long, "short_factor": short},
        )
    if gemma == 2:
        config.update(query_pre_attn_scalar=head_dim, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if gemma == 3:
        config.update(
            query_pre_attn_scalar=head_dim,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
    return config, w


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows of a llama model into the interleaved rotary layout."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


# Byte offsets of the float16 fields of one block, per ggml type (ggml-common.h):
# random bytes elsewhere are valid blocks; these must be sane numbers.
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ3_S": (0,),
    "IQ3_XXS": (0,),
    "IQ2_S": (0,),
    "IQ2_XS": (0,),
    "IQ2_XXS": (0,),
    "IQ1_S": (0,),
}
# Largest |value| of one block per unit of its f16 scale, roughly: sets scales so weights ~ 1/sqrt(cols).
_SPAN = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32, "Q2_K": 15 * 3, "Q3_K": 32 * 4}


def random_blocks(shape: tuple[int, int], type_name: str, seed: int = 0) -> np.ndarray:
    """Random valid blocks of ``type_name`` for a ``(rows, cols)`` weight: ``(rows, bytes per row)`` uint8.

    ``gguf`` cannot quantize K-quants, so their blocks are written directly: random
    bytes, with every float16 scale field set to a small positive number.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block_values == 0, f"{type_name} rows must be a multiple of {block_values}"
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    span = _SPAN.get(type_name, 16)
    for at in F16_FIELDS[type_name]:
        d = (rng.uniform(0.5, 1.5, len(raw)) * 3 / np.sqrt(cols) / span).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf's own float32 reading of :func:`random_blocks` (numpy ``(rows, cols)``)."""
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32)


def write_family_gguf(
    path: Path,
    family: str,
    config: dict,
    weights: dict,
    *,
    quantize: bool = False,
    dtype: str = "F16",
    blocks: dict[str, tuple[str, np.ndarray]] | None = None,
) -> Path:
    """Write a model of ``family`` with ``gguf.GGUFWriter``, as llama.cpp's converter would.

    Args:
        path: The ``.gguf`` file to write.
        family: A key of :data:`FAMILIES`.
        config: From :func:`family_weights`.
        weights: From :func:`family_weights` (Hugging Face names, float32).
        quantize: Store the 2-D weights as Q8_0 (same as ``dtype="Q8_0"``).
        dtype: ``F32``, ``F16`` or ``Q8_0`` for the 2-D weights; norms and biases stay F32.
        blocks: Hugging Face name -> ``(ggml type, raw blocks)`` stored as given
            (:func:`random_blocks`), instead of that weight.

    Returns:
        ``path``.
    """
    import gguf

    spec = FAMILIES[family]
    arch = spec["arch"]
    dtype = "Q8_0" if quantize else dtype
    blocks = blocks or {}
    tok = family_tokenizer(family, vocab=config["vocab_size"] if config["vocab_size"] != spec["vocab"] else None)
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    by_id.update({t["id"]: t["content"] for t in tok["added_tokens"]})
    tokens = [by_id[i] for i in range(len(by_id))]
    added = {t["id"] for t in tok["added_tokens"]}
    head_dim = config["head_dim"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(spec["name"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if arch != "phi3":  # llama.cpp's Phi-3 converter writes no key/value length
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}
    writer.add_file_type(file_type.get(dtype, gguf.LlamaFileType.MOSTLY_Q8_0))
    scaling = config.get("rope_scaling") or {}
    if "original_max_position_embeddings" in config:
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if spec.get("gemma") == 2:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(4096)
    if spec.get("gemma") == 3:
        writer.add_sliding_window(config["sliding_window"])
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

        writer.add_bos_token_id(tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else 0)
        writer.add_eos_token_id(tokens.index("<|im_end|>") if "<|im_end|>" in tokens else 0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config["num_hidden_layers"]
    )
    rope_dims = int(head_dim * config.get("partial_rotary_factor", 1.0))
    if scaling.get("rope_type") == "llama3":
        from mlx_notebook.loading.gguf_rotary import llama3_factors

        writer.add_tensor(
            "rope_freqs.weight", llama3_factors(rope_dims, config["rope_theta"], scaling).astype(np.float32)
        )
    if scaling.get("type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    for name, array in weights.items():
        stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert stored is not None, name
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            array = _llama_cpp_permute(array, heads)
        if spec.get("gemma") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's gemma converter: ggml multiplies by the stored weight
        if name in blocks:
            type_name, raw = blocks[name]
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(stored, raw, raw_shape=raw.shape, raw_dtype=qtype)
        elif array.ndim == 1 or dtype == "F32":
            writer.add_tensor(stored, array.astype(np.float32))
        elif dtype == "Q8_0":
            q = gguf.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(stored, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(stored, array.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
