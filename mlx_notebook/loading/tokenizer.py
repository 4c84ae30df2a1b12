"""Load a model's tokenizer without long GIL holds in this process.

Building a real-size Hugging Face tokenizer (Qwen3: 151,936 tokens; Llama 3:
128,256) holds the GIL for 100-400 ms at a stretch on a 2-core CPU, in single
native calls that no caller can split: ``tokenizers.Tokenizer.from_file`` /
``from_buffer`` / ``models.BPE(vocab, merges)`` (140-400 ms; tokenizers 0.23
releases the GIL only in encode/decode-batch and training), each
``Tokenizer.get_vocab`` (100-130 ms, mlx-lm calls it three times), the token
map of mlx-lm's ``BPEStreamingDetokenizer`` (~120 ms), ``json.load`` of the
9.5 MB ``tokenizer.json`` (~60 ms read + scan) and the full garbage
collections all those objects trigger (40-65 ms each). Even dropping a
finished Rust tokenizer holds it 30-42 ms. A stop needs the GIL (the caller's
``cancel()``, the worker's checkpoint, ``wait()`` returning), so any of these
in this process delays a stop by as much.

So the tokenizer is built and kept in a child process (a fresh interpreter
running mlx-lm's own ``mlx_lm.utils.load_tokenizer``), and this process gets a
:class:`RemoteTokenizerWrapper`: a real ``TokenizerWrapper`` subclass whose
wrapper state (eos ids, thinking and tool-call markers, chat-template hooks) is
copied from the child's wrapper, whose streaming detokenizer is the child's
detokenizer rebuilt here (its token map sent in small chunks), and whose
Hugging Face tokenizer is a proxy that runs every call (``encode``,
``decode``, ``apply_chat_template``, attribute reads) in the child over a
pipe. Same classes, same code, same ids and text as a plain
``mlx_lm.utils.load_tokenizer``; encode/decode cost one pipe round trip
(~0.1-0.3 ms) each.

While the child loads, this process only polls the pipe and calls ``wait()``
at least every ``_POLL_S``; when ``wait()`` raises, the child is killed and
the exception propagates. The child ends when its wrapper is garbage
collected, at interpreter exit, or when this process dies (EOF on its stdin).

Example::

    tok = load_tokenizer(folder, config.get("eos_token_id"), wait=pace.checkpoint)
    ids = tok.encode("Hello")
"""

from __future__ import annotations

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
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# Longest time between two ``wait()`` calls while loading.
_POLL_S = 0.005
# Token-map strings per message: unpickling one chunk holds the GIL ~1 ms.
_CHUNK = 4096
_HEADER = struct.Struct("<Q")


class TokenizerProcessError(RuntimeError):
    """The tokenizer's child process failed or exited."""


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


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return True
    except Exception:
        return False


def _error(exc: BaseException) -> tuple:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ("error", exc if _picklable(exc) else None, text)


