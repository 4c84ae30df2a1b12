"""Waiting in tests: every wait has a deadline, and a generation that ends first fails it at once.

A test that polls ``while len(gen.tokens) < 5: time.sleep(0.001)`` hangs the
whole suite when the generation ends with four tokens, or fails, or never
starts. :func:`wait_until` gives the poll a deadline and a message that says
what was awaited; :func:`wait_for_generation` also fails as soon as the
generation has ended without the condition (``done`` at token 120 is no
pause), and :func:`assert_stays_paused` is the check every pause test makes
before it resumes: the state is ``paused`` and no token arrives while other
work runs to its end.

Example::

    gen = mlx_notebook.generate(prompt, model=model, worker=worker, max_tokens=60)
    wait_for_generation(gen, lambda: len(gen.tokens) >= 5, "5 tokens")
    gen.pause()
    assert_stays_paused(gen, lambda: other_generation(worker, model))
    gen.resume()
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx_notebook

# Long enough for the slowest legitimate wait on a busy 2-core CPU (a default-model
# load and prefill), short enough that a hang shows up as a failure, not a CI timeout.
DEFAULT_TIMEOUT_S = 120.0


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = DEFAULT_TIMEOUT_S,
    what: str = "",
    *,
    unless: Callable[[], Any] | None = None,
    interval: float = 0.001,
) -> Any:
    """Poll ``predicate()`` until it is truthy; return its value.

    Args:
        predicate: The condition awaited.
        timeout: Seconds before the wait fails. Default: ``120``.
        what: What is awaited, for the failure message. Default: the predicate's repr.
        unless: Checked after each false ``predicate()``: when truthy, the
          condition can no longer come, and the wait fails at once with its
          value in the message (e.g. ``lambda: gen.finished and gen.state``).
          Default: ``None``.
        interval: Seconds between polls. Default: ``0.001``.

    Raises:
        AssertionError: The deadline passed, or ``unless()`` became truthy first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if unless is not None:
            reason = unless()
            if reason:
                raise AssertionError(f"waiting for {what or predicate}: it can no longer happen ({reason})")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


def ended(gen: mlx_notebook.Generation) -> str:
    """``""`` while ``gen`` runs; once finished, what it ended as (for :func:`wait_until`'s ``unless``)."""
    if not gen.finished:
        return ""
    return f"generation #{gen.id} ended {gen.state} after {len(gen.tokens)} tokens, error {gen.error!r}"


def wait_for_generation(
    gen: mlx_notebook.Generation, predicate: Callable[[], Any], what: str, timeout: float = DEFAULT_TIMEOUT_S
) -> Any:
    """:func:`wait_until` ``predicate()``, failing at once if ``gen`` finishes without it."""
    return wait_until(predicate, timeout, what, unless=lambda: not predicate() and ended(gen))


def wait_tokens(gen: mlx_notebook.Generation, n: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until ``gen`` has made at least ``n`` tokens (fails if it ends with fewer)."""
    wait_for_generation(gen, lambda: len(gen.tokens) >= n, f"{n} tokens of generation #{gen.id}", timeout)


def wait_state(gen: mlx_notebook.Generation, state: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until ``gen`` is in ``state`` (fails if it ends in another one)."""
    wait_for_generation(gen, lambda: gen.state == state, f"generation #{gen.id} {state}", timeout)


def wait_prefill_chunks(gen: mlx_notebook.Generation, n: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until ``gen`` is prefilling with at least ``n`` prefill chunks done (most of a long prompt still ahead)."""
    wait_for_generation(
        gen,
        lambda: gen.state == "prefilling" and gen.stats.prefill_chunks >= n,
        f"{n} prefill chunks of #{gen.id}",
        timeout,
    )


def in_prefill(gen: mlx_notebook.Generation, action: Callable[[], Any], chunks: int = 1) -> threading.Event:
    """Call ``action()`` (a pause, a stop) at ``gen``'s first prefill report with ``chunks`` pieces done and
    tokens still ahead, on the thread that reports it; the event returned is set once it was called.

    A test thread that waits for the chunks and then asks can be scheduled late on a busy machine, and
    its request then lands after the prefill (a pause test that reads "no token yet" fails); asked from
    the report, it lands at the next checkpoint.
    """
    called = threading.Event()

    def listener(event: mlx_notebook.GenerationEvent) -> None:
        if called.is_set() or event.kind != "progress" or event.phase != "prefill":
            return
        # The prefill feeds all but the last prompt token: ``total - 1`` reported is its end.
        if gen.stats.prefill_chunks >= chunks and event.done < event.total - 1:
            called.set()
            action()

    gen.add_listener(listener)
    return called


@contextlib.contextmanager
def held(worker: mlx_notebook.Worker, timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Keep ``worker``'s thread busy in a call for the block: what is submitted in it stays queued until it ends.

    So a listener added, or a cancel made, right after a submit comes before the worker starts that
    generation: without the hold, a test thread scheduled late misses its first events (a short prompt of
    the tiny model is prefilled in milliseconds), or finds a "queued" generation already running.
    """
    started, release = threading.Event(), threading.Event()
    caller = threading.Thread(
        target=worker.call, args=(lambda store: (started.set(), release.wait(timeout)),), daemon=True
    )
    caller.start()
    assert started.wait(timeout), "the worker never took the call that holds it"
    try:
        yield
    finally:
        release.set()
        caller.join(timeout)


def assert_stays_paused(gen: mlx_notebook.Generation, meanwhile: Callable[[], Any], timeout: float = 60.0) -> int:
    """Assert that a pause requested on ``gen`` took effect and holds; return its token count.

    Waits until ``gen`` reports ``paused`` (failing if it ends first: a pause
    that lands after the last token is no pause), then runs ``meanwhile()``,
    work that takes real time on the same worker (another generation to its
    end), and checks that ``gen`` stayed ``paused`` and no token arrived.
    """
    wait_state(gen, "paused", timeout)
    arrived: list[str] = []

    def listen(event: mlx_notebook.GenerationEvent) -> None:
        if event.kind == "tokens":
            arrived.append(event.text)

    gen.add_listener(listen)
    held = gen.tokens
    try:
        meanwhile()
    finally:
        gen.remove_listener(listen)
    assert gen.state == "paused", f"generation #{gen.id} left paused by itself: {gen.state}"
    assert gen.tokens == held and not arrived, f"tokens arrived while paused: {len(held)} -> {len(gen.tokens)}"
    return len(held)


def other_generation(worker: mlx_notebook.Worker, model: str, max_tokens: int = 8) -> mlx_notebook.Generation:
    """Run a short greedy generation of ``model`` on ``worker`` to its end (work to do while another is paused)."""
    gen = mlx_notebook.generate("Meanwhile, elsewhere", model=model, worker=worker, max_tokens=max_tokens)
    gen.result(timeout=DEFAULT_TIMEOUT_S)
    assert gen.state == "done" and gen.tokens, (gen.state, gen.error)
    return gen
