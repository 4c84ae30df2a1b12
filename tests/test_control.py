"""The cancel token and the pace: requests, checkpoints, pause hooks, recorded latencies."""

from __future__ import annotations

import threading
import time

import pytest

from mlx_notebook.control import Cancelled, CancelToken, Pace, unpaced
from testkit.waiting import wait_until

pytestmark = pytest.mark.unit


def test_checkpoint_passes_until_a_stop_then_raises_every_time() -> None:
    token = CancelToken()
    token.checkpoint()
    token.cancel()
    for _ in range(2):
        with pytest.raises(Cancelled):
            token.checkpoint()
    assert token.cancelled and [e.kind for e in token.events] == ["cancel"]


def test_pause_blocks_with_hooks_once_then_resume_continues() -> None:
    token = CancelToken()
    calls: list[str] = []
    hooked = threading.Event()

    def on_pause() -> None:
        calls.append("pause")
        hooked.set()

    pace = Pace(token, 0.05, on_pause=on_pause, on_resume=lambda: calls.append("resume"))
    token.pause()
    passed = threading.Event()

    def work() -> None:
        pace.checkpoint()
        passed.set()

    thread = threading.Thread(target=work)
    thread.start()
    assert hooked.wait(30), "the pause hook was never called"
    # The pause is marked effective right before the checkpoint blocks.
    wait_until(lambda: token.events[0].effective_at is not None, 30, "the pause marked effective")
    # However late this thread runs, a checkpoint that did not block would have passed by now.
    assert not passed.wait(0.05) and calls == ["pause"], "a paused checkpoint must block after its hook"
    token.resume()
    thread.join(30)
    assert passed.is_set() and calls == ["pause", "resume"]
    pause, resume = token.events
    assert pause.kind == "pause" and pause.latency_s is not None and resume.latency_s is not None


def test_stop_during_a_pause_raises_without_the_resume_hook() -> None:
    token = CancelToken()
    calls: list[str] = []
    hooked = threading.Event()

    def on_pause() -> None:
        calls.append("pause")
        hooked.set()

    pace = Pace(token, on_pause=on_pause, on_resume=lambda: calls.append("resume"))
    token.pause()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            pace.checkpoint()
        except Cancelled as exc:
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    assert hooked.wait(30), "the pause hook was never called"  # the checkpoint is in its pause
    token.cancel()
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and calls == ["pause"]
    # A stop ends the pause: later requests change nothing.
    token.pause()
    token.resume()
    assert [e.kind for e in token.events] == ["pause", "cancel"]


def test_repeated_requests_are_recorded_once() -> None:
    token = CancelToken()
    token.pause()
    token.pause()
    token.resume()
    token.resume()
    token.cancel()
    token.cancel()
    assert [e.kind for e in token.events] == ["pause", "resume", "cancel"]


def test_mark_stopped_gives_the_latency_of_the_request() -> None:
    token = CancelToken()
    assert token.mark_stopped() is None  # nothing was requested
    token.cancel()
    time.sleep(0.01)
    latency = token.mark_stopped()
    assert latency is not None and latency >= 0.01
    assert token.latencies("cancel") == [latency]
    # Marking again keeps the first effect time.
    assert token.mark_stopped() == latency


def test_unpaced_never_stops() -> None:
    pace = unpaced(0.2)
    assert pace.budget_s == 0.2
    pace.checkpoint()