def _serve() -> None:
    """Child main loop: load, describe the wrapper, then answer calls until EOF."""
    # A kernel interrupt is SIGINT to the kernel's whole process group: it is
    # not for the tokenizer (the new session below keeps most of them away).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.dup(1)  # the protocol channel; prints from libraries go to stderr
    os.dup2(2, 1)
    inp = 0
    try:
        folder, eos_token_ids, path = _recv(inp)
    except EOFError:
        return
    sys.path[:] = path
    try:
        from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

        wrapper = mlx_load_tokenizer(Path(folder), eos_token_ids=eos_token_ids)
        tok = wrapper._tokenizer
        detok = wrapper._detokenizer
        state = {k: v for k, v in vars(wrapper).items() if k not in ("_tokenizer", "_detokenizer")}
        bad = [k for k, v in state.items() if not _picklable(v)]
        if bad:
            raise TypeError(f"tokenizer wrapper state not transferable: {bad}")
        dstate = {}
        tokenmap = None
        for k, v in vars(detok).items():
            if k == "tokenmap":
                tokenmap = v
            elif v is tok:
                dstate[k] = _SLOT
            else:
                dstate[k] = v
        if not _picklable(dstate) or not _picklable(type(detok)):
            raise TypeError(f"detokenizer {type(detok).__name__} not transferable")
    except BaseException as exc:
        _send(out, _error(exc))
        return
    n = len(tokenmap) if tokenmap is not None else -1
    _send(out, ("ok", state, type(detok), dstate, n))
    if tokenmap is not None:
        for i in range(0, n, _CHUNK):
            _send(out, tokenmap[i : i + _CHUNK])
    while True:
        try:
            req = _recv(inp)
        except EOFError:
            return
        try:
            op = req[0]
            if op == "call":
                _, name, args, kwargs = req
                fn = tok if name is None else getattr(tok, name)
                reply = ("ok", fn(*args, **kwargs))
            elif op == "getattr":
                value = getattr(tok, req[1])
                if callable(value) and not isinstance(value, type):
                    reply = ("callable", None)
                else:
                    reply = ("ok", value)
            elif op == "setattr":
                setattr(tok, req[1], req[2])
                reply = ("ok", None)
            elif op == "len":
                reply = ("ok", len(tok))
            elif op == "repr":
                reply = ("ok", repr(tok))
            else:
                reply = ("ok", None)
            try:
                _send(out, reply)
            except Exception as exc:  # unpicklable result
                _send(out, ("error", None, f"result of {req[:2]!r} cannot be sent: {exc!r}"))
        except BaseException as exc:
            _send(out, _error(exc))


# Stands for the tokenizer inside a transferred detokenizer's state.
_SLOT = "\x00mlx_notebook.loading.tokenizer:tokenizer\x00"


# -- this process --------------------------------------------------------------


class _Child:
    """One tokenizer process and its pipes; calls are serialized by a lock."""

    def __init__(self) -> None:
        self.stderr = tempfile.TemporaryFile()
        # A fresh interpreter (no fork of this multi-threaded process). Running
        # this file by path would put mlx_notebook/loading first on sys.path, so
        # the child runs it through runpy from ``-c``.
        boot = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__mlx_notebook_tokenizer_child__')['_serve']()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            bufsize=0,
            # Its own process group: "Interrupt kernel" signals the kernel's group.
            # It still ends with this process (EOF on its stdin).
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.out = self.proc.stdin.fileno()
        self.inp = self.proc.stdout.fileno()
        self.lock = threading.Lock()

    def stderr_tail(self, limit: int = 4000) -> str:
        try:
            self.stderr.seek(0, io.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - limit))
            return self.stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def recv(self) -> Any:
        try:
            return _recv(self.inp)
        except (EOFError, OSError) as exc:
            raise self.died() from exc

    def died(self) -> TokenizerProcessError:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        tail = self.stderr_tail().strip()
        return TokenizerProcessError(f"the tokenizer process exited (code {code})" + (f":\n{tail}" if tail else ""))

    def wait_readable(self, wait: Callable[[], None]) -> None:
        """Block until a message can be read, calling ``wait()`` every ``_POLL_S``."""
        while True:
            wait()
            ready, _, _ = select.select([self.inp], [], [], _POLL_S)
            if ready:
                return

    def request_raw(self, *req: Any) -> tuple:
        with self.lock:
            try:
                _send(self.out, req)
            except OSError as exc:
                raise self.died() from exc
            return self.recv()

    def request(self, *req: Any) -> Any:
        return _unwrap(self.request_raw(*req))

    def close(self) -> None:
        _close(self.proc, self.stderr)


def _close(proc: subprocess.Popen[bytes], stderr: IO[bytes]) -> None:
    """End the child now; reap it on a daemon thread (its exit takes ~10-30 ms)."""
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
        threading.Thread(target=_reap, args=(proc,), name="mlx-notebook-tokenizer-reap", daemon=True).start()
    try:
        stderr.close()
    except OSError:
        pass


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=30.0)  # waitpid releases the GIL
    except Exception:
        pass


def _unwrap(reply: tuple) -> Any:
    if reply[0] == "error":
        _, exc, text = reply
        if isinstance(exc, BaseException):
            raise exc
        raise TokenizerProcessError(text)
    return reply[1]


