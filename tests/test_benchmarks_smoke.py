"""The sampling benchmark runs end to end on the tiny model (a few tokens per option)."""

from __future__ import annotations

import json
import sys
import threading
import time

from benchmarks import sampling


def test_sampling_benchmark_runs(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sampling.json"
    argv = ["sampling", "--model", tiny_model, "--prompt-length", "8", "--decode-tokens", "3", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    sampling.main()
    result = json.loads(out.read_text())
    measured = result["models"][tiny_model]["options"]
    assert list(measured) == [o.name for o in sampling.options(384)]
    for name, m in measured.items():
        assert m["tokens"] == [3], name  # EOS off: every run decodes every token, ours and mlx-lm's
        assert m["ratio"] > 0, name
    assert "| greedy |" in capsys.readouterr().out


def test_structured_benchmark_runs_the_synthetic_path(tiny_model, tmp_path, monkeypatch, capsys):
    # --synthetic's path (no extraction, stop rounds) on the tiny model instead of a build,
    # with neither pydantic nor jsonschema importable: the GPU machine has neither.
    from benchmarks import structured

    monkeypatch.setattr(structured, "build_synthetic", lambda name, folder: tiny_model)
    monkeypatch.setitem(sys.modules, "pydantic", None)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    out = tmp_path / "structured.json"
    argv = ["structured", "--synthetic", "qwen3-tiny", "--build-dir", str(tmp_path), "--rows", "2", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--max-tokens", "24", "--stop-rounds", "2", "--json", str(out)])
    structured.main()
    result = json.loads(out.read_text())
    assert "extraction" not in result
    pair = result["decode"]["pairs"][0]
    assert pair["unconstrained_tokens"] == pair["tokens"] > 0
    assert result["decode"]["ratio_median"] > 0 and result["decode"]["batched_ratio_median"] > 0
    assert result["mask"]["mask_ms"]["n"] == 3 * pair["tokens"]
    stop = result["stop_one_constrained_row_ms"]
    assert stop["rounds"] == 2 and stop["max"] >= stop["p50"] > 0
    assert "stop one constrained row of 2" in capsys.readouterr().out


def test_decode_pieces_benchmark_runs(tiny_model, tmp_path, monkeypatch):
    from benchmarks import decode_pieces

    out = tmp_path / "pieces.json"
    argv = ["decode_pieces", "--model", tiny_model, "--budget", "0.0005", "--whole-budget", "0.3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--tokens", "6", "--repeats", "1", "--rounds", "2", "--window", "0.2"])
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--json", str(out)])
    decode_pieces.main()
    result = json.loads(out.read_text())
    tight, whole = result["runs"]
    assert tight["decode_pieces"] > 1 and whole["decode_pieces"] == 1
    assert result["same_tokens_both_budgets"]
    assert len(result["stops"]) == 2 and all(s["final"] in ("stopped", "done") for s in result["stops"])


def test_batching_benchmark_times_one_generation_in_the_batches_rounds(tiny_model, tmp_path, monkeypatch):
    from benchmarks import batching

    out = tmp_path / "batching.json"
    argv = ["batching", "--model", tiny_model, "--batch", "2", "--decode-tokens", "4", "--repeats", "3"]
    skip = "solo,together,stop,profile,join,cached_stop,prefix"
    monkeypatch.setattr(sys, "argv", [*argv, "--skip", skip, "--out", str(out)])
    batching.main()
    result = json.loads(out.read_text())
    batched = result["batched"]
    assert batched["over_one"] == batched["ours_aggregate_tps"] / batched["one_generation_tps"]
    assert batched["one_generation_tps"] > 0 and batched["one_generation_tps_solo_runs"] > 0
    assert batched["rows_equal_to_solo"] == "2/2 (worst of 3)"  # the CPU: exact
    # No GPU here: the state is recorded as absent, not guessed.
    assert result["gpu_state"] == {"start": None, "end": None}


def test_token_clock_times_tokens_not_the_flush_at_a_generations_end(tiny_model):
    # A generation's end flushes text held back (a possible tag's start) as a "tokens" event
    # with no tokens: timed as a token, it made the join benchmark's "longest gap" run to the
    # teardown's stop.
    import mlx_notebook
    from benchmarks.batching import TokenClock
    from mlx_notebook.generation.handle import GenerationEvent

    worker = mlx_notebook.Worker()
    running, gate = threading.Event(), threading.Event()
    blocker = threading.Thread(target=worker.call, args=(lambda store: running.set() or gate.wait(60),))
    blocker.start()
    assert running.wait(60)  # the worker is held: the generation stays queued until the clock listens
    gen = mlx_notebook.generate([1, 2, 3], model=tiny_model, max_tokens=5, worker=worker)
    clock = TokenClock([gen])
    gate.set()
    gen.result(timeout=120)
    blocker.join(60)
    n = len(gen.tokens)
    assert n >= 1 and len(clock.times[gen.id]) == n
    clock(GenerationEvent("tokens", gen, gen.state, text="<"))
    assert len(clock.times[gen.id]) == n
    worker.shutdown(timeout=60)


def test_join_benchmark_reports_the_turns_of_a_prompt_joining_on_the_prefill_thread(side_worker, tiny_model):
    # The turns' counts are how the others' gap is read untraced on a device (where to look when it is long).
    from benchmarks.batching import join_gap

    prompts = ["Once upon a time the quick brown fox"] * 2
    join_ids = [(41 * i) % 250 + 20 for i in range(1500)]
    result = join_gap(side_worker, tiny_model, prompts, join_ids, budget=0.02, after_tokens=3, quiet_s=0.3)
    turns = result["turns"]
    assert turns is not None, "the prompt did not join on the prefill thread"
    assert turns["side_turns"] >= 2 and turns["worker_turns"] >= 2, turns
    assert 0 < turns["worker_wait_max_ms"] <= turns["worker_wait_ms"], turns
    assert result["others_max_gap_ms"] > 0
    # The others' steps after the admit, in order (a cost of the joined step that stays, or one that fades).
    after = result["others_steps_after_join_ms"]
    assert 1 <= len(after) <= 6 and all(ms > 0 for ms in after), after
    # The gap over the joiner's leave is read apart from the join's: every other row had a token after it.
    assert result["others_leave_gap_ms"] > 0, result
    # The prefill's last gap, where the joining row merges beside their step: one of the prefill phase's.
    assert 0 < result["others_pre_admit_gap_ms"] <= result["others_max_gap_ms"], result
    # The others' gaps while they decoded alone before it: the machine's yardstick for a long join gap.
    quiet = result["others_quiet_gaps_ms"]
    assert quiet["window_s"] >= 0.3 and quiet["count"] >= 1 and quiet["longest"][0] >= quiet["p50"] > 0, quiet


def test_the_join_benchmark_waits_for_the_idle_ladder_and_not_for_one_that_failed(tiny_model, monkeypatch):
    # `--ladder-first`: a notebook's pause after load, in which the idle worker builds the prefill ladder.
    import mlx_notebook
    from benchmarks.batching import wait_for_ladder
    from mlx_notebook.generation import warm_up

    monkeypatch.setattr(warm_up, "wanted", lambda: True)  # the CUDA backend's warm-up, run on the CPU
    monkeypatch.setattr(warm_up, "LADDER_SIZES", (256, 512))
    monkeypatch.setattr(warm_up, "LADDER_CONTEXT", 1024)
    warm_ladder = warm_up.warm_ladder

    def slow_tail(loaded, keep_going):
        # The worker's moment between counting the last chunk and its word that the ladder is done, made wide
        # (CI once read the chunks at none and the word not yet given).
        done = warm_ladder(loaded, keep_going)
        time.sleep(0.5)
        return done

    monkeypatch.setattr(warm_up, "warm_ladder", slow_tail)
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        loaded = worker.store.loaded()[0]
        wait_for_ladder(loaded, limit_s=120)
        assert warm_up.ladder(loaded) == [] and loaded.ladder_warmed
    finally:
        assert worker.shutdown(timeout=60)

    def broken(*args, **kwargs):
        raise RuntimeError("a layer the ladder cannot run")

    monkeypatch.setattr(warm_up, "_first_layer", broken)
    worker = mlx_notebook.Worker(prompt_cache_gb=0)
    try:
        worker.load_model(tiny_model)
        loaded = worker.store.loaded()[0]
        waited = wait_for_ladder(loaded, limit_s=120)  # the ladder gave up: no wait to the limit
        assert warm_up.ladder(loaded) and loaded.ladder_warmed and waited < 60
    finally:
        assert worker.shutdown(timeout=60)


def test_host_stalls_counts_a_step_held_past_the_factor_as_a_stall():
    # The machine's yardstick (session 55): a step held up by something outside it is
    # counted, with its length and when it came; steps of the median are not.
    from benchmarks import host_stalls

    step = host_stalls.Step(dim=64, layers=2, rows=2)
    median_ms = step.calibrate(step_ms=1.0)
    calls = {"n": 0}

    def held_once() -> float:
        calls["n"] += 1
        if calls["n"] == 20:
            time.sleep(max(0.02, 4 * median_ms / 1000))  # the host's stall, inside one step
        return step()

    result = host_stalls.steps(held_once, seconds=0.3)
    assert result["count"] >= 20
    assert result["stalls"] >= 1, result
    assert result["longest_ms_at_s"][0][0] >= 20, result
    assert result["p50_ms"] < result["longest_ms_at_s"][0][0] / host_stalls.STALL_FACTOR


def test_host_stalls_runs_on_the_cpu(tmp_path, monkeypatch):
    from benchmarks import host_stalls

    out = tmp_path / "host.json"
    argv = ["host_stalls", "--seconds", "0.3", "--dim", "64", "--layers", "2", "--step-ms", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    host_stalls.main()
    result = json.loads(out.read_text())
    assert result["steps"]["count"] > 10
    assert result["sleeps"]["count"] > 10
    assert result["calibrated_step_ms"] > 0
