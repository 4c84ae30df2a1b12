"""llguidance in a child process: the model's grammar tokenizer and every row's matcher.

Building llguidance's view of a real-size tokenizer is one native call that
holds the GIL throughout (llguidance 1.9's ``LLTokenizer.__new__`` never
releases it). Measured on the 2-core CPU with the Qwen3-size fixture (151,936
tokens, ``python -m benchmarks.grammar_gil``): 0.9-1.1 s from
``tokenizer.json`` (parsing it with the ``tokenizers`` crate ~0.55 s, the token
trie ~0.3 s, the mask slices ~0.25-0.4 s); 0.6 s even from a ready list of
token bytes. None of those pieces can be split or made to release the GIL from
Python, and the result (a Rust object) cannot be built elsewhere and handed
over. A stop needs the GIL, so it waited that long, once per model.

So the tokenizer and the matchers live in a child process (a fresh interpreter
that imports only llguidance and the standard library), which reads
``tokenizer.json`` itself. This process keeps :class:`GrammarProcess`, a
client: while the child builds, the caller polls its pipe and calls ``wait()``
(a pace's checkpoint) at least every ``_POLL_S``, so a stop or pause acts at
once; per token, one request per constrained row, or one per batch step:

* ``advance`` sends the row's token and returns; the child consumes it, sends
  an acknowledgement (whether the grammar is complete, or its error) at once,
  then computes the row's next mask and sends it (one bit per token,
  19 KB for 152k tokens);
* :meth:`GrammarProcess.done` reads the acknowledgement, :meth:`GrammarProcess.mask`
  the mask: the child computes it while this process reports the token and
  queues the next forward, in parallel (no GIL shared);
* :meth:`GrammarProcess.advance_many` sends a batch step's tokens in one
  request: the child acknowledges them all in one reply, then fills all
  their masks at once on llguidance's threads (``fill_next_token_bitmask_par``).

Replies come in request order; a read for one row first files away the replies
queued before it. The child ends when its client is garbage collected, at
interpreter exit, or when this process dies (EOF on its stdin).

Example::

    process = GrammarProcess(folder / "tokenizer.json", eos=[2])
    process.wait_ready(pace.checkpoint)
    row = process.new_matcher(grammar)
    mask = process.mask(row)          # the first token's
    process.advance(row, token); process.done(row)

This file runs in the child by path: it imports the standard library only.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

# Longest time between two ``wait()`` calls while the child builds the tokenizer.
_POLL_S = 0.005
_HEADER = struct.Struct("<Q")


class GrammarProcessError(RuntimeError):
    """The structured-output process failed or exited."""


# -- framing (both sides) ------------------------------------------------------


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int) -> bytes:
    parts = []
    while n:
        part = os.read(fd, min(n, 1 << 20))
        if not part:
            raise EOFError
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _recv(fd: int) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


# -- the child process ---------------------------------------------------------


def _serve() -> None:
    """Child main loop: build the tokenizer, then answer matcher requests until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # "Interrupt kernel" is not for this process
    out = os.dup(1)  # the protocol channel; prints from libraries go to stderr
    os.dup2(2, 1)
    inp = 0
    try:
        source, eos, path = _recv(inp)
    except EOFError:
        return
    sys.path[:] = path
    try:
        import llguidance
        import llguidance.numpy

        tokenizer = llguidance.LLTokenizer(source, eos_token=eos)
        bits = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        # Whitespace-only tokens (what a template writes after a reasoning block's end tag).
        space = bytearray(len(bits.tobytes()))
        for i in range(tokenizer.vocab_size):
            text = tokenizer.decode_bytes([i])
            if text and not text.strip() and not tokenizer.is_special_token(i):
                space[i // 8] |= 1 << (i % 8)
    except BaseException as exc:
        _send(out, ("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()))
        return
    _send(out, ("ok", tokenizer.vocab_size, bytes(space)))
    matchers: dict[int, Any] = {}

    def send_mask(row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(matchers[row], bits, 0)
        _send(out, bits.tobytes())

    executor = llguidance.LLExecutor()

    def advance_many(pairs: list[tuple[int, int]]) -> None:
        """A batch's step: every row's token consumed, their acknowledgements, then their masks, filled in parallel."""
        acks: list[tuple] = []
        ok: list[tuple[Any, int]] = []
        for i, (row, token) in enumerate(pairs):
            try:
                matcher = matchers[row]
                matcher.consume_token(token)
                if matcher.is_error():
                    acks.append(("error", matcher.get_error()))
                else:
                    acks.append(("ok", bool(matcher.is_stopped())))
                    ok.append((matcher, i))
            except BaseException as exc:  # a bug: say it, keep serving the other rows
                acks.append(("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()))
        _send(out, acks)
        many = llguidance.numpy.allocate_token_bitmask(len(pairs), tokenizer.vocab_size)
        if ok:
            # Rust threads, without the GIL: 8 rows of a 152k vocabulary cost about one row's time.
            llguidance.numpy.fill_next_token_bitmask_par(executor, ok, many)
        filled = {i for _, i in ok}
        _send(out, [many[i].tobytes() if i in filled else b"" for i in range(len(pairs))])

    while True:
        try:
            op, row, arg = _recv(inp)
        except EOFError:
            return
        if op == "many":
            advance_many(arg)
            continue
        try:
            if op == "free":
                matchers.pop(row, None)
                continue
            if op == "new":
                matcher = llguidance.LLMatcher(tokenizer, arg)
                if not matcher.is_error():
                    matchers[row] = matcher
            else:  # "advance"
                matcher = matchers[row]
                matcher.consume_token(arg)
            # Two replies: the acknowledgement at once, then the next mask (b"" after an error).
            if matcher.is_error():
                _send(out, ("error", matcher.get_error()))
                _send(out, b"")
                continue
            _send(out, ("ok", bool(matcher.is_stopped())))
            send_mask(row)
        except BaseException as exc:  # a bug: say it, keep serving the other rows
            _send(out, ("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()))
            _send(out, b"")


# -- this process --------------------------------------------------------------


class GrammarProcess:
    """One model's llguidance tokenizer and its rows' matchers, in a child process.

    Args:
        source: The model's ``tokenizer.json`` path (the child reads it), or its
          text.
        eos: The model's end-of-sequence token ids.
    """

    def __init__(self, source: str, eos: list[int]) -> None:
        self._stderr = tempfile.TemporaryFile()
        # A fresh interpreter (no fork of this multi-threaded process); run by
        # path through runpy so that only this file (stdlib imports) loads.
        boot = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__mlx_notebook_grammar_child__')['_serve']()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", boot, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            start_new_session=True,  # "Interrupt kernel" signals the kernel's process group
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None  # both PIPE
        self._out = self._proc.stdin.fileno()
        self._inp = self._proc.stdout.fileno()
        self._lock = threading.Lock()
        self._vocab: int | None = None
        self.whitespace = b""  # the whitespace-only tokens, a bitmask like :meth:`mask`'s
        self._error: str | None = None
        self._rows = 0
        # The replies not read yet, in order: (row or rows, "ack" | "mask").
        self._expected: collections.deque[tuple[int | tuple[int, ...], str]] = collections.deque()
        self._acks: dict[int, tuple] = {}  # each row's last acknowledgement
        self._masks: dict[int, bytes] = {}  # each row's next-token mask
        self._freed: list[int] = []  # rows whose matcher was dropped (sent with the next request)
        self._live: set[int] = set()
        self._finalizer = weakref.finalize(self, _close, self._proc, self._stderr)
        self._write((source, eos, list(sys.path)))

    # -- the build ----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the tokenizer is built (without waiting)."""
        if self._vocab is None and self._error is None:
            with self._lock:
                ready, _, _ = select.select([self._inp], [], [], 0)
                if ready:
                    self._read_build()
        return self._vocab is not None

    def wait_ready(self, wait: Callable[[], None] | None = None) -> None:
        """Block until the tokenizer is built, calling ``wait()`` at least every 5 ms.

        Raises:
            GrammarProcessError: The build failed (e.g. not a fast tokenizer's JSON).
            Exception: Whatever ``wait()`` raises (the build goes on for the next caller).
        """
        while self._vocab is None and self._error is None:
            if wait is not None:
                wait()
            with self._lock:
                if self._vocab is not None or self._error is not None:
                    break
                ready, _, _ = select.select([self._inp], [], [], _POLL_S)
                if ready:
                    self._read_build()
        if self._error is not None:
            raise GrammarProcessError(f"structured output: llguidance could not read the tokenizer: {self._error}")

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (waits for the build)."""
        self.wait_ready()
        assert self._vocab is not None
        return self._vocab

    def _read_build(self) -> None:
        reply = self._read()
        if reply[0] == "ok":
            self._vocab, self.whitespace = reply[1], reply[2]
        else:
            self._error = reply[1]

    # -- rows -------------------------------------------------------------------

    def new_matcher(self, grammar: str) -> int:
        """A new row's matcher for ``grammar``; its first mask is computed at once.

        Raises:
            RuntimeError: llguidance refused the grammar.
        """
        self.wait_ready()
        with self._lock:
            self._rows += 1
            row = self._rows
            self._live.add(row)
            self._request("new", row, grammar)
            reply = self._ack(row)
        if reply[0] != "ok":
            self.free(row)
            raise RuntimeError(f"structured output: {_first_line(reply[1])}")
        return row

    def advance(self, row: int, token: int) -> None:
        """Feed ``row``'s matcher ``token`` (returns at once; the child then computes the next mask)."""
        with self._lock:
            self._request("advance", row, token)

    def advance_many(self, pairs: list[tuple[int, int]]) -> None:
        """Feed several rows their tokens in one request (a batch's step; returns at once).

        The child answers with every row's acknowledgement, then every row's
        next mask, computed in parallel: one round trip per step instead of
        one per row, each waiting for the masks of the rows before it.
        """
        if not pairs:
            return
        with self._lock:
            self._drop_freed()
            rows = tuple(row for row, _ in pairs)
            for row in rows:
                self._acks.pop(row, None)
                self._masks.pop(row, None)
            self._expected.append((rows, "ack"))
            self._expected.append((rows, "mask"))
            self._write(("many", 0, list(pairs)))

    def done(self, row: int) -> bool:
        """Whether ``row``'s grammar is complete after its last token.

        Raises:
            RuntimeError: The matcher refused the token (a bug: the mask allowed it).
        """
        with self._lock:
            reply = self._ack(row)
        if reply[0] != "ok":
            raise RuntimeError(f"structured output: {_first_line(reply[1])}")
        return bool(reply[1])

    def mask(self, row: int) -> bytes:
        """``row``'s next-token bitmask (llguidance's layout: 32-bit words, bit ``i % 32`` of word ``i // 32``)."""
        self.done(row)  # raises the row's error
        with self._lock:
            return self._mask(row)

    def free(self, row: int) -> None:
        """Forget ``row``'s matcher (safe from a finalizer: sent with the next request)."""
        self._freed.append(row)

    # -- the pipe (callers hold the lock) ----------------------------------------------------

    def _drop_freed(self) -> None:
        while self._freed:
            gone = self._freed.pop()
            self._live.discard(gone)
            self._acks.pop(gone, None)
            self._masks.pop(gone, None)
            self._write(("free", gone, None))

    def _request(self, op: str, row: int, arg: Any) -> None:
        self._drop_freed()
        # Every "new" and "advance" gets two replies: the acknowledgement, then the mask.
        self._acks.pop(row, None)
        self._masks.pop(row, None)
        self._expected.append((row, "ack"))
        self._expected.append((row, "mask"))
        self._write((op, row, arg))

    def _ack(self, row: int) -> tuple:
        if row not in self._acks:
            self._read_until(row, "ack")
        return self._acks[row]

    def _mask(self, row: int) -> bytes:
        if row not in self._masks:
            self._read_until(row, "mask")
        return self._masks[row]

    def _read_until(self, row: int, kind: str) -> None:
        """Read replies up to ``row``'s ``kind``, filing the others' away."""
        while self._expected:
            who, what = self._expected.popleft()
            reply = self._read()
            # One row's reply, or a list of them for a step of several rows (advance_many).
            rows, replies = (who, reply) if isinstance(who, tuple) else ((who,), [reply])
            filed = self._acks if what == "ack" else self._masks
            for one, answer in zip(rows, replies):
                if one in self._live:
                    filed[one] = answer
            if row in rows and what == kind:
                return
        raise GrammarProcessError(f"structured output: no {kind} pending for row {row} (a bug)")

    def _write(self, message: tuple) -> None:
        try:
            _send(self._out, message)
        except OSError as exc:
            raise self._died() from exc

    def _read(self) -> Any:
        try:
            return _recv(self._inp)
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _died(self) -> GrammarProcessError:
        try:
            code = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        tail = ""
        try:
            self._stderr.seek(0, io.SEEK_END)
            self._stderr.seek(max(0, self._stderr.tell() - 4000))
            tail = self._stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            pass
        return GrammarProcessError(
            f"the structured-output process exited (code {code})" + (f":\n{tail}" if tail else "")
        )

    def close(self) -> None:
        """End the child now."""
        self._finalizer()


def _close(proc: subprocess.Popen[bytes], stderr: Any) -> None:
    """End the child (EOF on its stdin, then a kill); reap it on a daemon thread."""
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
    if proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass
        threading.Thread(target=_reap, args=(proc,), name="mlx-notebook-grammar-reap", daemon=True).start()
    try:
        stderr.close()
    except OSError:
        pass


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=30.0)  # waitpid releases the GIL
    except Exception:
        pass


__all__ = ["GrammarProcess", "GrammarProcessError"]


def _first_line(message: object) -> str:
    """llguidance's errors go on with the parser's state over many lines: the first says what failed."""
    lines = str(message).strip().splitlines()
    return lines[0] if lines else "llguidance failed"
