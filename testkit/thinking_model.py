"""Random-weight reasoning models for tests: think tags as special tokens, chat templates like the real ones.

Two templates with the semantics of real reasoning models (shortened, ChatML):

* ``"qwen3"``: the model opens ``<think>`` itself; ``enable_thinking=False``
  appends an empty block (``<think>\\n\\n</think>\\n\\n``) to the generation
  prompt, as Qwen3's does; assistant messages with ``reasoning_content`` are
  rendered with their block.
* ``"r1"``: the generation prompt opens the block (``<think>\\n``), as
  DeepSeek-R1's distills do; history is rendered without reasoning.

Random weights do not think (nor stop thinking) by themselves: tests steer
them with ``thinking_budget`` and ``logit_bias``.

Example::

    folder = make_thinking_model(tmp / "r1", template="r1")
    gen = generate("Hi", model=str(folder), thinking_budget=5, max_tokens=12)
"""

from __future__ import annotations

from pathlib import Path

from .tiny_model import make_tiny_model

THINK_START, THINK_END = "<think>", "</think>"

TEMPLATES = {
    "qwen3": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and m.reasoning_content is defined and m.reasoning_content %}"
        "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    ),
    "r1": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    ),
}


def make_thinking_model(folder: Path, *, template: str = "r1", seed: int = 0, **size: int) -> Path:
    """Write a random-weight llama whose tokenizer has ``<think>``/``</think>`` and the ``template`` chat template.

    ``size``: ``layers``, ``hidden``, ``heads``... as for :func:`~testkit.tiny_model.make_tiny_model`.
    """
    return make_tiny_model(
        folder, seed=seed, special_tokens=(THINK_START, THINK_END), chat_template=TEMPLATES[template], **size
    )


def think_ids(folder: Path) -> tuple[int, int]:
    """The token ids of ``<think>`` and ``</think>`` in the model at ``folder``."""
    import json

    added = json.loads((Path(folder) / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    return ids[THINK_START], ids[THINK_END]
