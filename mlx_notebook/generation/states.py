"""The states a generation goes through, as one enum.

::

    queued -> loading -> prefilling -> decoding -> done
                 \\            \\            \\
                  +---- paused (and back) ---+
    any of them -> stopped | failed

``State`` is a ``str`` enum, so ``gen.state == "done"`` keeps working.
"""

from __future__ import annotations

from ..text_enum import TextEnum


class State(TextEnum):
    """One state of a generation."""

    QUEUED = "queued"
    LOADING = "loading"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PAUSED = "paused"
    STOPPED = "stopped"
    DONE = "done"
    FAILED = "failed"

    @property
    def running(self) -> bool:
        """Doing work on the device: loading, prefilling or decoding."""
        return self in RUNNING

    @property
    def final(self) -> bool:
        """Stopped, done or failed: nothing will change any more."""
        return self in FINAL

    @property
    def stoppable(self) -> bool:
        """Queued, running or paused: a stop still has something to do."""
        return not self.final


RUNNING = frozenset({State.LOADING, State.PREFILLING, State.DECODING})
FINAL = frozenset({State.STOPPED, State.DONE, State.FAILED})
