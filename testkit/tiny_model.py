"""Build a small random-weight mlx-lm llama model folder for tests.

Real parts, small size: a real mlx-lm ``llama`` model with random weights and a
real byte-level BPE tokenizer trained in-process, saved the way mlx-lm saves
models, so the whole load path (config, safetensors, tokenizer) is exercised.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Rivers flow to the sea; mountains rise above the clouds.",
    "def f(x): return {'a': x, 'b': [1, 2, 3]}",
    "Once upon a time there was a small model that generated text.",
] * 20


def make_tiny_model(
    folder: Path,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 384,
    seed: int = 0,
    dtype: str = "float32",
    special_tokens: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write a random-weight llama model and tokenizer into ``folder``.

    ``special_tokens`` are added to the tokenizer's own (e.g. ``<think>``,
    ``</think>``); ``chat_template`` replaces the ChatML one.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    real_vocab = tok.get_vocab_size()
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": chat_template,
                "model_max_length": 4096,
            }
        )
    )
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": real_vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    }
    (folder / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger weights than the default init make the random model's greedy
    # choices depend on the whole context, so a wrong KV cache shows.
    weights = {
        k: (v * 4).astype(getattr(mx, dtype)) if v.ndim == 2 else v.astype(getattr(mx, dtype))
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder
