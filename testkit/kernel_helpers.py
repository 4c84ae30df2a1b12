"""A real ipykernel driven through jupyter_client, the way a frontend drives it.

:class:`KernelSession` starts the ``python3`` kernel, collects every IOPub
message on a background thread (outputs of background generations arrive
after their cell ends), folds widget comm messages into widget states, and
sends comm messages exactly as a widget frontend does (button clicks).
:func:`start_kernel` is the one way tests get one with the extension loaded::

    @pytest.fixture(scope="module")
    def kernel(tiny_model):
        with start_kernel(tiny_model, text=True) as session:
            yield session
"""

from __future__ import annotations

import ast
import html
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.manager import start_new_kernel

REPO = Path(__file__).resolve().parent.parent


def kernel_env(**extra: str) -> dict[str, str]:
    """The test process's environment, with this checkout importable."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra)
    return env


@dataclass
class Reply:
    """The outcome of one execute request.

    Args:
        msg_id: The request's id (the parent of its outputs).
        content: The ``execute_reply`` content.
        outputs: IOPub messages with this parent, up to the ``idle`` status.
        seconds: Time from the request to its reply.
    """

    msg_id: str
    content: dict[str, Any]
    outputs: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.content.get("status") == "ok"

    def stream(self, name: str) -> str:
        """All text the cell wrote to ``stdout`` or ``stderr``."""
        return "".join(
            m["content"]["text"] for m in self.outputs if m["msg_type"] == "stream" and m["content"]["name"] == name
        )


class KernelSession:
    """One running kernel with a message collector.

    Args:
        env: Extra environment variables for the kernel.
        extra_arguments: Extra kernel command-line arguments (e.g. ``--MLXGen.ui=text``).
        kernel_name: The kernel spec to start. Default: ``"python3"``.
    """

    def __init__(
        self,
        env: dict[str, str] | None = None,
        extra_arguments: list[str] | None = None,
        kernel_name: str = "python3",
    ) -> None:
        self.km, self.kc = start_new_kernel(
            kernel_name=kernel_name,
            startup_timeout=120,
            env=kernel_env(**(env or {})),
            extra_arguments=extra_arguments or [],
        )
        self.process = self.km.provisioner.process  # the Popen, for its exit code
        self.messages: list[dict[str, Any]] = []
        self._replies: dict[str | None, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._collector = threading.Thread(target=self._collect, name="iopub-collector", daemon=True)
        self._collector.start()

    # -- collecting ----------------------------------------------------------------

    def _collect(self) -> None:
        while not self._stop:
            try:
                msg = self.kc.iopub_channel.get_msg(timeout=0.2)
            except queue.Empty:
                continue
            except Exception:  # channel closed at shutdown
                return
            with self._cond:
                self.messages.append(msg)
                self._cond.notify_all()

    def wait_until(self, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
        """Wait until ``predicate()`` is truthy (re-checked on every message and 4x a second)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout} s waiting for {what or predicate}")
                self._cond.wait(min(left, 0.25))

    def idle(self, msg_id: str) -> bool:
        """Whether request ``msg_id`` has ended (its ``idle`` status has arrived)."""
        return any(
            m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in self.with_parent(msg_id)
        )

    def with_parent(self, msg_id: str) -> list[dict[str, Any]]:
        """IOPub messages whose parent is ``msg_id`` (so far)."""
        with self._cond:
            return [m for m in self.messages if m["parent_header"].get("msg_id") == msg_id]

    # -- executing -----------------------------------------------------------------

    def execute(self, code: str, timeout: float = 120.0, **kwargs: Any) -> Reply:
        """Run ``code`` and return its reply and outputs once the kernel is idle again.

        A request the kernel aborted unrun is sent again (up to five times):
        after a cell's error ipykernel aborts execute requests until a message
        of its own reaches the shell, and one sent right after the error's
        reply can come first (ipykernel 7.4; ipython/ipykernel#609). Seen in
        the fault campaign: the cell after an interrupted ``--wait`` cell.
        """
        start = time.monotonic()
        for _ in range(5):
            msg_id = self.kc.execute(code, **kwargs)
            reply = self._reply(msg_id, timeout)
            if reply["content"].get("status") != "aborted":
                break
            self.wait_until(lambda: self.idle(msg_id), timeout, f"idle after the aborted {code[:40]!r}")
        seconds = time.monotonic() - start
        self.wait_until(lambda: self.idle(msg_id), timeout, f"idle after {code[:40]!r}")
        return Reply(msg_id, reply["content"], self.with_parent(msg_id), seconds)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until the kernel answers on the shell channel *and* its IOPub
        messages reach the collector (after a restart).

        The IOPub subscription to a restarted kernel takes a moment to join
        (zmq's slow joiner): messages published before that are lost, e.g. the
        "idle" status :meth:`execute` waits for (seen once in CI: 120 s timeout).
        So ask for kernel info until its status messages arrive too.

        Not ``kc.wait_for_ready()``: it reads IOPub, which the collector owns,
        and a zmq socket must not be read from two threads.
        """
        deadline = time.monotonic() + timeout
        while True:
            msg_id = self.kc.kernel_info()
            try:
                while True:
                    msg = self.kc.get_shell_msg(timeout=2.0)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        break
                self.wait_until(lambda: self.with_parent(msg_id), 2.0, "IOPub after kernel_info")
                return
            except (queue.Empty, TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the kernel did not answer within {timeout} s") from None

    def start(self, code: str) -> str:
        """Send an execute request without waiting; return its msg_id."""
        return self.kc.execute(code)

    def _reply(self, msg_id: str, timeout: float) -> dict[str, Any]:
        # Replies to other requests read meanwhile are kept for their own wait
        # (a subshell's reply can come while a blocked cell's is still due).
        deadline = time.monotonic() + timeout
        while msg_id not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no execute_reply for {msg_id} within {timeout} s")
            msg = self.kc.get_shell_msg(timeout=left)
            self._replies[msg["parent_header"].get("msg_id")] = msg
        return self._replies.pop(msg_id)

    def reply_to(self, msg_id: str, timeout: float = 120.0) -> Reply:
        """The reply of a request sent with :meth:`start`."""
        reply = self._reply(msg_id, timeout)
        return Reply(msg_id, reply["content"], self.with_parent(msg_id))

    def eval(self, expression: str, timeout: float = 60.0) -> Any:
        """Evaluate ``expression`` in the kernel; return ``literal_eval`` of its repr."""
        reply = self.execute("pass", timeout, user_expressions={"value": expression})
        if "user_expressions" not in reply.content:
            raise RuntimeError(f"{expression}: {reply.content}")
        result = reply.content["user_expressions"]["value"]
        if result["status"] != "ok":
            raise RuntimeError(f"{expression}: {result.get('ename')}: {result.get('evalue')}")
        return ast.literal_eval(result["data"]["text/plain"])

    # -- widgets, as a frontend sees them ---------------------------------------------------

    def widgets(self, parent: str | None = None) -> dict[str, dict[str, Any]]:
        """Widget states by comm id (opened in cell ``parent`` if given), updates applied."""
        states: dict[str, dict[str, Any]] = {}
        with self._cond:
            messages = list(self.messages)
        for m in messages:
            content = m["content"]
            if m["msg_type"] == "comm_open" and content.get("target_name") == "jupyter.widget":
                if parent is None or m["parent_header"].get("msg_id") == parent:
                    states[content["comm_id"]] = dict(content["data"]["state"])
            elif m["msg_type"] == "comm_msg" and content["comm_id"] in states:
                data = content["data"]
                if data.get("method") == "update":
                    states[content["comm_id"]].update(data["state"])
        return states

    def widget(self, parent: str, model: str, **match: Any) -> tuple:
        """``(comm_id, state)`` of the one widget of ``model`` from cell ``parent``."""
        found = [
            (cid, s)
            for cid, s in self.widgets(parent).items()
            if s.get("_model_name") == model and all(s.get(k) == v for k, v in match.items())
        ]
        assert len(found) == 1, f"expected one {model} {match}, found {len(found)}"
        return found[0]

    def send_comm(self, comm_id: str, data: dict[str, Any], subshell: str | None = None) -> None:
        """Send a ``comm_msg`` on the shell channel (to ``subshell`` if given), as a widget frontend does."""
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        if subshell is not None:
            msg["header"]["subshell_id"] = subshell
        self.kc.shell_channel.send(msg)

    def click(self, comm_id: str, subshell: str | None = None) -> None:
        """Click a Button: ipywidgets 8's frontend sends a custom ``click`` event."""
        self.send_comm(comm_id, {"method": "custom", "content": {"event": "click"}}, subshell)

    # -- subshells (ipykernel >= 7) ---------------------------------------------------------

    def create_subshell(self, timeout: float = 30.0) -> str:
        """A kernel subshell: its own thread runs what is sent to it while a cell blocks the
        main shell, the way JupyterLab >= 4.4 sends widget comm messages (``commsOverSubshells``)."""
        msg = self.kc.session.msg("create_subshell_request", {})
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no create_subshell_reply within {timeout} s")
            reply = self.kc.get_control_msg(timeout=left)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                assert reply["content"].get("status") == "ok", reply["content"]
                return reply["content"]["subshell_id"]

    def execute_in(self, subshell: str, code: str, timeout: float = 120.0) -> Reply:
        """Run ``code`` on ``subshell`` (while the main shell may be blocked) and return its reply."""
        content = {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False}
        msg = self.kc.session.msg("execute_request", content)
        msg["header"]["subshell_id"] = subshell
        self.kc.shell_channel.send(msg)
        msg_id = msg["header"]["msg_id"]
        return Reply(msg_id, self._reply(msg_id, timeout)["content"], self.with_parent(msg_id))

    # -- ending -------------------------------------------------------------------------------

    def __enter__(self) -> KernelSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the kernel down (if still running) and stop collecting."""
        try:
            if self.km.is_alive():
                self.km.shutdown_kernel(now=False)
        finally:
            self._stop = True
            self._collector.join(5)
            self.kc.stop_channels()


def start_kernel(
    model: str | None = None,
    *,
    text: bool = False,
    setup: Sequence[str] = (),
    first: Sequence[str] = (),
    load: bool = True,
    env: dict[str, str] | None = None,
    extra_arguments: list[str] | None = None,
    kernel_name: str = "python3",
    timeout: float = 180.0,
) -> KernelSession:
    """Start a kernel (``python3``) with ``mlx_notebook`` loaded and configured; a failed setup closes it.

    Args:
        model: ``MLXGen.model`` (a folder, a ``.gguf`` or ``"default"``). Default: ``None`` (not set).
        text: The plain-text widget (``MLXGen.format = 'text'``), whose ``<pre>`` tests read.
          Default: ``False`` (Markdown).
        setup: Cells run after the extension is configured. Default: ``()``.
        first: Cells run before ``%load_ext`` (e.g. ``import mlx.core``). Default: ``()``.
        load: Run ``%load_ext mlx_notebook``. Default: ``True``.
        env: Extra environment variables for the kernel. Default: ``None``.
        extra_arguments: Extra kernel command-line arguments. Default: ``None``.
        kernel_name: The kernel spec to start (found on ``JUPYTER_PATH``). Default: ``"python3"``.
        timeout: Seconds each setup cell may take. Default: ``180``.
    """
    session = KernelSession(env=env, extra_arguments=extra_arguments, kernel_name=kernel_name)
    cells = [*first]
    if load:
        cells.append("%load_ext mlx_notebook")
    if model is not None:
        cells.append(f"%config MLXGen.model = {model!r}")
    if text:
        cells.append("%config MLXGen.format = 'text'")
    cells += setup
    try:
        for code in cells:
            reply = session.execute(code, timeout)
            assert reply.ok, (code, reply.content)
    except BaseException:
        session.close()
        raise
    return session


# -- reading a generation's widget as a frontend sees it ------------------------------------


# HTML widgets of the view that are not its stats line: the kernel-gone note, the log-probs table.
_NOT_STATUS = ("mlxgen-disconnected", "mlxgen-logprobs")


def view(kernel: KernelSession, cell: str) -> dict[str, Any]:
    """The current state of the widget that cell ``cell`` displayed.

    ``text`` is the answer as streamed so far: from the ``<pre>`` of a
    ``--format text`` widget, or joined from the Markdown blocks (one
    ``Output`` widget each, in order) of a ``--format markdown`` one.
    """
    found: dict[str, Any] = {}
    states = kernel.widgets(cell)
    for comm_id, state in states.items():
        model = state.get("_model_name")
        if model == "VBoxModel" and "mlxgen-markdown" in state.get("_dom_classes", ()):
            found["text"] = markdown_text(states, state)
            found["blocks"] = len(state.get("children", ()))
        elif model == "OutputModel":
            continue
        elif model == "HTMLModel" and str(state.get("value", "")).startswith("<pre"):
            pre = re.match(r"<pre[^>]*>(.*?)</pre>", state["value"], re.S)
            found["text"] = html.unescape(pre.group(1) if pre else "")
            found["empty_note"] = "mlxgen-empty" in state["value"]
        elif model == "HTMLModel" and "mlxgen-notice" in str(state.get("value", "")):
            found["notice"] = html.unescape(re.sub(r"<[^>]+>", "", state["value"]))
        elif model == "HTMLModel" and any(c in str(state.get("value", "")) for c in _NOT_STATUS):
            continue
        elif model == "HTMLModel":
            found["status"] = html.unescape(re.sub(r"<[^>]+>", "", state.get("value", "")))
        elif model == "ButtonModel" and state.get("tooltip", "").startswith("Stop"):
            found["stop"] = (comm_id, state)
        elif model == "ButtonModel" and state.get("tooltip", "").startswith("Pause"):
            found["pause"] = (comm_id, state)
        elif model == "FloatProgressModel":
            found["progress"] = state
    return found


def markdown_text(states: dict[str, dict[str, Any]], box: dict[str, Any]) -> str:
    """The text of a Markdown area: its blocks' ``text/plain``, placeholders left out."""
    parts = []
    for ref in box.get("children", ()):
        for output in states.get(str(ref).removeprefix("IPY_MODEL_"), {}).get("outputs", ()):
            if not output.get("metadata", {}).get("mlx_notebook_placeholder"):
                parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def status(kernel: KernelSession, cell: str) -> tuple[str, int]:
    """``(state, tokens)`` from the widget's stats line, e.g. ``#3 decoding · 5 tokens``."""
    # "#3 stopped: kernel restarted · 12 tokens": the reason is not the state.
    match = re.match(r"#\d+ (\w+)(?:: [^·]*)? · (\d+) tokens", view(kernel, cell).get("status", ""))
    return (match.group(1), int(match.group(2))) if match else ("", 0)


def wait_decoding(kernel: KernelSession, cell: str, tokens: int = 2, timeout: float = 180) -> None:
    kernel.wait_until(
        lambda: status(kernel, cell)[0] == "decoding" and status(kernel, cell)[1] >= tokens,
        timeout,
        f"{tokens} tokens decoded in {cell}",
    )


def wait_state(kernel: KernelSession, cell: str, states: tuple[str, ...], timeout: float = 180) -> str:
    return kernel.wait_until(
        lambda: status(kernel, cell)[0] in states and status(kernel, cell)[0],
        timeout,
        f"state in {states} for {cell}",
    )


def one_line_usage_error(reply: Reply) -> str:
    assert reply.content["status"] == "error"
    assert reply.content["ename"] == "UsageError", reply.content
    err = reply.stream("stderr").strip()
    assert len(err.splitlines()) == 1 and err.startswith("UsageError: mlxgen: "), err
    assert "Traceback" not in err
    assert not [m for m in reply.outputs if m["msg_type"] == "error"]
    return err


def greedy_tokens(kernel: KernelSession, prompt: str, n: int, out: str = "ref") -> list[int]:
    """Run ``%%mlxgen -n N --wait -o OUT`` on ``prompt`` and return the tokens it made."""
    reply = kernel.execute(f"%%mlxgen -n {n} --wait -o {out}\n{prompt}", timeout=300)
    assert reply.ok, reply.content
    return kernel.eval(f"{out}.tokens")


def run_meanwhile(kernel: KernelSession, model: str, max_tokens: int = 4, subshell: str | None = None) -> None:
    """Run another short generation of ``model`` in the kernel to its end (work to do while one is paused),
    on ``subshell`` if given (while a cell blocks the main shell)."""
    code = (
        "import mlx_notebook as _mlxnb\n"
        f"_other = _mlxnb.generate('Meanwhile, elsewhere', model={model!r}, max_tokens={max_tokens})\n"
        "_other.result(300)\n"
        "assert _other.state == 'done' and _other.tokens, (_other.state, _other.error)"
    )
    reply = kernel.execute(code, timeout=330) if subshell is None else kernel.execute_in(subshell, code, 330)
    assert reply.ok, reply.content


def displays(kernel: KernelSession, cell: str) -> list[dict[str, Any]]:
    """The first display of cell ``cell`` and every update of it, in order (contents)."""
    first = [m for m in kernel.with_parent(cell) if m["msg_type"] == "display_data"]
    assert len(first) == 1, first
    display_id = first[0]["content"]["transient"]["display_id"]
    with kernel._cond:
        return [
            m["content"]
            for m in kernel.messages
            if m["msg_type"] in ("display_data", "update_display_data")
            and m["content"].get("transient", {}).get("display_id") == display_id
        ]
