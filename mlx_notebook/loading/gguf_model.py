"""What a checked GGUF header means to mlx-lm: config, tensor names, tokenizer.

The family knowledge comes from the libraries that keep it:

- the config from transformers' ``load_gguf_checkpoint(path, return_tensors=False)``
  (``GGUF_CONFIG_MAPPING`` per family), plus what mlx-lm needs and transformers
  leaves to its config classes (below, each with its reason);
- tensor names from ``gguf``'s ``TensorNameMap``: each parameter of the mlx-lm
  model, built lazily from that config, gets the GGUF name llama.cpp writes it as;
- the tokenizer from transformers' ``convert_gguf_tokenizer``;
- the rotary embedding from :mod:`.gguf_rotary` (what transformers' tables drop);
- what llama.cpp's converter rewrites, undone here: q/k rows permuted for the
  llama architecture (read as stored, with ``rope_traditional``), gemma's norms
  stored +1 (the plan's ``shifts``), gemma3 as the text model mlx-lm calls
  ``gemma3_text``.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..errors import ModelFormatError
from .gguf_header import FIX_DOWNLOAD, FIX_OTHER, FIX_TYPE, QUANT_BITS, GGUFInfo
from .gguf_rotary import ROPE_TENSORS, rotary_config

__all__ = ["ModelPlan", "plan_model"]

# llama.cpp splits digits one by one before GPT-2's regex for these; transformers
# has no entry for them (it would keep "12" whole), the rest it knows.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
# llama.cpp takes a pre-token that is itself in the vocabulary whole for these
# (Llama 3's ignore_merges); transformers' GGUF tokenizer merges it piece by piece.
_IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")
# Pre-tokenizers that are GPT-2's own regex, which transformers' GPT-2 tokenizer applies.
_GPT2_PRE = (None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_GUARD = threading.Lock()
_MAX_INT32 = 2**31 - 1
# The mlx-lm model_type for a GGUF architecture whose name differs from it.
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# mlx-lm models that always build lm_head and tie it when the weights lack it.
_TIED_WHEN_ABSENT = ("gemma3_text",)
# Gemma 27B's attention scale is 1/sqrt(hidden / heads), the others' 1/sqrt(head_dim);
# llama.cpp tells them apart by layer count (llama-model.cpp, LLM_TYPE_27B).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class ModelPlan:
    """How to turn a checked GGUF file into an mlx-lm folder.

    Attributes:
        config: The ``config.json`` mlx-lm reads (``quantization`` included).
        names: GGUF tensor name -> mlx-lm parameter name, for every tensor in the file.
        tokenizer: A ``tokenizers.Tokenizer`` for ``tokenizer.json``.
        tokenizer_config: The ``tokenizer_config.json``.
        shifts: GGUF tensor name -> a constant to add while converting (gemma's
            norms, which llama.cpp stores +1). Default: none.
    """

    config: dict[str, Any]
    names: dict[str, str]
    tokenizer: Any
    tokenizer_config: dict[str, Any]
    shifts: dict[str, float] = field(default_factory=dict)


def plan_model(info: GGUFInfo) -> ModelPlan:
    """Check that mlx-lm can run the file, and say how.

    Args:
        info: A header :func:`~.gguf_header.read_header` accepted.

    Returns:
        The plan :func:`~.gguf.convert_gguf` follows.

    Raises:
        ModelFormatError: The family, tensors or tokenizer are not something
            mlx-lm runs, or contradict each other (one line, with the fix).
    """
    label = info.path.name
    parsed, tensor_processor = _transformers_metadata(info)
    config = _mlx_config(info, parsed["config"], tensor_processor)
    names = _tensor_names(info, config)
    quantization = _quantization(info, names)
    if quantization is not None:
        config["quantization"] = quantization
    tokenizer_dict = parsed["tokenizer"]
    tokens = tokenizer_dict.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelFormatError(
            f"{label}: missing or invalid tokenizer vocabulary (incomplete GGUF file); {FIX_DOWNLOAD}"
        )
    if len(tokens) > config["vocab_size"]:
        raise ModelFormatError(
            f"{label}: tokenizer has {len(tokens)} tokens but the embedding only {config['vocab_size']} rows "
            f"(corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    tokenizer = _tokenizer(info, tokenizer_dict)
    shifts = {}
    if info.architecture in _GEMMA_27B_LAYERS:
        # llama.cpp adds 1 to every gemma norm (ggml multiplies by the weight, gemma by 1 + weight).
        shifts = {name: -1.0 for name in names if name.endswith("norm.weight")}
    return ModelPlan(config, names, tokenizer, _tokenizer_config(info, parsed["tokenizer_config"]), shifts)


# ------------------------------------------------------------------- config


def _transformers_metadata(info: GGUFInfo) -> tuple[dict[str, Any], Any]:
    """transformers' reading of the file: config, tokenizer and tokenizer_config dicts."""
    from transformers import modeling_gguf_pytorch_utils as hf

    label = info.path.name
    processor = hf.TENSOR_PROCESSORS.get(info.architecture)
    if info.architecture not in hf.GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{label}: unsupported GGUF architecture '{info.architecture}' (transformers maps "
            f"{', '.join(sorted(hf.GGUF_SUPPORTED_ARCHITECTURES))}); {FIX_OTHER}"
        )
    if processor not in (None, hf.LlamaTensorProcessor, hf.Gemma2TensorProcessor):
        # Fused or per-expert tensors: transformers rewrites these tensors while
        # it loads them (gemma's norm offset is undone by the plan's shifts).
        raise ModelFormatError(
            f"{label}: GGUF architecture '{info.architecture}' stores tensors that need rewriting "
            f"before mlx-lm can run them; {FIX_OTHER}"
        )
    # transformers refuses this call without torch, though return_tensors=False
    # reads metadata only; mlx-notebook has no torch, so lift the guard for it.
    # It would also parse the whole file again (~10 s for a real tokenizer):
    # hand it the reader read_header already parsed, for this file only.
    import gguf

    with _GUARD:
        guard, make_reader = hf.is_torch_available, gguf.GGUFReader
        hf.is_torch_available = lambda: True
        if info.reader is not None:
            setattr(gguf, "GGUFReader", _parsed_for(info, make_reader))  # noqa: B010 (mypy: a class slot)
        try:
            parsed = hf.load_gguf_checkpoint(str(info.path), return_tensors=False)
        except Exception as exc:  # any failure of a parser on input is a format error
            detail = " ".join(str(exc).split())[:200]
            raise ModelFormatError(f"{label}: transformers cannot read its metadata ({detail}); {FIX_OTHER}") from None
        finally:
            hf.is_torch_available = guard
            setattr(gguf, "GGUFReader", make_reader)  # noqa: B010
    return parsed, processor


