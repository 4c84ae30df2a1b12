"""``TextEnum``: a ``str`` enum that reads, prints and compares as its value.

States and reasons were bare strings before they were enums; users compare
``gen.state == "done"``, format it, and see it in a cell's output. A member
behaves as its text in all three, and is still typed.
"""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """A ``str`` enum whose ``str``, ``format`` and ``repr`` are those of its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        # What users wrote before there was an enum; also ast.literal_eval-able.
        return repr(self.value)
