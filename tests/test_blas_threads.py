"""OpenBLAS's threads follow the load: fewer while other processes take the cores, all of them when quiet.

The decision is checked on a written ``/proc/stat`` (the numbers are the
input; the library calls are counted), and the shipped governor on this
machine's real ``/proc/stat`` and real OpenBLAS against real busy processes.
A decode step of several rows gets the count its own timed steps ran
fastest on: the trials are checked on given times, and a real batch of the
tiny model is checked to feed them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_notebook
from mlx_notebook.loading import blas, blas_threads
from testkit.waiting import wait_until


class _Library:
    """What BlasThreads calls of libopenblas: the thread count set, recorded."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self.calls: list[int] = []

    def openblas_get_num_threads(self) -> int:
        return self.cores

    def openblas_set_num_threads(self, n: int) -> None:
        self.calls.append(n)


def _write_stat(path: Path, busy_ticks: int, idle_ticks: int) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {busy_ticks} 0 0 {idle_ticks} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


@pytest.mark.unit
def test_threads_follow_the_other_processes_cpu_time(tmp_path: Path, monkeypatch) -> None:
    stat = tmp_path / "stat"
    lib = _Library(cores=4)
    tick = os.sysconf("SC_CLK_TCK")
    clock = [100.0]
    own = [0.0]
    monkeypatch.setattr(blas_threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(blas_threads.os, "times", lambda: os.times_result((own[0], 0.0, 0.0, 0.0, 0.0)))
    governor = blas_threads.BlasThreads(lib, stat_path=str(stat))  # type: ignore[arg-type]
    busy = 0.0

    def look(seconds: float, others_cores: float, own_cores: float) -> int:
        nonlocal busy
        clock[0] += seconds
        own[0] += own_cores * seconds
        busy += (others_cores + own_cores) * seconds
        _write_stat(stat, round(busy * tick), 0)
        return governor.fit()

    assert look(0, 0, 0) == 4  # the first look only takes a sample
    assert look(1.0, others_cores=0.1, own_cores=3.9) == 4  # quiet: every core
    assert look(1.0, others_cores=2.0, own_cores=2.0) == 2  # two busy processes: two threads left
    assert look(1.0, others_cores=3.8, own_cores=0.2) == 1  # every core taken: one, never zero
    assert look(0.1, others_cores=0.0, own_cores=1.0) == 1  # too soon to look again
    assert look(1.0, others_cores=0.0, own_cores=1.0) == 4  # quiet again
    assert lib.calls == [2, 1, 4]  # set only when it changes


def test_the_shipped_governor_follows_real_busy_processes() -> None:
    if blas.openblas_path() is None or not Path("/proc/stat").exists():
        pytest.fail(f"no system OpenBLAS on Linux here ({blas.active_blas()}): CI installs libopenblas0-pthread")
    governor = blas_threads.governor()
    assert governor is not None
    cores = governor.cores
    if cores == 1:
        pytest.fail("OpenBLAS runs one thread before any load: nothing to fit on a one-core machine")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        wait_until(lambda: blas_threads.fit_to_load() == 1, timeout=20, what="one OpenBLAS thread under load")
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=10)
    wait_until(lambda: blas_threads.fit_to_load() == cores, timeout=20, what="every thread back once quiet")


@pytest.mark.unit
def test_an_unreadable_proc_stat_stops_the_fitting_not_the_generation(tmp_path: Path, monkeypatch) -> None:
    lib = _Library(cores=2)
    broken = blas_threads.BlasThreads(lib, stat_path=str(tmp_path / "missing"))  # type: ignore[arg-type]
    monkeypatch.setattr(blas_threads, "_governor", broken)
    monkeypatch.setattr(blas_threads, "_tried", True)
    assert blas_threads.fit_to_load() is None
    assert blas_threads.governor() is None and lib.calls == []


@pytest.mark.unit
def test_a_batched_step_gets_the_thread_count_its_own_steps_ran_fastest_on() -> None:
    trials = blas_threads.StepTrials()
    # One row or one free core: nothing to try, the load-fitted count.
    assert trials.threads(1, free=4) == 4 and trials.threads(3, free=1) == 1
    # Four rows on four free cores: 4, then 2, then 1 thread, TRIAL_STEPS steps each.
    seconds = {4: 0.09, 2: 0.07, 1: 0.08}
    tried = []
    for _ in range(3 * blas_threads.TRIAL_STEPS):
        n = trials.threads(4, free=4)
        tried.append(n)
        trials.record(4, 4, n, seconds[n])
    assert tried == [4] * 3 + [2] * 3 + [1] * 3
    assert trials.threads(5, free=4) == 2  # 4-7 rows share what 4 rows measured
    assert trials.threads(2, free=4) == 4  # 2-3 rows are tried on their own
    assert trials.threads(4, free=2) == 2  # and so is another load
    # The chosen count is timed again after RETRY_STEPS steps: the context and the rows change.
    for _ in range(blas_threads.RETRY_STEPS):
        trials.record(4, 4, 2, 0.07)
    assert trials.threads(4, free=4) == 4


