"""What does the live widget cost? Decode speed with and without the display.

    python -m benchmarks.widget_cost --repeats 3 --tokens 64

In one real kernel (jupyter_client), alternately: a ``%%mlxgen --wait`` cell
(widget view: throttled trait updates sent as comm messages, which this client
receives like a frontend would) and ``mlx_notebook.generate(...).result()`` (no
display). Prints the decode tokens/s of each, medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from jupyter_client.manager import start_new_kernel

PROMPT = "Write a long story about a river that flows through a valley."


def run_cell(client, code: str, timeout: float = 600) -> str:
    msg_id = client.execute(code)
    out = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise RuntimeError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    km, client = start_new_kernel(kernel_name="python3")
    try:
        run_cell(client, "%load_ext mlx_notebook\nimport mlx_notebook, json")
        run_cell(
            client,
            "w = mlx_notebook.default_worker(); w.load_model()\n"
            "w.call(lambda s: setattr(s.get(None).tokenizer, 'eos_token_ids', []))",
        )
        rows = {"widget": [], "none": []}
        for r in range(args.repeats + 1):
            for kind in ["widget", "none"] if r % 2 else ["none", "widget"]:
                if kind == "widget":
                    code = f"%%mlxgen --wait -n {args.tokens} -o g\n{PROMPT}"
                    run_cell(client, code)
                else:
                    run_cell(client, f"g = mlx_notebook.generate({PROMPT!r}, max_tokens={args.tokens}); g.result()")
                tps = json.loads(run_cell(client, "print(json.dumps(g.stats.generation_tps))"))
                if r > 0:  # the first round warms up
                    rows[kind].append(tps)
                print(kind, f"{tps:.2f} tok/s", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        result = {
            "decode_tps": rows,
            "median": med,
            "ratio_widget_over_none": med["widget"] / med["none"],
            "command": " ".join(sys.argv),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=False)


if __name__ == "__main__":
    main()
