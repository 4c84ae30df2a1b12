"""Real-size byte-level BPE tokenizers (and random-weight models using them) for tests.

Training a 152k-token BPE on a 2-core CPU takes long and needs a large corpus,
so :func:`make_real_tokenizer` writes a synthetic but valid one directly as
JSON: the 256-symbol byte-level alphabet, then ``vocab - 256 - n_special``
merges, each joining two tokens that already exist (so ``vocab``, ``merges``
and ``added_tokens`` have the sizes, string lengths and structure of Qwen3's or
Llama 3's ``tokenizer.json``), the real pre-tokenizer regex, a ByteLevel
decoder, and the special tokens ``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>`` (plus reserved ones up to ``n_special``). ``tokenizers`` and
transformers load it like a real one; encoding and decoding any text round-trip.

Example::

    folder = make_real_model(tmp / "qwen3-real", arch="qwen3")   # hidden 256, 4 layers
    model, tokenizer = mlx_lm.load(str(folder))                 # 151,936 tokens
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .tiny_model import CHAT_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Pre-tokenizer regexes of the real models (Qwen2/Qwen3, Llama 3).
_QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Presets: total tokens (the config's vocab_size), special tokens, tokenizer class.
PRESETS = {
    "qwen3": dict(vocab=151936, n_special=26, style="qwen"),
    "llama": dict(vocab=128256, n_special=256, style="llama"),
}

_FORMAT_VERSION = 2  # bump when the generated content changes (invalidates caches)


def _byte_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _synthetic_merges(n_merges: int, seed: int) -> tuple[dict[str, int], list[list[str]]]:
    """A valid BPE vocabulary and merge list of ``256 + n_merges`` tokens.

    The first merges build common English words (with and without the ``Ġ``
    space marker) so that ordinary text encodes into multi-character tokens;
    the rest join random pairs of earlier tokens, favouring short and early
    ones, up to 16 characters (real vocabularies average ~6-7).
    """
    rng = random.Random(seed)
    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {c: i for i, c in enumerate(alphabet)}
    tokens: list[str] = list(alphabet)
    merges: list[list[str]] = []

    def add(a: str, b: str) -> bool:
        new = a + b
        if new in vocab or len(merges) >= n_merges:
            return False
        vocab[new] = len(tokens)
        tokens.append(new)
        merges.append([a, b])
        return True

    words = (
        "the of and to in is that for it with as was on be by this are from at or an "
        "have not but which they you one all were can there their has more will if "
        "would about what when so no out up into some time them other than then only "
        "model token text quick brown fox jumps over lazy dog river flow sea mountain "
        "rise above cloud once upon small generated return def class import self print"
    ).split()
    # Words are built left to right: every prefix is a token, as in real BPE.
    # Space-prefixed forms first: "Ġthe" must not be split as "Ġ" + "the".
    forms = [("Ġ" + w, "Ġ" + w.capitalize()) for w in words]
    forms += [(w, w.capitalize()) for w in words]
    for form in (f for pair in forms for f in pair):
        cur = form[0]
        for ch in form[1:]:
            add(cur, ch)
            cur = cur + ch
    letters = [c for c in alphabet if c.isalpha() and c.isascii()]
    ascii_heavy = letters * 6 + alphabet  # English-like frequency bias
    while len(merges) < n_merges:
        r = rng.random()
        n = len(tokens)
        if r < 0.45:
            a = rng.choice(ascii_heavy)
            b = tokens[min(n - 1, int(rng.expovariate(1 / 3000)))]
        elif r < 0.55:
            a = "Ġ"
            b = tokens[min(n - 1, int(rng.expovariate(1 / 8000)))]
        else:
            a = tokens[min(n - 1, int(rng.expovariate(1 / 6000)))]
            b = tokens[min(n - 1, int(rng.expovariate(1 / 6000)))]
        if len(a) + len(b) <= 16:
            add(a, b)
    return vocab, merges


def tokenizer_json(vocab: int = 151936, *, n_special: int = 26, style: str = "qwen", seed: int = 0) -> dict:
    """The content of a real-size ``tokenizer.json`` (see the module docstring)."""
    if n_special < len(SPECIAL_TOKENS):
        raise ValueError(f"n_special must be >= {len(SPECIAL_TOKENS)}")
    n_merges = vocab - 256 - n_special
    if n_merges < 0:
        raise ValueError("vocab too small")
    bpe_vocab, merges = _synthetic_merges(n_merges, seed)
    if style == "qwen":
        regex = _QWEN_REGEX
        extra = [f"<|reserved_special_token_{i}|>" for i in range(n_special - 3)]
        specials = SPECIAL_TOKENS + extra
    elif style == "llama":
        regex = _LLAMA_REGEX
        extra = [f"<|reserved_special_token_{i}|>" for i in range(n_special - 3)]
        specials = SPECIAL_TOKENS + extra
    else:
        raise ValueError(f"unknown style {style!r}")
    first = len(bpe_vocab)
    added = [
        {
            "id": first + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(specials)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if style == "qwen" else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": style == "llama",
            "vocab": bpe_vocab,
            "merges": merges,
        },
    }


def tokenizer_config_json(tok: dict, *, style: str = "qwen") -> dict:
    """The ``tokenizer_config.json`` that goes with :func:`tokenizer_json`'s output."""
    return {
        "tokenizer_class": "Qwen2Tokenizer" if style == "qwen" else "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in tok["added_tokens"]
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 131072,
    }