@pytest.mark.unit
def test_the_step_in_flight_when_the_count_changed_is_not_timed(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _write_stat(stat, 0, 1000)
    lib = _Library(cores=2)
    governor = blas_threads.BlasThreads(lib, stat_path=str(stat))  # type: ignore[arg-type]
    assert governor.fit(rows=4) == 2  # the first candidate is the count in use: no change
    governor.step_took(4, 0.1)
    assert governor.fit(rows=4) == 2
    governor.step_took(4, 0.1)
    governor.fit(rows=4)
    governor.step_took(4, 0.1)  # three steps timed on two threads
    assert governor.fit(rows=4) == 1 and lib.calls == [1]
    governor.step_took(4, 5.0)  # ran partly on two threads: not a sample of one
    for _ in range(blas_threads.TRIAL_STEPS):
        governor.fit(rows=4)
        governor.step_took(4, 0.05)
    assert governor.fit(rows=4) == 1  # one thread won: 0.05 s against 0.1 s
    assert governor.fit(rows=1) == 2 and lib.calls == [1, 2]  # a prefill piece or a lone row: every free core


def test_a_real_batch_times_its_steps_for_the_thread_count(worker, tiny_model, tmp_path: Path, monkeypatch) -> None:
    """The session feeds its decode steps' times to the governor (the library's calls recorded, the load quiet)."""
    stat = tmp_path / "stat"
    _write_stat(stat, 0, 1000)
    lib = _Library(cores=2)
    governor = blas_threads.BlasThreads(lib, stat_path=str(stat))  # type: ignore[arg-type]
    monkeypatch.setattr(blas_threads, "_governor", governor)
    monkeypatch.setattr(blas_threads, "_tried", True)
    gens = [
        mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=24)
        for p in ("the first of two rows", "and the second one")
    ]
    for g in gens:
        g.result(timeout=120)
    assert max(g.stats.batch_size for g in gens) == 2
    trial = governor.steps._trials[(2, 2)]
    assert trial.chosen in (1, 2), trial
    assert all(len(trial.samples[n]) == blas_threads.TRIAL_STEPS for n in (1, 2))
    assert all(0 < s < 10 for n in (1, 2) for s in trial.samples[n])


def test_a_batchs_last_step_is_not_timed(worker, tiny_model, tmp_path: Path, monkeypatch) -> None:
    """A step after which rows left read a token queued a step before: its interval is not a step's time.

    Measured before this was checked: each batch's last step gave a 27-35 ms
    sample among 78-109 ms ones (4 rows of the default model, 2 cores), and
    two of them among a candidate's three pick the slower thread count.
    """
    stat = tmp_path / "stat"
    _write_stat(stat, 0, 1000)
    gens: list[mlx_notebook.Generation] = []
    timed: list[tuple[int, int]] = []  # (rows of the step timed, generations still running when it was)

    class Spy(blas_threads.BlasThreads):
        def step_took(self, rows: int, seconds: float) -> None:
            timed.append((rows, sum(not g.finished for g in gens)))
            super().step_took(rows, seconds)

    governor = Spy(_Library(cores=2), stat_path=str(stat))  # type: ignore[arg-type]
    monkeypatch.setattr(blas_threads, "_governor", governor)
    monkeypatch.setattr(blas_threads, "_tried", True)
    for _ in range(2):  # two batches: the second's steps follow the first's last one
        gens[:] = [
            mlx_notebook.generate(p, model=tiny_model, worker=worker, max_tokens=12)
            for p in ("the first of four rows", "the second", "a third one", "and the fourth")
        ]
        for g in gens:
            g.result(timeout=120)
        assert max(g.stats.batch_size for g in gens) == 4
    assert any(rows == 4 for rows, _ in timed), timed  # the batch's steps were timed
    assert all(running == rows for rows, running in timed), timed  # ... and none that rows left
