"""A generation cut short ends on whole characters: its text is a prefix of the uninterrupted text.

A byte-level tokenizer spells a character of several UTF-8 bytes with several
tokens. A stop can land between them: the detokenizer's last flush writes the
incomplete bytes as U+FFFD, which the next token would have replaced with the
character. The tiny random model emits such bytes, so a few of its prefixes end
inside a character (CI's fault campaign caught one: a Pause+Stop after 183
tokens). The tokens keep every token; the text leaves the incomplete character
out. A generation that runs to its ``max_tokens`` ends as mlx-lm's does.
"""

from __future__ import annotations

import mlx_notebook
from mlx_notebook.generation.handle import Generation, GenerationEvent
from testkit.fault_rounds import TINY_PROMPT
from testkit.waiting import held

MAX = 300


def _flushed(tokenizer, tokens: list[int]) -> str:
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def _reference(worker, model: str) -> tuple[Generation, list[int]]:
    """The uninterrupted generation, and the lengths at which its flushed text is not a prefix of its text."""
    full = mlx_notebook.generate(TINY_PROMPT, model=model, worker=worker, max_tokens=MAX)
    full.result(timeout=120)
    cuts = [
        n for n in range(1, len(full.tokens)) if not full.text.startswith(_flushed(full.tokenizer, full.tokens[:n]))
    ]
    assert cuts, "the tiny model's reference never ends inside a character: pick another prompt"
    return full, cuts


def _stop_after(worker, model: str, n: int) -> Generation:
    """A generation the worker stops right after its ``n``-th token (the listener runs on the worker).

    Called while the worker is :func:`held`, so the listener is on before the first token.
    """

    def stop_at(event: GenerationEvent) -> None:
        if event.kind == "tokens" and len(gen.tokens) >= n:
            gen.cancel()

    gen = mlx_notebook.generate(TINY_PROMPT, model=model, worker=worker, max_tokens=MAX)
    gen.add_listener(stop_at)
    return gen


def test_a_stop_inside_a_character_keeps_the_text_a_prefix(worker, tiny_model: str) -> None:
    full, cuts = _reference(worker, tiny_model)
    for n in cuts:
        with held(worker):
            gen = _stop_after(worker, tiny_model, n)
        assert gen.wait(120)
        assert gen.state == "stopped" and gen.tokens == full.tokens[:n], (n, len(gen.tokens))
        assert full.text.startswith(gen.text), (n, gen.text[-8:], full.text[len(gen.text) - 4 : len(gen.text) + 4])
        # Only the incomplete character is left out: the text is the flush without its U+FFFD tail.
        assert gen.text == _flushed(full.tokenizer, gen.tokens).rstrip("\ufffd")


def test_a_stop_of_one_row_among_others_keeps_its_text_a_prefix(worker, tiny_model: str) -> None:
    full, cuts = _reference(worker, tiny_model)
    with held(worker):  # submitted together, they start decoding together
        other = mlx_notebook.generate(TINY_PROMPT, model=tiny_model, worker=worker, max_tokens=MAX)
        gen = _stop_after(worker, tiny_model, cuts[0])
    assert gen.wait(120) and other.wait(120)
    assert gen.state == "stopped" and gen.tokens == full.tokens[: cuts[0]]
    assert gen.stats.batch_size == 2, "the two did not decode together"
    assert full.text.startswith(gen.text)
    assert other.state == "done" and other.text == full.text


def test_a_generation_that_reaches_max_tokens_inside_a_character_ends_as_mlx_lm(worker, tiny_model: str) -> None:
    """The user asked for that many tokens: their text is the tokens' decoding, U+FFFD and all."""
    full, cuts = _reference(worker, tiny_model)
    gen = mlx_notebook.generate(TINY_PROMPT, model=tiny_model, worker=worker, max_tokens=cuts[0])
    gen.result(timeout=120)
    assert gen.stats.finish_reason == "length"
    assert gen.text == _flushed(full.tokenizer, full.tokens[: cuts[0]])
    assert gen.text.endswith("\ufffd")
