"""Cut streamed Markdown into blocks that are complete and one block still open.

A model's answer grows a few characters at a time. Rendering all of it again on
every update costs O(length) each time, O(length²) over the answer; here the
text is scanned once, line by line, and cut at blank lines that end a block, so
a display renders each completed block once and re-renders only the open one.
No IPython or ipywidgets here: the widget (:mod:`.markdown_view`) and the
final output both use it.

Where a blank line does *not* end a block:

* inside a fenced code block (```` ``` ```` or ``~~~``) or a ``$$`` math block;
* before an indented line (a list item's continuation, indented code);
* between two items of the same list (a loose list stays one list, so its
  numbering and spacing do not change when the answer is complete).

Example::

    blocks = MarkdownBlocks()
    done, open_block = blocks.feed("# Title\\n\\nSome text")
    # done == ["# Title\\n\\n"], open_block == "Some text"
"""

from __future__ import annotations

import re

# A fence line: ``` or ~~~ and an info string without backticks, or "$$" alone.
_FENCE = re.compile(r"^[ \t]*(?:(`{3,}|~{3,})[^`\n]*|(\$\$)[ \t]*)\n?$")
_LIST_ITEM = re.compile(r"^[ \t]*(?:([-*+])|\d+([.)]))[ \t]")


def _list_marker(line: str) -> str | None:
    """``-``, ``*``, ``+``, ``.`` or ``)`` for a list item line, else ``None``."""
    m = _LIST_ITEM.match(line)
    return (m.group(1) or m.group(2)) if m else None


class MarkdownBlocks:
    """Incremental block splitter for text that only grows.

    :meth:`feed` takes the whole text so far and returns the blocks completed
    since the last call plus the open trailing block. Each character is scanned
    once; the joined blocks are exactly the text (separators included).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything (the next :meth:`feed` starts from the beginning)."""
        self._text = ""
        self._committed = 0  # text[:_committed] is in completed blocks
        self._scanned = 0  # start of the first line not scanned yet
        self._fence = ""  # the open fence's marker, "" outside one
        self._break_at = -1  # end of the blank lines that may end the block, -1 if none
        self._block_list = ""  # the list marker of the open block's first line
        self._block_started = False  # whether the open block has a non-blank line

    @property
    def open_fence(self) -> str:
        """The marker of the fenced block the scanned text ends in (``""`` if none)."""
        return self._fence

    def feed(self, text: str) -> tuple[list[str], str]:
        """Scan the new complete lines of ``text``.

        Args:
            text: The whole text so far. If it does not extend the previous
              text (it never should), scanning starts again from the beginning.

        Returns:
            ``(completed, open_block)``: the blocks completed by this call, in
            order, and the text after them.
        """
        if not text.startswith(self._text[: self._scanned]):
            self.reset()
        self._text = text
        completed: list[str] = []
        while True:
            end = text.find("\n", self._scanned)
            if end < 0:
                break
            start, self._scanned = self._scanned, end + 1
            cut = self._scan_line(text[start : end + 1], start)
            if cut is not None:
                completed.append(text[self._committed : cut])
                self._committed = cut
        # A block ends as soon as the next one has begun: the first character of
        # the line after the blank ones says (unless a list may go on: "1" can
        # still become "1.", so that waits for the whole line).
        rest = text[self._scanned :]
        if self._break_at >= 0 and not self._block_list and rest[:1] and not rest[0].isspace():
            completed.append(text[self._committed : self._break_at])
            self._committed, self._break_at = self._break_at, -1
            self._block_started = False  # its first line is scanned once complete
        return completed, text[self._committed :]

    def _scan_line(self, line: str, start: int) -> int | None:
        """Take in one complete line; return where a block ends if it ends before it."""
        if self._fence:
            if line.strip().startswith(self._fence) and not line.strip().strip(self._fence[0]):
                self._fence = ""
            return None
        if not line.strip():
            if self._block_started:  # blank lines before a block's first line belong to it
                self._break_at = start + len(line)
            return None
        cut = None
        marker = _list_marker(line)
        if self._break_at >= 0:
            indented = line[0] in " \t"
            same_list = bool(self._block_list) and marker == self._block_list
            if not indented and not same_list:
                cut = self._break_at
            self._break_at = -1
        if cut is not None or not self._block_started:
            self._block_list = marker or ""
            self._block_started = True
        fence = _FENCE.match(line)
        if fence:
            self._fence = fence.group(1) or fence.group(2)
        return cut


def close_fence(text: str) -> str:
    """``text`` with its last fenced block closed, if it ends inside one.

    A stopped answer can end in the middle of a code block; closing it keeps
    what follows it (a status line) out of the code.
    """
    blocks = MarkdownBlocks()
    blocks.feed(text if text.endswith("\n") else text + "\n")
    fence = blocks.open_fence
    if not fence:
        return text
    return f"{text}{'' if text.endswith(chr(10)) else chr(10)}{fence}"
