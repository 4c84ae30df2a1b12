"""Decode throughput with the reasoning split on, against plain mlx-lm ``stream_generate``.

Usage::

    python -m benchmarks.reasoning --model default --decode-tokens 48 --repeats 5 \\
        --out benchmarks/results/cpu_reasoning_default.json

The default model (SmolLM2-135M) does not think, so its tokenizer is given
thinking tags the way mlx-lm's ``TokenizerWrapper`` gives a reasoning model's
(``think_start`` / ``think_end`` and their ids: two special tokens of its
vocabulary), and the token prompt ends with the start tag: the block is open
from the first generated token, as after a DeepSeek-R1 template. Every token
then goes through the split (the token channel counts it, the text channel
routes it to ``gen.reasoning``); with ``thinking_budget`` the budget's logits
processor runs at every step and closes the block half way. mlx-lm decodes
the same prompt greedily with no split. Runs alternate, medians as in
:mod:`benchmarks.sampling` (whose measuring this reuses).
"""

from __future__ import annotations

# mlx_notebook before mlx: it binds MLX's CPU matmuls to OpenBLAS (see chat_ttft.py).
import mlx_notebook  # isort: skip

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.bench import open_model, prompt_ids, save
from benchmarks.sampling import Option, measure, table

# Two special tokens of SmolLM2's vocabulary, standing in for <think> and </think>.
TAGS = ("<issue_start>", "<issue_closed>")


def mark_thinking(tokenizer: Any, start: str, end: str) -> tuple[int, int]:
    """Give ``tokenizer`` (mlx-lm's wrapper) the thinking tags ``start`` / ``end``, as it infers a reasoning model's."""
    ids = tokenizer.convert_tokens_to_ids([start, end])
    if None in ids or tokenizer.unk_token_id in ids:
        raise SystemExit(f"the tokenizer has no {start!r} / {end!r}: pick two of its special tokens")
    tokenizer._think_start, tokenizer._think_end = start, end
    tokenizer._think_start_tokens, tokenizer._think_end_tokens = (ids[0],), (ids[1],)
    return ids[0], ids[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model name (default: the SmolLM2 GGUF)")
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=mlx_notebook.DEFAULT_STOP_BUDGET_S)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import mlx_lm

    versions = dict(device=str(mx.default_device()), platform=platform.platform(), mlx=mx.__version__)
    result: dict[str, Any] = dict(benchmark="reasoning", **versions, mlx_lm=mlx_lm.__version__, tags=TAGS)
    result.update(blas=mlx_notebook.active_blas(), budget_s=args.budget, prompt_length=args.prompt_length)
    result.update(decode_tokens=args.decode_tokens, repeats=args.repeats, options={})
    result["command"] = " ".join(["python -m benchmarks.reasoning", *sys.argv[1:]])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlxnb-reasoning-") as tmp:
        worker, name, vocab, load_s = open_model(args.model, None, 0, Path(tmp))
        start, _ = worker.call(lambda store: mark_thinking(store.get(name).tokenizer, *TAGS))
        ids = [*prompt_ids(args.prompt_length - 1, vocab, seed=1), start]
        half = args.decode_tokens // 2
        for option in (
            Option("split (all reasoning)", {}),
            Option(f"split + thinking_budget {half}", {"thinking_budget": half}),
        ):
            m = result["options"][option.name] = measure(worker, name, ids, option, args)
            # The split was on: the channels counted the reasoning (all of it, or up to the budget).
            check = mlx_notebook.generate(ids, model=name, worker=worker, max_tokens=args.decode_tokens, **option.ours)
            check.result()
            m["reasoning_tokens"], m["answer_chars"] = check.stats.reasoning_tokens, len(check.text)
            print(f"  reasoning tokens {m['reasoning_tokens']}, answer {m['answer_chars']} chars", flush=True)
            print(f"{option.name}: {m['ratio']:.3f}x (of pairs {m['pair_ratio']:.3f}x)", flush=True)
            save(result, args.out)
        worker.shutdown()
    result["load_s"], result["wall_s"] = load_s, time.perf_counter() - t0
    save(result, args.out)
    print(table(result["options"]))
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
