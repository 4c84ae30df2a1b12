"""The process table (Linux ``/proc``): what a cluster left running."""

from __future__ import annotations

from pathlib import Path


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid`` (a cluster's launcher and its local ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # zombies have ended
            found.append(int(entry.name))
    return found
