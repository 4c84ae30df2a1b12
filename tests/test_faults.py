"""The fault campaign, short: random faults in a real kernel, and nothing lost.

About 30 rounds of ``tests/fault_rounds.py`` on the tiny random model (every
fault: Stop click, ``%mlxgen_stop``, Pause+Resume, Pause+Stop, Interrupt
during ``--wait``, Interrupt while idle, another generation, kernel restart;
at a random moment of load, prefill, decode, paused, queued or idle), a few
rounds on the default model, MLX errors inside the worker, and kernel
shutdown / restart in the middle of generations. After every round the kernel
answers, a fresh greedy generation gives the reference tokens, MLX active
memory is back at its baseline and no thread was left behind.
``scripts/fault_campaign.py`` runs the same rounds for hours.

Also the regression tests of the bugs the campaign found.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import has_default_model, needs_default_model

import mlx_notebook
from testkit.fault_rounds import (
    FAULTS,
    PHASES,
    Campaign,
    RoundResult,
    default_spec,
    memory_problem,
    plan,
    summarize,
    tiny_spec,
)
from testkit.kernel_helpers import start_kernel, view, wait_state
from testkit.tiny_model import make_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SEED = 3
ROUNDS = 30


@pytest.fixture(scope="module")
def campaign(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    other = make_tiny_model(tmp_path_factory.mktemp("tiny-b") / "model", seed=1)
    models = [tiny_spec("tiny", tiny_model), tiny_spec("tiny-b", str(other))]
    if has_default_model():
        models.append(default_spec())
    c = Campaign(models, seed=SEED)
    c.start()
    yield c
    c.close()


def _no_problems(results: list[RoundResult]) -> None:
    bad = [r.summary() for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    summary = summarize(results)
    assert summary["kernel_deaths"] == 0 and summary["wrong_outputs"] == 0, summary


def test_random_fault_rounds(campaign: Campaign) -> None:
    schedule = plan(SEED, ROUNDS, mlx_error_share=0.0)
    assert {f for _, f in schedule} == set(FAULTS) and {p for p, _ in schedule} == set(PHASES)
    results = [campaign.run_round(i, phase, fault) for i, (phase, fault) in enumerate(schedule)]
    _no_problems(results)
    assert any(r.outcome == "stopped" for r in results), "no round stopped a generation"
    assert any(r.fault == "pause_resume" and r.outcome == "done" for r in results), "no pause+resume"


@pytest.mark.kernel
def test_fault_rounds_with_the_prefix_cache_on(tiny_model: str) -> None:
    """The rounds above run with the prompt cache off; with it on, every rerun of a
    prompt starts from its cached prefix, and after every fault (stops, pauses,
    interrupts, restarts, MLX errors) a fresh generation still gives the reference."""
    c = Campaign([tiny_spec("tiny", tiny_model)], seed=SEED + 1, prompt_cache_gb=2.0)
    c.start()
    try:
        assert c.s.eval("get_ipython().magics_manager.registry['MLXGen'].prompt_cache_gb") == 2.0
        schedule = plan(SEED + 1, 12, mlx_error_share=0.1)
        results = [c.run_round(i, phase, fault) for i, (phase, fault) in enumerate(schedule)]
        _no_problems(results)
        # After all that the cache serves: the second run of the long prompt (rounds may
        # have restarted the kernel since the first) prefills only its last token.
        prompt, n = c._prompt(c.main, "prefill")
        for _ in range(2):
            assert c._generate_wait(c.main, prompt, n, "_fc_cached").ok
            assert c.s.eval("_fc_cached.tokens") == c.references[("tiny", "prefill")]
        cached, total = c.s.eval("(_fc_cached.stats.cached_tokens, _fc_cached.stats.prompt_tokens)")
        assert cached == total - 1, (cached, total)
    finally:
        c.close()


@pytest.mark.parametrize("phase, how", [("prefill", "eval"), ("decode", "raise"), ("decode", "eval")])
def test_mlx_error_fails_only_that_generation(campaign: Campaign, phase: str, how: str) -> None:
    result = campaign.run_round(100, phase, "mlx_error", how=how)
    _no_problems([result])
    assert result.outcome == "failed", result.summary()


def test_batched_rounds(campaign: Campaign) -> None:
    """Generations decoding together, random Stop / Pause / Resume / join / interrupt on random rows."""
    results = [campaign.batch_round(i) for i in range(6)]
    _no_problems(results)
    assert any("stopped" in r.outcome for r in results), [r.outcome for r in results]
    assert any("done" in r.outcome for r in results), [r.outcome for r in results]


@needs_default_model
@pytest.mark.parametrize(
    "phase, fault", [("load", "stop_click"), ("load", "pause_resume"), ("prefill", "interrupt_wait")]
)
def test_default_model_rounds(campaign: Campaign, phase: str, fault: str) -> None:
    result = campaign.run_round(200, phase, fault, model="default")
    _no_problems([result])
    assert result.landed in ("loading", "prefilling", "paused"), result.summary()


@pytest.mark.parametrize(
    "index, mode, phase",
    [(0, "restart", "decode"), (1, "shutdown", "load"), (2, "restart", "paused"), (3, "shutdown", "queued")],
)
def test_shutdown_and_restart_mid_generation(campaign: Campaign, index: int, mode: str, phase: str) -> None:
    result = campaign.exit_round(index, mode, phase)
    assert result.ok, result.summary()
    # Nothing had to be killed: the hooks drain the worker before the kernel exits.
    assert result.exit["code"] == 0 and result.exit["jupyter_client"] == "ShutdownRequest", result.exit


# -- regression tests for what the campaign found --------------------------------------------------


class _FailsAt(nn.Module):
    """A layer that raises at its ``at``-th call (mid-decode for a short prompt)."""

    def __init__(self, layer: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = layer, at, 0

    def __getattr__(self, name: str):
        if "inner" in self and name not in self:
            return getattr(self["inner"], name)
        return super().__getattr__(name)

    def __call__(self, x, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.at:
            raise RuntimeError("[fault injection] layer failed on purpose")
        return self.inner(x, *args, **kwargs)


def test_failed_generation_frees_its_kv_cache(worker, tiny_model: str) -> None:
    """A failed handle used to pin its KV cache and model through the error's traceback.

    ``traceback.clear_frames`` clears the frames' locals, but the frames keep
    their functions, whose closures (``decode``'s ``step``) hold the cache.
    """
    mlx_notebook.generate("hi", model=tiny_model, worker=worker, max_tokens=2).result(timeout=60)
    base = worker.call(lambda store: mx.get_active_memory())
    model, _ = mlx_notebook.load_model(tiny_model, worker=worker)
    layers = model.model.layers
    original = layers[1]
    layers[1] = _FailsAt(original, at=60)
    try:
        gen = mlx_notebook.generate("The quick brown fox " * 20, model=tiny_model, worker=worker, max_tokens=200)
        assert gen.wait(60) and gen.state == "failed" and gen.tokens, (gen.state, gen.error)
    finally:
        layers[1] = original
    assert worker.call(lambda store: mx.get_active_memory()) <= base * 1.05
    assert gen.error.__traceback__ is None
    notes = "".join(getattr(gen.error, "__notes__", []))
    assert "worker traceback" in notes or not hasattr(gen.error, "add_note")
    with pytest.raises(RuntimeError, match="fault injection"):
        gen.result()


def test_failed_decode_step_leaves_nothing_holding_the_model(worker, tmp_path: Path) -> None:
    """A failed decode step used to leave the batch in the failed rows' stop tokens.

    The batch's wake-up hook stayed in each failed token's watchers, and the
    handle (kept in the worker's history and the notebook) held the batch, its
    session and the model with its prompt cache. Nothing showed while the model
    stayed loaded; after an unload its weights and every cached prefix stayed
    in memory, uncounted (the prefix-cache fault rounds: 4.99 MB active against
    0.69 MB, exactly the unloaded model's weights and prompt cache).
    """
    folder = str(make_tiny_model(tmp_path / "model"))  # its own model: the unload touches no other test
    mlx_notebook.generate("hi", model=folder, worker=worker, max_tokens=2).result(timeout=60)
    loaded = weakref.ref(worker.call(lambda store: store.get(folder)))
    model, _ = mlx_notebook.load_model(folder, worker=worker)
    layers = model.model.layers
    original = layers[1]
    layers[1] = _FailsAt(original, at=60)
    try:
        gen = mlx_notebook.generate("The quick brown fox " * 20, model=folder, worker=worker, max_tokens=200)
        assert gen.wait(60) and gen.state == "failed" and gen.tokens, (gen.state, gen.error)
    finally:
        layers[1] = original
    del model, layers, original
    holders = [getattr(w, "__self__", w) for w in gen.token.watchers]
    assert not [h for h in holders if type(h).__name__ == "DecodeBatch"], holders
    assert worker.call(lambda store: store.unload(folder))
    worker.call(lambda store: gc.collect())
    assert loaded() is None, [type(r).__name__ for r in gc.get_referrers(loaded())]


def test_resume_during_load_reports_loading_again(worker, tiny_model: str, tmp_path: Path) -> None:
    """Resume during a model load used to leave the state ``paused`` until the load ended."""
    folder = str(make_tiny_model(tmp_path / "m", layers=8, hidden=256, intermediate=512))
    states: list[str] = []
    paused = threading.Event()

    def on_event(event) -> None:
        if event.kind == "state":
            states.append(event.state)
            if event.state == "paused":
                paused.set()
        elif event.kind == "progress" and event.phase.startswith("load") and 0 < event.done < event.total:
            if not paused.is_set():
                event.generation.pause()

    # A running job keeps the next one queued until its listener is attached.
    blocker = mlx_notebook.generate("hi", model=tiny_model, worker=worker, max_tokens=100000)
    gen = mlx_notebook.generate("hi", model=folder, worker=worker, max_tokens=4, stop_budget=0.0005)
    gen.add_listener(on_event)
    blocker.cancel()
    assert paused.wait(60), f"never paused during load: {states}"
    gen.resume()
    assert gen.wait(60) and gen.state == "done"
    after = states[states.index("paused") + 1]
    assert after == "loading", states


SLOW = {
    # Where the interrupt lands: while the widget is being displayed, or after
    # that but before the view follows the generation.
    "display": ("import mlx_notebook.notebook.widget as W", "W.WidgetView._display"),
    "listener": ("import mlx_notebook.generation.handle as W", "W.Generation.add_listener"),
}


@pytest.mark.kernel
@pytest.mark.parametrize("where", sorted(SLOW))
def test_interrupt_before_the_wait_begins_still_stops_the_generation(tiny_model: str, where: str) -> None:
    """An interrupt while a ``--wait`` cell was still showing its widget used to
    end the cell and leave the generation running unseen in the background,
    and the widget showing "queued" with its Stop button enabled (or, landing
    inside ipywidgets' ``hold_sync``, a widget that never updated again)."""
    module, target = SLOW[where]
    with start_kernel() as session:
        assert session.execute(f"%%mlxgen -m {tiny_model} -n 2 --wait\nhi").ok  # loaded
        # Make that step slow, and say when it begins, so the interrupt surely lands in it.
        assert session.execute(
            f"import time; {module}\n_slow = {target}\n"
            f"{target} = lambda *a: (print('slow step', flush=True), time.sleep(1.5), _slow(*a))[2]"
        ).ok
        cell = session.start(f"%%mlxgen -m {tiny_model} -n 100000 --wait -o g\nhi")
        session.wait_until(
            lambda: any(
                m["msg_type"] == "stream" and "slow step" in m["content"]["text"] for m in session.with_parent(cell)
            ),
            60,
            "the slow step to begin",
        )
        session.km.interrupt_kernel()
        reply = session.reply_to(cell, timeout=60)
        assert session.execute(f"{target} = _slow").ok
        assert reply.content["ename"] == "KeyboardInterrupt", reply.content
        assert "stopped after" in reply.content["evalue"], reply.content
        assert session.eval("(g.wait(10), g.state)") == (True, "stopped")
        # The widget follows the generation to its end (it used to stay "queued").
        assert wait_state(session, cell, ("stopped",), timeout=10) == "stopped"
        assert view(session, cell)["stop"][1]["disabled"] is True
        assert session.execute(f"%%mlxgen -m {tiny_model} -n 2 --wait\nhi").ok


_FIRST_LOAD = """
import atexit, sys, threading, time


class SlowImport:
    \"\"\"A slower machine: importing transformers (mlx-lm's first load imports it) takes 3 s more.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            time.sleep(3.0)
        return None


sys.meta_path.insert(0, SlowImport())
import mlx_notebook
assert "mlx_lm.utils" not in sys.modules
gen = mlx_notebook.generate("hi", model=sys.argv[1], max_tokens=1000)
deadline = time.monotonic() + 60
while gen.state != "loading":
    assert time.monotonic() < deadline and not gen.finished, gen.state
    time.sleep(0.001)
time.sleep(float(sys.argv[2]))  # the moment of the stop: a parameter, not a wait
gen.cancel()
assert gen.wait(30)
importing = any(t.name == "mlx-notebook-import" and t.is_alive() for t in threading.enumerate())
print("RESULT", gen.state, gen.stats.stop_latency_s, importing)
# Keep the stopped import running into the interpreter's exit, as a slower machine would.
atexit.register(time.sleep, 1.0)
"""


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_stop_during_the_first_import_of_mlx_lm_is_quick(tiny_model: str, delay: float) -> None:
    """The first load of a session imports mlx-lm (and transformers): ~1.3 s here,
    which a stop, an interrupt or a kernel shutdown used to wait for in full."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_LOAD, tiny_model, str(delay)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).parent.parent),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, state, latency, importing = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT")).split()
    # Stopped while the import still ran: the stop did not wait for it (how quickly is
    # a figure for benchmarks/wall_clock.py, not a pass mark on a shared CPU).
    assert state == "stopped" and importing == "True", proc.stdout
    print(f"stop during the first import of mlx-lm: {float(latency):.3f} s")
    # The import left running must not trip over the interpreter's exit.
    assert "Error" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# -- the memory check itself --------------------------------------------------------------------------


def test_mlx_counts_a_reused_bigger_buffer_whole() -> None:
    """Why the memory check allows slack: MLX hands a request a cached buffer up to two pages bigger and counts
    all of it as active. If MLX stops doing so, this fails and the slack in ``memory_problem`` can go."""
    size = 64 * 1024
    mx.synchronize()
    mx.clear_cache()
    bigger = mx.zeros((size + 3000,), dtype=mx.uint8)
    mx.eval(bigger)
    del bigger  # to MLX's buffer cache
    before = mx.get_active_memory()
    exact = mx.zeros((size,), dtype=mx.uint8)
    mx.eval(exact)
    assert mx.get_active_memory() - before == size + 3000
    del exact
    mx.clear_cache()


def test_memory_check_allows_the_slack_and_catches_a_leaked_cache() -> None:
    base = 688_392  # the tiny model's weights, as a fault round reads them
    slack = 8 * 2 * 4096  # eight kept arrays, two CPU pages each
    assert memory_problem(741_704, base, slack) is None  # the round that read 1.077x: all of it slack
    assert memory_problem(741_704, base, 0) is not None
    leaked = memory_problem(base + 524_288, base, slack)  # one tiny-model cache of 512 positions left behind
    assert leaked is not None and "1.762x" in leaked
    assert memory_problem(int(base * 0.9), base, slack) is not None  # below: the baseline was wrong
    assert memory_problem(None, base) is None and memory_problem(base, None) is None
