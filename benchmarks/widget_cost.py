"""What does the live display cost? Decode speed with and without it.

    python -m benchmarks.widget_cost --repeats 6 --tokens 96                  # Markdown and text views
    python -m benchmarks.widget_cost --format markdown --repeats 6 --tokens 96 \
        --out benchmarks/results/cpu_widget_cost_markdown.json

In one real kernel (jupyter_client), in turn: a ``%%mlxgen --wait --format F``
cell for each ``F`` of ``--format`` (the widget view: throttled updates sent as
comm messages, which this client receives like a frontend would; with
``markdown``, a column of ``Output`` widgets, one per Markdown block, see
``mlx_notebook/notebook/markdown_view.py``) and ``mlx_notebook.generate(...).result()``
(no display). The order rotates every round. Prints the decode tokens/s of each,
medians, the ratio of each view over no display, the comm messages a view sent
per cell, and which Markdown blocks the answer had (the default model is small:
a prompt that asks for headings, lists and code may still get plain prose).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from jupyter_client.manager import start_new_kernel

# Asks for Markdown structure (headings, a list, a code block), so the Markdown view has blocks to split.
PROMPT = (
    "Write a Markdown guide to reading a CSV file in Python, with a # heading, a short "
    "bulleted list of steps, a ```python code block, and a ## section on common mistakes."
)


def run_cell(client, code: str, timeout: float = 600, counts: Counter | None = None) -> str:
    """Run ``code``; return its stdout. ``counts`` tallies the cell's iopub messages by type."""
    msg_id = client.execute(code)
    out = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if counts is not None:
            counts[kind] += 1
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise RuntimeError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def markdown_shape(text: str) -> dict[str, int]:
    """How many lines of ``text`` are headings, list items (outside code), code fences; the blocks the view cuts."""
    from mlx_notebook.notebook.markdown_blocks import MarkdownBlocks

    shape = {"lines": 0, "headings": 0, "list_items": 0, "code_fences": 0}
    in_code = False
    for line in (raw.lstrip() for raw in text.splitlines()):
        shape["lines"] += 1
        if line.startswith("```"):
            shape["code_fences"] += 1
            in_code = not in_code
        elif not in_code:
            shape["headings"] += line.startswith("#")
            shape["list_items"] += line[:2] in ("- ", "* ", "+ ") or line.split(". ", 1)[0].isdigit()
    completed, open_block = MarkdownBlocks().feed(text)
    shape["blocks"] = len(completed) + bool(open_block)
    return shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--format", default="markdown,text", help="comma list of views: markdown, text")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    formats = args.format.split(",")
    if not set(formats) <= {"markdown", "text"}:
        ap.error("--format takes markdown, text or both (comma list)")
    kinds = [*formats, "none"]
    km, client = start_new_kernel(kernel_name="python3")
    try:
        run_cell(client, "%load_ext mlx_notebook\nimport mlx_notebook, json")
        run_cell(
            client,
            "w = mlx_notebook.default_worker(); w.load_model()\n"
            "w.call(lambda s: setattr(s.get(None).tokenizer, 'eos_token_ids', []))",
        )
        rows: dict[str, list[float]] = {k: [] for k in kinds}
        messages: dict[str, list[dict[str, int]]] = {k: [] for k in formats}
        text = ""
        for r in range(args.repeats + 1):
            shift = r % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:  # each kind takes each place in turn
                counts: Counter = Counter()
                if kind == "none":
                    code = f"g = mlx_notebook.generate({args.prompt!r}, max_tokens={args.tokens}); g.result()"
                else:
                    code = f"%%mlxgen --wait --format {kind} -n {args.tokens} -o g\n{args.prompt}"
                run_cell(client, code, counts=counts)
                tps, text, prompt_tokens, in_flight = json.loads(
                    run_cell(
                        client,
                        "s = g.stats; print(json.dumps([s.generation_tps, g.text, s.prompt_tokens, s.decode_in_flight]))",
                    )
                )
                if r > 0:  # the first round warms up
                    rows[kind].append(tps)
                    if kind != "none":
                        messages[kind].append(dict(counts))
                print(
                    kind,
                    f"{tps:.2f} tok/s",
                    f"prompt {prompt_tokens}",
                    f"in flight {in_flight}",
                    dict(counts),
                    flush=True,
                )
        med = {k: statistics.median(v) for k, v in rows.items()}
        result = {
            "decode_tps": rows,
            "median": med,
            **{f"ratio_{k}_over_none": med[k] / med["none"] for k in formats},
            "messages_per_cell": messages,
            "prompt": args.prompt,
            "answer_shape": markdown_shape(text),
            "answer_start": text[:800],
            "command": " ".join(["python -m benchmarks.widget_cost", *sys.argv[1:]]),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=False)


if __name__ == "__main__":
    main()