def _parsed_for(info: GGUFInfo, make_reader: Any) -> Any:
    """A stand-in for ``gguf.GGUFReader`` that hands back ``info``'s reader for ``info``'s file."""

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path) == info.path and not args and not kwargs:
            return info.reader
        return make_reader(path, *args, **kwargs)

    return reader


def _meta_int(info: GGUFInfo, key: str, default: int | None = None) -> int:
    value = info.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        state = "missing" if key not in info.metadata else f"invalid ({repr(value)[:40]})"
        raise ModelFormatError(f"{info.path.name}: {state} metadata {key} (incomplete GGUF file); {FIX_DOWNLOAD}")
    return value


def _mlx_config(info: GGUFInfo, hf_config: dict[str, Any], tensor_processor: Any) -> dict[str, Any]:
    """transformers' config plus what mlx-lm needs that its config classes would default."""
    from transformers import modeling_gguf_pytorch_utils as hf

    label, arch, meta = info.path.name, info.architecture, info.metadata
    config = {k: v for k, v in hf_config.items() if not k.startswith("_")}
    config["model_type"] = _MODEL_TYPES.get(str(config.get("model_type")), config.get("model_type"))
    if _meta_int(info, f"{arch}.expert_count", default=0) > 0:
        raise ModelFormatError(f"{label}: mixture-of-experts GGUF files are not supported; {FIX_OTHER}")
    for key, value in config.items():
        if isinstance(value, float):  # GGUF stores float32: write 1e-05, not 9.999999747378752e-06
            config[key] = float(str(np.float32(value)))
        elif isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= _MAX_INT32:
            # MLX shapes are int32: building the model would overflow.
            raise ModelFormatError(f"{label}: invalid metadata ({key} = {value}; corrupt GGUF file); {FIX_DOWNLOAD}")
    embed = info.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelFormatError(f"{label}: missing tensor 'token_embd.weight' (incomplete GGUF file); {FIX_DOWNLOAD}")
    config["vocab_size"] = embed.shape[0]  # the rows the model has, padding included
    # Qwen3's head size is not hidden / heads; transformers' table leaves it to Qwen3Config's default.
    if f"{arch}.attention.key_length" in meta:
        config["head_dim"] = _meta_int(info, f"{arch}.attention.key_length")
    # llama.cpp permutes q/k rows into the interleaved rotary layout for the families
    # whose tensors transformers un-permutes (LlamaTensorProcessor); mlx-lm reads them as stored.
    config["rope_traditional"] = tensor_processor is hf.LlamaTensorProcessor
    config["attention_bias"] = "blk.0.attn_q.bias" in info.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in info.tensors
    if config.setdefault("max_position_embeddings", 2048) < 1:  # else every prompt is "too long"
        raise ModelFormatError(
            f"{label}: invalid metadata {arch}.context_length = {config['max_position_embeddings']} "
            f"(corrupt GGUF file); {FIX_DOWNLOAD}"
        )
    if arch in _GEMMA_27B_LAYERS:
        config.update(_gemma_config(info, config))
    config.update(rotary_config(info, config, _model_args_fields(info, str(config.get("model_type")))))
    bos_id, eos_ids = _special_id(info, "bos"), _eos_token_ids(info)
    for key in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        config.pop(key, None)
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    if eos_ids:
        # mlx-lm stops on every id listed here, not only on the tokenizer's eos_token.
        config["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    return config


def _gemma_config(info: GGUFInfo, config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp computes for gemma from the header and mlx-lm's gemma models need spelled out."""
    arch = info.architecture
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    big = config.get("num_hidden_layers") == _GEMMA_27B_LAYERS[arch]
    out: dict[str, Any] = {
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else head_dim,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = info.metadata.get(f"{arch}.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(str(np.float32(value)))
    if arch == "gemma3":
        out["sliding_window_pattern"] = 6  # llama.cpp's fixed pattern: every 6th layer global
    return out


def _model_args_fields(info: GGUFInfo, model_type: str) -> set[str]:
    """The fields of the mlx-lm model's ``ModelArgs`` (what its config may say)."""
    import dataclasses

    from mlx_lm.utils import MODEL_REMAPPING

    try:
        module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    except ImportError:
        raise ModelFormatError(
            f"{info.path.name}: mlx-lm has no '{model_type}' model for this GGUF file; {FIX_OTHER}"
        ) from None
    return {f.name for f in dataclasses.fields(module.ModelArgs)}


def _special_id(info: GGUFInfo, key: str) -> int | None:
    """``tokenizer.ggml.<key>_token_id`` if it names a token (llama.cpp ignores other ids)."""
    value = info.metadata.get(f"tokenizer.ggml.{key}_token_id")
    tokens = info.metadata.get("tokenizer.ggml.tokens") or []
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
        return None
    return value


def _eos_token_ids(info: GGUFInfo) -> list[int]:
    """Every id llama.cpp ends a turn on that the file names (EOS, end-of-turn, end-of-message)."""
    ids = [_special_id(info, key) for key in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


# ------------------------------------------------------------------ tensors


def _model_parameters(info: GGUFInfo, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The mlx-lm model's parameter names and shapes, from a lazily built model."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = str(config.get("model_type"))
    try:
        module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
        model = module.Model(module.ModelArgs.from_dict(config))
    except ImportError:
        raise ModelFormatError(
            f"{info.path.name}: mlx-lm has no '{model_type}' model for this GGUF file; {FIX_OTHER}"
        ) from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        detail = " ".join(str(exc).split())[:160]
        raise ModelFormatError(
            f"{info.path.name}: its metadata does not describe a '{model_type}' model mlx-lm can build "
            f"({detail}); {FIX_DOWNLOAD}"
        ) from None
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return {name: tuple(array.shape) for name, array in flat}


def _tensor_names(info: GGUFInfo, config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name, checking names, shapes and types."""
    import gguf

    label = info.path.name
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(info.architecture)
    parameters = _model_parameters(info, config)
    if arch is None:
        raise ModelFormatError(f"{label}: gguf has no tensor names for '{info.architecture}'; {FIX_OTHER}")
    name_map = gguf.get_tensor_name_map(arch, _meta_int(info, f"{info.architecture}.block_count"))
    names, shapes = {}, {}
    for parameter, shape in parameters.items():
        module, _, suffix = parameter.rpartition(".")
        stored = name_map.get_name(module)
        if stored is None:
            raise ModelFormatError(
                f"{label}: mlx-lm's parameter '{parameter}' has no GGUF tensor name in gguf's map; {FIX_OTHER}"
            )
        names[f"{stored}.{suffix}"] = parameter
        shapes[f"{stored}.{suffix}"] = shape
    for name, tensor in info.tensors.items():
        if name in ROPE_TENSORS:
            continue  # rotary settings (.gguf_rotary), not parameters
        if name not in names:
            raise ModelFormatError(
                f"{label}: tensor '{name}' has no place in a {config['model_type']} model for mlx-lm "
                f"(unsupported variant); {FIX_OTHER}"
            )
        if tensor.shape != shapes[name]:
            raise ModelFormatError(
                f"{label}: tensor '{name}' has shape {list(tensor.shape)} but the metadata "
                f"implies {list(shapes[name])} (corrupt GGUF file); {FIX_DOWNLOAD}"
            )
        if tensor.type_name in QUANT_BITS and (len(tensor.shape) != 2 or not name.endswith(".weight")):
            raise ModelFormatError(f"{label}: tensor '{name}' is quantized but mlx-lm needs it unquantized; {FIX_TYPE}")
    if config["model_type"] in _TIED_WHEN_ABSENT and "output.weight" not in info.tensors:
        del names["output.weight"]  # the model's sanitize ties it to the embedding
    missing = [name for name in names if name not in info.tensors]
    if missing:
        raise ModelFormatError(f"{label}: missing tensor '{missing[0]}' (incomplete GGUF file); {FIX_DOWNLOAD}")
    return names


def _quantization(info: GGUFInfo, names: dict[str, str]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` config: a default plus every module that differs from it."""
    bits_by_module: dict[str, int | None] = {}
    for name, tensor in info.tensors.items():
        if name in names and name.endswith(".weight") and len(tensor.shape) == 2:  # norms, biases: never quantized
            bits_by_module[names[name].removesuffix(".weight")] = QUANT_BITS.get(tensor.type_name)
    counts: dict[int, int] = {}
    for bits in bits_by_module.values():
        if bits is not None:
            counts[bits] = counts.get(bits, 0) + 1
    if not counts:
        return None
    default_bits = max(counts, key=lambda bits: (counts[bits], bits == 4))
    config: dict[str, Any] = {"group_size": 32, "bits": default_bits}
    for module, bits in sorted(bits_by_module.items()):
        if bits is None:
            config[module] = False  # stored unquantized (F16/F32) among quantized modules
        elif bits != default_bits:
            config[module] = {"group_size": 32, "bits": bits}
    return config


# ---------------------------------------------------------------- tokenizer


def _tokenizer(info: GGUFInfo, tokenizer_dict: dict[str, Any]) -> Any:
    """transformers' tokenizer for the file, with llama.cpp's digit split where transformers lacks it."""
    from tokenizers import pre_tokenizers, processors
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    label = info.path.name
    pre = tokenizer_dict.get("pre_tokenizer_type")
    byte_level = tokenizer_dict.get("tokenizer_type") == "gpt2"
    if byte_level and pre not in GGUF_PRE_TOKENIZER_SPLITS and pre not in _GPT2_PRE + _DIGIT_SPLIT_PRE:
        # Another split would give other tokens than the model was trained on.
        raise ModelFormatError(f"{label}: pre-tokenizer {pre!r} is not supported; {FIX_OTHER}")
    merges = tokenizer_dict.get("merges")
    if byte_level and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise ModelFormatError(f"{label}: missing or invalid tokenizer merges (incomplete GGUF file); {FIX_DOWNLOAD}")
    try:
        tokenizer, _ = convert_gguf_tokenizer(info.architecture, tokenizer_dict)
    except Exception as exc:  # any failure on this input is a format error
        detail = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise ModelFormatError(f"{label}: cannot build its tokenizer ({detail}); {FIX_OTHER}") from None
    if byte_level and pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if byte_level and pre in _IGNORE_MERGES_PRE:
        tokenizer.model.ignore_merges = True
    bos_id, eos_id = _special_id(info, "bos"), _special_id(info, "eos")
    add_eos = bool(info.metadata.get("tokenizer.ggml.add_eos_token", False))
    bos = [bos_id] if bos_id is not None and _add_bos(info) else []
    eos = [eos_id] if eos_id is not None and add_eos else []
    if bos or eos:
        # llama.cpp adds BOS/EOS around every prompt when the file says so.
        tokens = tokenizer_dict["tokens"]
        bos_t, eos_t = [tokens[i] for i in bos], [tokens[i] for i in eos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*bos_t, "$A", *eos_t],
            pair=[*bos_t, "$A", *eos_t, *bos_t, "$B:1", *eos_t],
            special_tokens=list(dict.fromkeys((tokens[i], i) for i in bos + eos)),
        )
    return tokenizer


def _add_bos(info: GGUFInfo) -> bool:
    # Older sentencepiece files have no flag, and llama.cpp adds BOS to those.
    default = info.metadata.get("tokenizer.ggml.model") == "llama"
    return bool(info.metadata.get("tokenizer.ggml.add_bos_token", default))


def _tokenizer_config(info: GGUFInfo, hf_tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    tokens = info.metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = _special_id(info, key)
        return tokens[index] if index is not None else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": _add_bos(info),
        "add_eos_token": bool(info.metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": info.metadata.get(f"{info.architecture}.context_length", 2048),
    }
    if isinstance(hf_tokenizer_config.get("chat_template"), str):
        config["chat_template"] = hf_tokenizer_config["chat_template"]
    return {k: v for k, v in config.items() if v is not None}
