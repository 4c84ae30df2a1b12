"""The device taken in turns by a joining prompt's prefill thread and the worker's decode steps.

Two plain threads play the two sides (no MLX: what is tested is the hand-over),
each marking when it holds the device; a real join through the library, with
the prefill thread forced on the CPU, checks the wiring, and a product on a
second MLX stream the gated hand-over's one use. Every wait here has a
deadline.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx

import mlx_notebook
from mlx_notebook.generation import session as session_module
from mlx_notebook.generation.device_turns import DeviceTurns
from testkit.waiting import wait_tokens

DEADLINE_S = 30


class Held:
    """Who holds the device, checked on every entry: two holders at once are recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: str | None = None
        self.overlaps: list[tuple[str, str]] = []
        self.order: list[str] = []

    def enter(self, who: str) -> None:
        with self.lock:
            if self.holder is not None:
                self.overlaps.append((self.holder, who))
            self.holder = who
            self.order.append(who)

    def leave(self, who: str) -> None:
        with self.lock:
            if self.holder == who:
                self.holder = None


def run_side(turns: DeviceTurns, held: Held, pieces: int, piece_s: float, stop: threading.Event) -> None:
    """The prefill thread's part: a checkpoint, then a piece holding the device, ``pieces`` times."""
    for _ in range(pieces):
        turns.side_checkpoint(stop.is_set)
        if stop.is_set():
            break
        held.enter("side")
        time.sleep(piece_s)  # the piece's device time
        held.leave("side")
    turns.close()


def run_worker(turns: DeviceTurns, held: Held, done: threading.Event, step_s: float) -> None:
    """The worker's part: steps in turns until the side is done."""
    deadline = time.monotonic() + DEADLINE_S
    while not done.is_set() and time.monotonic() < deadline:
        with turns.worker_turn():
            held.enter("worker")
            time.sleep(step_s)  # the step's device time
            held.leave("worker")


def run_both(turns: DeviceTurns, pieces: int, piece_s: float, step_s: float) -> Held:
    """The prompt's ``pieces`` on this thread while a worker thread steps; who held the device, in order."""
    held, done = Held(), threading.Event()
    worker = threading.Thread(target=run_worker, args=(turns, held, done, step_s))
    worker.start()
    run_side(turns, held, pieces=pieces, piece_s=piece_s, stop=threading.Event())
    done.set()
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    return held


def test_a_piece_and_a_step_alternate_and_never_hold_the_device_together():
    # The prompt hands over at every checkpoint (slice 0); waits long enough never to run out here.
    turns = DeviceTurns(slice_s=0.0, worker_wait_s=5.0, side_wait_s=5.0)
    held = run_both(turns, pieces=20, piece_s=0.002, step_s=0.002)
    assert held.overlaps == []
    assert turns.counts.side_timeouts == 0 and turns.counts.worker_timeouts == 0
    sides = [i for i, who in enumerate(held.order) if who == "side"]
    assert len(sides) == 20
    # Between two of the prompt's pieces, exactly one of the others' steps.
    for a, b in zip(sides, sides[1:]):
        assert held.order[a + 1 : b] == ["worker"], held.order


def test_the_prompt_holds_the_device_for_its_slice_then_hands_it_over():
    turns = DeviceTurns(slice_s=0.05, worker_wait_s=5.0, side_wait_s=5.0)
    held = run_both(turns, pieces=40, piece_s=0.005, step_s=0.001)
    assert held.overlaps == []
    runs, run = [], 0
    for who in held.order:
        if who == "side":
            run += 1
        elif run:
            runs.append(run)
            run = 0
    # 5 ms pieces against a 50 ms slice: several pieces a turn, not one.
    assert max(runs) >= 5 and len(runs) >= 3, runs
    # The hold is counted from the take to the hand-over: a slice at least, and a piece past it at most
    # (a loose ceiling: a busy machine may stretch a sleep).
    counts = turns.counts
    assert 0.05 <= counts.side_hold_max_s < 2.0, counts
    assert counts.worker_wait_max_s >= 0.005, counts  # the worker waited out at least one piece
    assert counts.worker_wait_s >= counts.worker_wait_max_s and counts.side_wait_s >= counts.side_wait_max_s


def test_the_worker_waits_at_most_its_bound_for_a_piece_that_runs_long():
    turns = DeviceTurns(slice_s=0.0, worker_wait_s=0.05, side_wait_s=5.0)
    turns.side_checkpoint(lambda: False)  # the prompt takes the device and keeps it (a long build)
    t0 = time.monotonic()
    with turns.worker_turn():
        waited = time.monotonic() - t0
    assert 0.04 <= waited < 2.0
    assert turns.counts.worker_timeouts == 1
    # The wait and the prompt's hold it ended are both counted, and read as long as the wait measured here.
    assert 0.04 <= turns.counts.worker_wait_max_s <= waited
    assert turns.counts.side_hold_max_s >= turns.counts.worker_wait_max_s


