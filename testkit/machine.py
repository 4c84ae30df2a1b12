"""What the machine did while a test ran, for the report of a test that failed.

A test that missed a deadline because the machine was slow reads like one
that hung: CI's failure on 2026-12-04 had three ladder tests of
tests/test_warm_up.py run 30-300x slower than anywhere else (37 s, 46 s,
then a 12-token generation still decoding after 120 s), the tests before
and after them at their usual speed, and nothing to tell a stalled machine
from a stalled worker. So every test's call is bracketed by two readings of
``/proc`` (a few ms), and a failed one's report gets a section: the CPU time
this process and the others used, the time the hypervisor took (steal), the
load, which processes took the most, and the CPU time of this process's
threads still alive at the end (a thread that ended meanwhile, such as a
worker the test shut down, counts in the process's total only). Linux only;
elsewhere the section says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
_PROC = Path("/proc")


@dataclass
class Reading:
    wall: float
    cpu: dict[str, float]  # /proc/stat's first line, seconds by field
    processes: dict[int, tuple[str, float]]  # pid -> (name, CPU seconds)
    threads: dict[int, tuple[str, float]]  # this process's live tid -> (name, CPU seconds)


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _task_cpu(stat_file: Path) -> tuple[str, float] | None:
    try:
        raw = stat_file.read_text()
    except OSError:  # the task ended between the listing and the read
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    # utime and stime: fields 14 and 15 of proc(5), 12 and 13 after the name and state.
    return name, (int(rest[11]) + int(rest[12])) / _TICK


def _tasks(folder: Path) -> dict[int, tuple[str, float]]:
    out = {}
    for entry in folder.iterdir():
        if entry.name.isdigit():
            got = _task_cpu(entry / "stat")
            if got is not None:
                out[int(entry.name)] = got
    return out


def take() -> Reading | None:
    """The machine's counters now; ``None`` where ``/proc`` cannot be read."""
    try:
        first = (_PROC / "stat").read_text().splitlines()[0].split()[1:]
        cpu = {name: int(value) / _TICK for name, value in zip(_CPU_FIELDS, first, strict=False)}
        return Reading(time.monotonic(), cpu, _tasks(_PROC), _tasks(_PROC / "self" / "task"))
    except (OSError, ValueError, IndexError):
        return None


def _grown(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> list[tuple[float, int, str]]:
    """``(CPU seconds used between the readings, id, name)``, most first; a task born between them counts in full."""
    rows = [(cpu - before.get(key, (name, 0.0))[1], key, name) for key, (name, cpu) in after.items()]
    return sorted((row for row in rows if row[0] > 0), reverse=True)


def report(before: Reading | None, after: Reading | None) -> str:
    """What the machine did between ``before`` and ``after``, in a few lines."""
    if before is None or after is None:
        return "no reading of /proc (not Linux?)"
    wall = after.wall - before.wall
    used = {name: after.cpu.get(name, 0.0) - before.cpu.get(name, 0.0) for name in _CPU_FIELDS}
    busy = sum(used.values()) - used["idle"] - used["iowait"]
    mine = os.getpid()
    grown = _grown(before.processes, after.processes)
    own = next((cpu for cpu, pid, _ in grown if pid == mine), 0.0)
    cores = os.cpu_count() or 1
    lines = [
        f"wall {wall:.1f} s on {cores} cores; busy {busy:.1f} core-s: this process {own:.1f}, "
        # /proc/stat's ticks and a process's own counters round apart: never "-0.0".
        f"the others {max(0.0, busy - own):.1f}; steal {used['steal']:.1f}, iowait {used['iowait']:.1f}, "
        f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}",
        "most CPU: " + ", ".join(f"{name}[{pid}] {cpu:.1f} s" for cpu, pid, name in grown[:6]),
        "this process's threads: "
        + ", ".join(f"{name}[{tid}] {cpu:.1f} s" for cpu, tid, name in _grown(before.threads, after.threads)[:8]),
    ]
    return "\n".join(lines)
