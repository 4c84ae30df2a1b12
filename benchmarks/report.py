"""Turn benchmark JSON files into markdown tables and PNG plots.

Usage::

    python -m benchmarks.report benchmarks/results/*.json --plots docs/img

Prints markdown (paste it into docs/benchmarks.md) and writes one stop-latency
plot and one throughput-ratio plot per result file when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def tables(result: dict) -> str:
    lines = [
        f"### {result['model']} on {result.get('device_info', {}).get('device_name') or result['device']}",
        "",
        f"mlx {result['mlx']}, BLAS: {result['blas']}, stop budget {result['budget_s']} s, "
        f"model load {result['load_s']:.1f} s. Command: `{result['command']}`",
        "",
        "| prompt tokens | pieces | prefill tok/s ours / plain (ratio) | decode tok/s ours / plain (ratio) | decode step ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for length, entry in result["lengths"].items():
        for pieces, part in entry.items():
            t = part.get("throughput")
            if not t:
                continue
            lines.append(
                f"| {length} | {pieces} | {t['ours_prefill_tps']:.0f} / {t['plain_prefill_tps']:.0f} "
                f"({ratio(t['prefill_ratio'])}) | {t['ours_decode_tps']:.1f} / {t['plain_decode_tps']:.1f} "
                f"({ratio(t['decode_ratio'])}) | {t['decode_step_ms']:.1f} |"
            )
    lines += [
        "",
        "Stop latency, `cancel()` to `wait()` returning, ms:",
        "",
        "| prompt tokens | pieces | phase | n | p50 | p95 | p99 | max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, entry in result["lengths"].items():
        for pieces, part in entry.items():
            for phase, stop in part.get("stop", {}).items():
                s = stop["external"]
                if not s["n"]:
                    continue
                lines.append(
                    f"| {length} | {pieces} | {phase} | {s['n']} | {ms(s['p50'])} | {ms(s['p95'])} "
                    f"| {ms(s['p99'])} | {ms(s['max'])} |"
                )
    return "\n".join(lines) + "\n"


def plots(result: dict, folder: Path, stem: str) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for phase, marker in (("load", "s"), ("prefill", "o"), ("decode", "^")):
        xs, p50, p99 = [], [], []
        for length, entry in result["lengths"].items():
            for _pieces, part in entry.items():
                stop = part.get("stop", {}).get(phase)
                if stop and stop["external"]["n"]:
                    xs.append(int(length))
                    p50.append(stop["external"]["p50"] * 1000)
                    p99.append(stop["external"]["p99"] * 1000)
        if xs:
            ax.plot(xs, p99, marker=marker, label=f"{phase} p99")
            ax.plot(xs, p50, marker=marker, linestyle=":", label=f"{phase} p50")
    ax.axhline(result["budget_s"] * 1000, color="grey", linestyle="--", label="budget")
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("stop latency (ms)")
    ax.set_title(f"Stop latency: {result['model']} ({result['device']})")
    ax.legend(fontsize=8)
    path = folder / f"{stem}-stop.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, pre, dec = [], [], []
    for length, entry in result["lengths"].items():
        t = next((p["throughput"] for p in entry.values() if p.get("throughput")), None)
        if t:
            xs.append(int(length))
            pre.append(t["prefill_ratio"])
            dec.append(t["decode_ratio"])
    if xs:
        ax.plot(xs, pre, marker="o", label="prefill ours / plain mlx-lm")
        ax.plot(xs, dec, marker="^", label="decode ours / plain mlx-lm")
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set_xscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("throughput ratio")
        ax.set_title(f"Throughput vs plain mlx-lm: {result['model']} ({result['device']})")
        ax.legend(fontsize=8)
        path = folder / f"{stem}-throughput.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        written.append(path)
    plt.close(fig)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--plots", type=Path)
    args = ap.parse_args()
    for path in args.results:
        result = json.loads(path.read_text())
        # results/ also holds other benchmarks' files (batching, probes, fault
        # campaigns), each read in its own docs section: name them and go on.
        if not (isinstance(result, dict) and "lengths" in result):
            print(f"skipped {path}: not a benchmarks.bench result (no 'lengths')", file=sys.stderr)
            continue
        print(tables(result))
        if args.plots:
            for png in plots(result, args.plots, path.stem):
                print(f"![{png.stem}]({png.relative_to(args.plots.parent)})\n")


if __name__ == "__main__":
    main()
