"""The ``%%mlxgen`` widget in JupyterLab, driven with Chromium: streaming, Pause/Resume, Stop.

Every assertion is on what the page shows: the widget's text, the stats line
(``#1 decoding · 12 tokens · ...``), the buttons' labels and ``disabled``
state, the progress bar's outcome class (``progress-bar-success`` green,
``-warning`` orange, ``-danger`` red) and the stats line's colour.
All generations use the default model (SmolLM2-135M), greedy.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from .lab_driver import Lab, Widget, WidgetState

pytestmark = pytest.mark.browser

GREEN, ORANGE, RED = "rgb(46, 125, 50)", "rgb(230, 81, 0)", "rgb(198, 40, 40)"
# A stop waits for one piece of work, sized to the 0.2 s budget; the CPU here is
# slow and shared, so allow ten budgets (an unchunked prefill stop took 93 s).
STOP_MS_LIMIT = 2000


def watch(widget: Widget, until: str, timeout: float = 180.0) -> list[WidgetState]:
    """Every state the page showed (sampled each 50 ms) until the stats line says ``until``."""
    samples: list[WidgetState] = []
    deadline = time.monotonic() + timeout
    while True:
        state = widget.read()
        if state is not None:
            samples.append(state)
            if state.state == until:
                return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"no {until!r} within {timeout} s; last: {samples[-1:]}")
        widget.page.wait_for_timeout(50)


def assert_final(state: WidgetState, outcome: str, bar: str, color: str) -> None:
    assert state.state == outcome, state
    assert bar in state.bar_class.split(), state
    assert state.color == color, state
    assert state.stop["disabled"] and state.pause["disabled"], state
    assert state.stop["label"] == "Stop" and state.pause["label"] == "Pause", state


def test_text_and_stats_stream_into_the_widget(lab: Lab, screenshot_dir: Path) -> None:
    nb = lab.open(
        "stream.ipynb",
        [
            "%load_ext mlx_notebook\n%config MLXGen.format = 'text'",
            "%%mlxgen -n 24\nName three rivers in one sentence.",
        ],
    )
    nb.run(0)
    # A background cell: it has finished (a number in its prompt) while tokens stream.
    assert nb.run(1) == "[2]:"
    widget = nb.widget(1)
    shot = None
    samples = []
    deadline = time.monotonic() + 180
    while not samples or samples[-1].state != "done":
        state = widget.read()
        if state is not None:
            samples.append(state)
            if shot is None and state.state == "decoding" and len(state.text) >= 50:
                shot = screenshot_dir / "widget-running.png"
                nb.screenshot_output(1, shot)
        assert time.monotonic() < deadline, f"not done within 180 s: {samples[-1:]}"
        lab.page.wait_for_timeout(50)

    decoding = [s for s in samples if s.state == "decoding"]
    assert len(decoding) >= 3, [s.status for s in samples]
    # The text grows by appending, in several steps, not all at once at the end.
    texts = [s.text for s in samples]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)
    grown = sorted({len(s.text) for s in decoding if s.text})
    assert len(grown) >= 3, f"text grew in {len(grown)} steps: {grown}"
    # The stats line updates while it runs: token counts rise, tok/s appears.
    counts = sorted({s.tokens for s in decoding})
    assert len(counts) >= 3, counts
    assert any("tok/s" in s.status for s in decoding)
    # While it streams Stop and Pause are enabled and the bar is blue. (The last
    # samples before the end may catch the buttons already updated for "done"
    # and the stats line not yet: each is its own widget model.)
    for s in decoding[:-2]:
        assert not s.stop["disabled"] and not s.pause["disabled"], s
        assert "progress-bar-info" in s.bar_class.split(), s
    final = widget.settle()
    assert_final(final, "done", "progress-bar-success", GREEN)
    assert final.tokens == 24 and final.text.strip() and final.text.startswith(decoding[-1].text)
    assert final.bar_width == "100%"
    nb.screenshot_output(1, screenshot_dir / "widget-done.png")
    assert shot is not None and shot.stat().st_size > 0
    assert not lab.page_errors, lab.page_errors


def test_pause_holds_the_text_and_resume_gives_the_uninterrupted_text(lab: Lab, screenshot_dir: Path) -> None:
    cell = "%%mlxgen -n 40\nWrite two sentences about a lighthouse."
    nb = lab.open("pause.ipynb", ["%load_ext mlx_notebook\n%config MLXGen.format = 'text'", cell, cell])
    nb.run(0)
    nb.run(1)
    widget = nb.widget(1)
    widget.wait_for(lambda s: s.state == "decoding" and s.tokens >= 8, what="8 tokens")
    widget.click_pause()
    paused = widget.wait_state("paused", timeout=30)
    assert paused.pause == {"label": "Resume", "disabled": False}, paused
    assert not paused.stop["disabled"], paused
    assert paused.tokens < 40, "paused too late to show anything"
    # Nothing moves while paused.
    lab.page.wait_for_timeout(1200)
    still = widget.read()
    assert (still.text, still.tokens, still.state) == (paused.text, paused.tokens, "paused"), (paused, still)
    nb.screenshot_output(1, screenshot_dir / "widget-paused.png")

    widget.click_pause()  # now labelled Resume
    widget.wait_for(
        lambda s: s.tokens > paused.tokens and s.state in ("decoding", "done"),
        timeout=60,
        what="more tokens after Resume",
    )
    resumed = widget.wait_state("done")
    assert resumed.text.startswith(paused.text) and len(resumed.text) > len(paused.text)
    assert_final(resumed, "done", "progress-bar-success", GREEN)

    # The same cell again, uninterrupted: the same text.
    nb.run(2)
    plain = nb.widget(2).wait_state("done")
    assert plain.tokens == resumed.tokens == 40
    assert plain.text == resumed.text


def test_stop_during_prefill_and_during_decode(lab: Lab, screenshot_dir: Path) -> None:
    nb = lab.open(
        "stop.ipynb",
        [
            "%load_ext mlx_notebook\n%config MLXGen.format = 'text'",
            # Quantized weights on the CPU (read when this kernel loads the model):
            # prefill runs at ~15 tok/s on 2 cores, so 1,000 prompt tokens take
            # about a minute, long enough to click Stop in it on any CPU.
            "%env MLX_NOTEBOOK_CPU_DEQUANTIZE=0",
            "long_prompt = 'word ' * 1000",
            "%%mlxgen -n 24\n{long_prompt}",
            "%%mlxgen -n 200\nWrite a long story about a dragon who learns to sing.",
        ],
    )
    for i in range(4):
        nb.run(i)

    prefill = nb.widget(3)
    before = prefill.wait_for(lambda s: s.state == "prefilling" and s.phase == "prefill", what="prefill")
    assert not before.stop["disabled"] and before.tokens == 0 and before.text == ""
    clicked = time.monotonic()
    prefill.click_stop()
    stopped = prefill.wait_state("stopped", timeout=30)
    assert time.monotonic() - clicked < 10
    assert_final(stopped, "stopped", "progress-bar-warning", ORANGE)
    assert stopped.tokens == 0 and stopped.text == "" and stopped.phase == "prefill"
    assert float(stopped.bar_width.rstrip("%")) < 100, stopped  # stopped part-way through the prompt
    assert stopped.stop_ms is not None and stopped.stop_ms < STOP_MS_LIMIT, stopped.status

    nb.run(4)
    decode = nb.widget(4)
    decode.wait_for(lambda s: s.state == "decoding" and s.tokens >= 8, what="8 tokens")
    decode.click_stop()
    stopped = decode.wait_state("stopped", timeout=30)
    assert_final(stopped, "stopped", "progress-bar-warning", ORANGE)
    assert 8 <= stopped.tokens < 200 and stopped.text.strip()
    assert stopped.stop_ms is not None and stopped.stop_ms < STOP_MS_LIMIT, stopped.status
    nb.screenshot_output(4, screenshot_dir / "widget-stopped.png")
    lab.page.wait_for_timeout(500)
    assert decode.read().text == stopped.text  # partial text stays, nothing moves


def test_prompt_longer_than_the_context_fails_in_the_widget(lab: Lab, screenshot_dir: Path) -> None:
    nb = lab.open(
        "failed.ipynb",
        [
            "%load_ext mlx_notebook\n%config MLXGen.format = 'text'",
            "too_long = 'word ' * 9000",
            "%%mlxgen -n 8\n{too_long}",
            "%%mlxgen -n 8\nName three rivers in one sentence.",
        ],
    )
    for i in range(3):
        nb.run(i)
    widget = nb.widget(2)
    failed = widget.wait_state("failed", timeout=120)
    assert_final(failed, "failed", "progress-bar-danger", RED)
    assert re.search(r"error: prompt has \d+ tokens but the model's context is 8192", failed.status), failed.status
    nb.screenshot_output(2, screenshot_dir / "widget-failed.png")
    # The model is still usable.
    nb.run(3)
    done = nb.widget(3).wait_state("done")
    assert done.tokens == 8 and done.text.strip()