def make_real_tokenizer(
    folder: Path, *, vocab: int = 151936, n_special: int | None = None, style: str = "qwen", seed: int = 0
) -> Path:
    """Write a real-size ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder``.

    Args:
        folder: Created if missing. Skipped (cached) if it already holds a
            tokenizer made with the same arguments.
        vocab: Total tokens, special ones included (Qwen3 151,936; Llama 3 128,256).
        n_special: Added special tokens at the end of the vocabulary
            (default 26 for ``style="qwen"``, 256 for ``"llama"``).
        style: ``"qwen"`` (Qwen2Tokenizer class, Qwen regex, NFC) or
            ``"llama"`` (PreTrainedTokenizerFast, Llama 3 regex, ignore_merges).

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    if n_special is None:
        n_special = 26 if style == "qwen" else 256
    stamp = {"version": _FORMAT_VERSION, "vocab": vocab, "n_special": n_special, "style": style, "seed": seed}
    stamp_file = folder / ".real_tokenizer.json"
    if stamp_file.exists() and (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return folder
        except ValueError:
            pass
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_json(vocab, n_special=n_special, style=style, seed=seed)
    tmp = folder / "tokenizer.json.tmp"
    tmp.write_text(json.dumps(tok, ensure_ascii=False, indent=1), encoding="utf-8")
    tmp.replace(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json(tok, style=style), indent=1))
    stamp_file.write_text(json.dumps(stamp))
    return folder


def make_real_model(
    folder: Path,
    *,
    arch: str = "qwen3",
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    tie_embeddings: bool = True,
    dtype: str = "float32",
    seed: int = 0,
    shard_bytes: int = 2 << 30,
) -> Path:
    """Write a random-weight mlx-lm model of ``arch`` with a real-size tokenizer.

    ``arch`` is ``"qwen3"`` (151,936 tokens) or ``"llama"`` (Llama 3: 128,256).
    Small shapes by default (CPU); 8B shapes for a GPU benchmark, e.g. Qwen3-8B:
    ``hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
    intermediate=12288, tie_embeddings=False, dtype="bfloat16"``. Weights are
    saved in safetensors shards of at most ``shard_bytes`` (with an index when
    more than one). Skipped if ``folder`` already holds the same model.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if arch not in PRESETS:
        raise ValueError(f"arch must be one of {sorted(PRESETS)}")
    preset = PRESETS[arch]
    vocab = vocab or preset["vocab"]
    folder = Path(folder)
    make_real_tokenizer(folder, vocab=vocab, n_special=preset["n_special"], style=preset["style"], seed=seed)
    head_dim = head_dim or hidden // heads
    intermediate = intermediate or 3 * hidden
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    im_end = next(int(i) for i, t in tok_cfg["added_tokens_decoder"].items() if t["content"] == "<|im_end|>")
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 1000000.0 if arch == "qwen3" else 500000.0,
        "tie_word_embeddings": tie_embeddings,
        "max_position_embeddings": 40960,
        "eos_token_id": im_end,
        "torch_dtype": dtype,
    }
    cfg_file = folder / "config.json"
    weights_done = folder / ".weights_done"
    if cfg_file.exists() and weights_done.exists():
        if json.loads(cfg_file.read_text()) == config and weights_done.read_text() == str(seed):
            return folder
    weights_done.unlink(missing_ok=True)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    if arch == "qwen3":
        from mlx_lm.models import qwen3 as module
    else:
        from mlx_lm.models import llama as module
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = tree_flatten(model.parameters())  # lazy: evaluated shard by shard on save
    del model
    target = getattr(mx, dtype)
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name, value in params:
        nbytes = value.size * target.size
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    params = None
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    total = 0
    for fname, shard in zip(names, shards):
        arrays = {k: v.astype(target) for k, v in shard.items()}
        mx.save_safetensors(str(folder / fname), arrays, metadata={"format": "mlx"})
        for k, v in arrays.items():
            weight_map[k] = fname
            total += v.nbytes
        shard.clear()
        del arrays
    if len(names) > 1:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    cfg_file.write_text(json.dumps(config, indent=1))
    weights_done.write_text(str(seed))
    return folder
