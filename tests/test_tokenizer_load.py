"""The tokenizer loader (child process) gives what mlx-lm's own loader gives.

Same ids, text, chat-template output and streamed text as
``mlx_lm.utils.load_tokenizer`` on a tiny trained BPE and on a real-size
(Qwen3, 151,936 tokens) one; a ``wait`` that raises stops the load and takes
the child process with it. Speed and GIL holds are measured in
``benchmarks/gil_probe.py``, not here.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mlx_notebook.control import Cancelled
from mlx_notebook.loading.tokenizer import load_tokenizer
from testkit.real_tokenizer import make_real_tokenizer
from testkit.tiny_model import make_tiny_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Unicode: héllo wörld, 世界, emoji 🎉🚀, combining é",
    "Specials inline <|im_start|>user\nhi<|im_end|> and <|endoftext|>",
    "def f(x):\n    return {'a': x, 'b': [1, 2, 3]}  # 12345 67",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name three rivers. 世界"},
]


def _never() -> None:
    pass


def _pair(folder: Path, eos=None):
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    return load_tokenizer(folder, eos, wait=_never), mlx_load_tokenizer(folder, eos_token_ids=eos)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tok-tiny") / "model")
    ours, ref = _pair(folder)
    yield ours, ref
    ours.close()


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    folder = make_real_tokenizer(tmp_path_factory.mktemp("tok-real") / "qwen3")
    ours, ref = _pair(folder, eos=[151643])
    yield ours, ref
    ours.close()


def _stream(tok, ids):
    detok = tok.detokenizer
    segments = []
    for i in ids:
        detok.add_token(i)
        segments.append(detok.last_segment)
    detok.finalize()
    segments.append(detok.last_segment)
    text = detok.text
    detok.reset()
    return segments, text, detok.text


@pytest.mark.parametrize("which", ["tiny_pair", "real_pair"])
def test_same_as_mlx_lm(which, request):
    ours, ref = request.getfixturevalue(which)
    assert type(ours._detokenizer) is type(ref._detokenizer)
    assert ours.eos_token_ids == ref.eos_token_ids
    assert ours.vocab_size == ref.vocab_size
    assert len(ours) == len(ref)
    assert ours.has_chat_template == ref.has_chat_template
    assert ours.has_thinking == ref.has_thinking
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert _stream(ours, ids) == _stream(ref, ids)
    for gen in (True, False):
        kw = dict(add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, tokenize=False, **kw) == ref.apply_chat_template(
            MESSAGES, tokenize=False, **kw
        )
        assert ours.apply_chat_template(MESSAGES, **kw) == ref.apply_chat_template(MESSAGES, **kw)
    # Every token streams to the text the tokenizer decodes.
    ids = list(range(0, len(ref), max(1, len(ref) // 500)))
    assert _stream(ours, ids) == _stream(ref, ids)


def test_detokenizer_copies_are_independent(real_pair):
    ours, _ = real_pair
    a, b = ours.detokenizer, ours.detokenizer
    a.add_token(ours.encode("Hello")[0])
    assert b.tokens == [] and a.tokens != []


def test_cancel_propagates_and_ends_child(tmp_path_factory):
    folder = make_real_tokenizer(tmp_path_factory.mktemp("tok-cancel") / "qwen3")
    calls = []

    def wait():
        calls.append(time.perf_counter())
        if len(calls) > 20:
            raise Cancelled()

    import mlx_notebook.loading.tokenizer as mod

    started = []
    real_child = mod._Child

    class Spy(real_child):
        def __init__(self):
            super().__init__()
            started.append(self.proc)

    mod._Child = Spy
    try:
        with pytest.raises(Cancelled):
            load_tokenizer(folder, None, wait=wait)
    finally:
        mod._Child = real_child
    assert len(started) == 1
    # The stopped child process ends (it is killed, not left to finish).
    started[0].wait(timeout=30)


def test_load_error_propagates(tmp_path):
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(Exception) as theirs:
        mlx_load_tokenizer(tmp_path)
    with pytest.raises(type(theirs.value)):
        load_tokenizer(tmp_path, None, wait=_never)
