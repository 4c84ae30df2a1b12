"""How long a prompt fed in turn keeps the worker before the decoding rows' next step.

A prompt that joins decoding rows on the worker thread (the CPU, and Apple
GPUs) is fed a piece at a time; at each piece boundary the session runs the
others' next step once the prompt's turn has passed (:meth:`.Session.between`).
The others' gap between two tokens is then the turn, the piece that passes it,
and their step: it must stay within a budget and two of their steps.

A turn of half a budget keeps that bound with room to spare wherever a step is
short, but where a step costs more than the budget (a CPU) the prompt gets a
small share of the machine: on this project's 2-core CPU a 1,000-token prompt
of a Qwen3-0.6B shape, joining three rows of 300-ms steps, took 58-67 s to its
first token against 13 s alone. A fixed turn of one step was tried (session
45): the joiner came 2.5x sooner, but the others' gap went past the bound in 5
of 6 joins, because what follows a turn is not one pre-join step: the piece
that passes the turn overruns it by up to a piece, and a step right after a
piece ran slower (~380 against ~300 ms).

So the turn is fitted to what the gaps show, and a piece does not pass it:
- the others step at the boundary where the next piece, taken as long as the
  longest of the last four, would end past the turn (a piece right after
  their step came 25-32 ms, the next ~120 ms: the last one alone is a poor
  guess), so the turn's own time stays within it;
- each step the session runs at a boundary (but the first, queued before the
  prompt began) gives the time from that boundary to the others' token:
  their step after a piece, and whatever else ran. The largest of the last
  ``OVERHEAD_WINDOW`` such times, plus a quarter of a step for a slower one
  not seen yet, is the overhead. The largest of the whole prompt kept a
  process's first join at half a budget throughout: its first ~22 steps
  after a piece ran ~160 ms (a layer of the join's buffers zeroed in their
  gap, on new memory: queued after their step since session 55), the rest
  ~100-130, and a 3,000-token prompt of
  the default model beside three rows took 118-124 s to its first token
  against 61-81 s for the process's second (session 54, 2-core CPU). With
  the window its first token came in 69-75 s, first join or second (before,
  alternated: 121-125 s first, 82 and 120 second), the others' longest gap
  no longer (3 of 4 joins within the bound against 2 of 4);
- the next turn is what the bound leaves after that overhead, less half a
  budget, and never less than half a budget, the turn before this module;
  it keeps half a budget until three steps were seen at boundaries.
A long step gives a long turn; a slower step shrinks it at the next boundary.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from collections import deque

from ..budget import OTHERS_STEP_SHARE, TURN_MARGIN_SHARE, TURN_STEP_SLACK

# Steps at boundaries counted before a turn grows past half a budget: a prompt's first
# pieces are small (the chunk planner starts from a probe) and grow over its first
# chunks, so a piece's length and a step's overhead read then are short. Fitted to the
# first two, a turn let the others' gap reach 711 ms against 705 (a 101-ms piece after
# 37-ms ones, three rows of a Qwen3-0.6B shape on 2 cores).
SEEN_BEFORE_GROWING = 3

# Steps at boundaries the overhead is the longest of: a slow start or one stall ages out of
# it after this many (a few seconds of a CPU join), while a cost that grows with the
# prompt's length is tracked at once (each new step is in the window).
OVERHEAD_WINDOW = 32


class PromptTurn:
    """The turn of one prompt fed in turn (or one inline call run in pieces): fitted to the others' gaps."""

    def __init__(self) -> None:
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_WINDOW)  # from a boundary to the others' token
        self.turns = 0
        self._left_at = 0.0  # when the last boundary was left (time.perf_counter): the next piece starts there
        self._pieces: deque[float] = deque(maxlen=4)

    @property
    def overhead_s(self) -> float | None:
        """The longest time from a boundary to the others' token of the last steps counted."""
        return max(self._overheads, default=None)

    @staticmethod
    def floor(budget_s: float) -> float:
        """The shortest turn: half a budget (the others' gap stays near the budget where steps are short)."""
        return budget_s * OTHERS_STEP_SHARE

    def length(self, budget_s: float, step_s: float | None) -> float:
        """Seconds the prompt keeps the worker from the others' last token before their next step.

        ``budget_s``: the smallest stop budget of the decoding rows; ``step_s``:
        their step's time before the join (the shortest of their last steps),
        ``None`` before one was timed.
        """
        floor = self.floor(budget_s)
        if step_s is None or self.overhead_s is None or self.turns <= SEEN_BEFORE_GROWING:
            return floor
        overhead = self.overhead_s + step_s * TURN_STEP_SLACK
        return max(floor, budget_s + 2 * step_s - budget_s * TURN_MARGIN_SHARE - overhead)

    def piece(self, seconds: float) -> None:
        """A piece of the prompt took ``seconds`` (from one boundary to the next)."""
        self._pieces.append(seconds)

    def reached(self, now: float) -> None:
        """A boundary came at ``now`` (time.perf_counter): the piece since the last one left is counted."""
        if self._left_at:
            self.piece(now - self._left_at)

    def left(self, now: float) -> None:
        """The boundary is left at ``now``: the next piece starts."""
        self._left_at = now

    def due(self, elapsed_s: float, budget_s: float, step_s: float | None) -> bool:
        """Whether the others step now, ``elapsed_s`` after their last token: the next piece would end past the turn."""
        return elapsed_s + max(self._pieces, default=0.0) >= self.length(budget_s, step_s)

    def stepped(self, overhead_s: float) -> None:
        """The others stepped at a boundary; their token came ``overhead_s`` after it.

        The first such step of a prompt is not counted: the loop queued it
        before the prompt's first piece, so it ran beside that piece and its
        token came early (247 ms after the boundary, then 386 for a held step,
        three rows of a Qwen3-0.6B shape on 2 cores; a turn fitted to the
        first let the others' gap reach 668 ms against 684).
        """
        self.turns += 1
        if self.turns == 1:
            return
        self._overheads.append(overhead_s)


__all__ = ["PromptTurn"]