def test_the_prompt_hands_over_as_its_drain_was_told_not_as_the_clock_reads_later():
    # The layer hook asks due() before it drains, the checkpoint comes after: a slice that ran out between the
    # two must not hand the device over with a piece still queued.
    turns = DeviceTurns(slice_s=0.05, worker_wait_s=5.0, side_wait_s=0.05)
    turns.side_checkpoint(lambda: False)  # takes the device (nobody else wants it)
    assert turns.counts.side_turns == 1
    assert not turns.due()  # just taken: the hook keeps its next group queued
    time.sleep(0.1)  # the slice runs out before the checkpoint
    turns.side_checkpoint(lambda: False)
    assert turns.counts.side_turns == 1 and turns.counts.side_timeouts == 0, "handed over with work queued"
    # Asked again at the next group, it is due: the hook drains, and the checkpoint hands over (and, no worker
    # here to step, takes the device back once its wait runs out).
    assert turns.due()
    turns.side_checkpoint(lambda: False)
    assert turns.counts.side_turns == 2 and turns.counts.side_timeouts == 1
    assert turns.counts.side_hold_max_s >= 0.1


def test_ahead_pieces_near_the_slice_hand_over_before_the_hold_passes_it():
    # Pieces of 0.3 s against a 0.5 s slice: handing over at the first ask past the slice holds the device for
    # two pieces (0.6 s, past the worker's wait of a budget); ahead, read from their pace, one piece a turn.
    turns = DeviceTurns(slice_s=0.5, worker_wait_s=5.0, side_wait_s=5.0, ahead=True)
    turns.pass_turn()  # no step of the others to wait for: the prompt takes the device back at once
    turns.side_checkpoint(lambda: False)
    for _ in range(5):
        turns.due()  # the hook's ask, after it waited for the piece before
        turns.side_checkpoint(lambda: False)
        time.sleep(0.3)  # a piece on the device (the hook waits for it before its next ask)
    counts = turns.counts
    assert counts.side_turns >= 4, counts  # after the first piece's pace is known, a hand-over every piece
    assert 0.25 <= counts.side_hold_max_s < 0.5, counts
    assert 0.25 <= turns.piece_s < 0.5


def test_a_stop_of_the_prompt_ends_its_wait_for_the_others_at_once():
    turns = DeviceTurns(slice_s=0.0, worker_wait_s=5.0, side_wait_s=DEADLINE_S)
    stop = threading.Event()
    turns.side_checkpoint(stop.is_set)  # holds the device
    ended = threading.Event()
    inside = threading.Event()

    def side() -> None:
        inside.set()
        turns.side_checkpoint(stop.is_set)  # hands it over and waits for one of the others' steps: none comes
        ended.set()

    thread = threading.Thread(target=side)
    thread.start()
    assert inside.wait(DEADLINE_S)
    assert not ended.wait(0.1), "the prompt did not wait for the others' step"
    stop.set()
    turns.wake()  # what the prompt's token watcher does at a stop
    assert ended.wait(2.0), "the stop did not end the wait"
    thread.join(DEADLINE_S)
    assert turns.counts.side_timeouts == 0


def test_an_idle_worker_does_not_hold_the_prompt_up():
    turns = DeviceTurns(slice_s=0.0, worker_wait_s=5.0, side_wait_s=DEADLINE_S)
    turns.pass_turn()  # every other row is paused: no step will come
    t0 = time.monotonic()
    for _ in range(10):
        turns.side_checkpoint(lambda: False)
    assert time.monotonic() - t0 < 2.0
    assert turns.counts.side_turns == 10 and turns.counts.side_timeouts == 0


def test_a_prompt_joining_on_the_prefill_thread_takes_the_device_in_turns(side_worker, tiny_model, monkeypatch):
    made: list[DeviceTurns] = []

    def spy(**kwargs):
        turns = DeviceTurns(**kwargs)
        made.append(turns)
        return turns

    monkeypatch.setattr(session_module, "DeviceTurns", spy)
    prompt = "Once upon a time the quick brown fox"
    long_prompt = [(41 * i) % 250 + 20 for i in range(1500)]
    rows = [mlx_notebook.generate(prompt, model=tiny_model, worker=side_worker, max_tokens=100_000) for _ in range(2)]
    for row in rows:
        wait_tokens(row, 3)
    joiner = mlx_notebook.generate(long_prompt, model=tiny_model, worker=side_worker, max_tokens=4, stop_budget=0.02)
    joiner.result(timeout=120)
    for row in rows:
        row.cancel()
    for row in rows:
        assert row.wait(60)
    assert joiner.stats.batch_size == 3
    assert len(made) == 1
    counts = made[0].counts
    assert counts.side_turns >= 2 and counts.worker_turns >= 2, counts
    # Its hand-overs left its last layer groups queued, the others' steps queued behind them on the device.
    assert session_module.TURNS_GATED and counts.side_gates >= 1, counts


def test_a_gated_hand_over_is_taken_by_the_next_step_of_the_others_once():
    # The prompt's thread leaves its last queued work (here a product on its own stream) at a hand-over; the
    # worker's next turn queues a wait on that work's mark on its stream, then drops it: the turn after is free.
    turns = DeviceTurns(slice_s=0.0, worker_wait_s=1.0, side_wait_s=1.0)
    side = mx.new_stream(mx.default_device())
    with mx.stream(side):
        last = mx.ones((256, 256)) @ mx.ones((256, 256))
        mx.async_eval(last)
        turns.gate(last)
    assert turns.counts.side_gates == 1 and turns._gate is not None
    with turns.worker_turn():
        step = mx.sum(mx.ones((4,)))
        mx.eval(step)
    assert turns._gate is None and step.item() == 4.0
    with turns.worker_turn():
        pass
    assert turns.counts.worker_turns == 2 and turns.counts.side_gates == 1
    assert last[0, 0].item() == 256.0  # the prompt's work itself is untouched by the wait on its mark