class _RemoteMethod:
    __slots__ = ("_child", "_name")

    def __init__(self, child: _Child, name: str | None) -> None:
        self._child = child
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.request("call", self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<remote tokenizer method {self._name}>"


class RemoteTokenizer:
    """The Hugging Face tokenizer living in the child process.

    Attribute reads return the child's value (or a callable that runs the
    method there); attribute writes go to the child.
    """

    def __init__(self, child: _Child) -> None:
        object.__setattr__(self, "_child", child)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        reply = self._child.request_raw("getattr", name)
        if reply[0] == "callable":
            return _RemoteMethod(self._child, name)
        return _unwrap(reply)

    def __setattr__(self, name: str, value: Any) -> None:
        self._child.request("setattr", name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._child.request("call", None, args, kwargs)

    def __len__(self) -> int:
        return self._child.request("len")

    def __repr__(self) -> str:
        return f"RemoteTokenizer({self._child.request('repr')}, pid={self._child.proc.pid})"

    def __reduce__(self):
        raise TypeError("a RemoteTokenizer cannot be pickled")


def _make_wrapper_class():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    class RemoteTokenizerWrapper(TokenizerWrapper):
        """mlx-lm's ``TokenizerWrapper`` around a :class:`RemoteTokenizer`.

        Built by :func:`load_tokenizer`, not by calling the class.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover
            raise TypeError("use mlx_notebook.loading.tokenizer.load_tokenizer")

        @property
        def alive(self) -> bool:
            """Whether the child process still runs (it can be killed from outside)."""
            return self._tokenizer._child.proc.poll() is None

        @property
        def process_id(self) -> int:
            """The pid of the tokenizer's child process."""
            return self._tokenizer._child.proc.pid

        def close(self) -> None:
            """End the child process now (later calls fail)."""
            self._tokenizer._child.close()

    return RemoteTokenizerWrapper


_wrapper_class = None


def load_tokenizer(folder: Path, eos_token_ids: Any, *, wait: Callable[[], None]) -> Any:
    """Load ``folder``'s tokenizer as ``mlx_lm.utils.load_tokenizer`` would.

    Args:
        folder: A local model folder (``tokenizer.json``, ``tokenizer_config.json``...).
        eos_token_ids: As for mlx-lm (``None``, an id or a list of ids).
        wait: Called at least every ~10 ms while loading; it may block (a
            pause) or raise (a stop), and the exception propagates after the
            child process is killed.

    Returns:
        A ``TokenizerWrapper`` subclass whose Hugging Face tokenizer runs in a
        child process (see the module docstring).

    Raises:
        The exception the load raised in the child (e.g. ``OSError``,
        ``ValueError``) when it can be sent, else :class:`TokenizerProcessError`.
    """
    global _wrapper_class
    wait()
    child = _Child()
    done = False
    try:
        _send(child.out, (str(folder), eos_token_ids, list(sys.path)))
        child.wait_readable(wait)
        head = child.recv()
        _unwrap(head)
        _, state, detok_class, dstate, n = head
        tokenmap: list[str] | None = None
        if n >= 0:
            tokenmap = []
            last = time.perf_counter()
            while len(tokenmap) < n:
                if time.perf_counter() - last >= _POLL_S:
                    wait()
                    last = time.perf_counter()
                ready, _, _ = select.select([child.inp], [], [], _POLL_S)
                if ready:
                    tokenmap.extend(child.recv())
        wait()
        if _wrapper_class is None:
            _wrapper_class = _make_wrapper_class()
        remote = RemoteTokenizer(child)
        detok = detok_class.__new__(detok_class)
        for k, v in dstate.items():
            detok.__dict__[k] = remote if isinstance(v, str) and v == _SLOT else v
        if tokenmap is not None:
            detok.tokenmap = tokenmap
        wrapper = _wrapper_class.__new__(_wrapper_class)
        for k, v in state.items():
            object.__setattr__(wrapper, k, v)
        object.__setattr__(wrapper, "_tokenizer", remote)
        object.__setattr__(wrapper, "_detokenizer", detok)
        # Ends the child once nothing (wrapper, detokenizer copies) uses it.
        weakref.finalize(child, _close, child.proc, child.stderr)
        done = True
        return wrapper
    finally:
        if not done:
            child.close()
