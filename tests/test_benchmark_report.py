"""The docs' report command (docs/benchmarks.md) reads the whole results folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def test_the_report_tables_bench_results_and_names_the_files_it_skips() -> None:
    # results/ holds many benchmarks' files; the report reads only benchmarks.bench's
    # and failed on the first other one (KeyError 'model') until session 52.
    bench = RESULTS / "cpu_smollm2.json"
    other = RESULTS / "cpu_cold_start.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", str(other), str(bench)],
        cwd=RESULTS.parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("### "), done.stdout[:200]
    assert "| prompt tokens | pieces |" in done.stdout
    assert done.stderr.strip() == f"skipped {other}: not a benchmarks.bench result (no 'lengths')"
