"""Conversations: :class:`Chat` holds the message history and sends each user turn.

Every turn is one :class:`~mlx_notebook.generation.handle.Generation` (stop,
pause, resume as everywhere) whose prompt is the model's chat template applied
to the whole history. The worker keeps the KV cache of every generation in the
model's prompt cache, so turn N starts from turn N-1's prompt and answer and
prefills only what the template adds after them (the end of the answer, the
new user message).

The history is plain data: ``chat.messages`` is a list of
``{"role", "content"}`` dicts you may edit; an answer that was stopped carries
``"stopped": True`` (or is dropped, with ``keep_stopped=False``). A turn that
fails takes its user message back out, so the history is as before the send.
A reasoning model's thinking is kept apart, as the answer's ``"reasoning"``:
the next turns send it back only to chat templates that read it (as
``reasoning_content``, Qwen3's and DeepSeek's); others get the answer alone,
as the model was trained to see its past turns.

Example::

    import mlx_notebook
    chat = mlx_notebook.Chat(system="Answer in one sentence.", max_tokens=64)
    print(chat.send("Name a river in France.").result(timeout=120))
    print(chat.send("How long is it?").result(timeout=120))
    chat.undo()                        # drops the last question and its answer
    chat.save("rivers.json")
    again = mlx_notebook.Chat.load("rivers.json")

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from .control import CancelToken, Pace
from .errors import InvalidArgumentError, MLXNotebookError
from .generation import persist
from .generation.handle import Generation, GenerationEvent
from .generation.request import GenerationRequest, check_option, option_names
from .generation.saving import save_chat
from .generation.states import State
from .generation.worker import Worker, default_worker

# Options a chat fixes for all its turns (given to Chat itself), or that only
# make sense with a message list (the chat template is always applied).
_CHAT_FIELDS = ("model", "system", "chat")
# The first key of a saved chat: says what the file is, and its format's version.
_FORMAT_KEY = "mlx_notebook_chat"
_FORMAT_VERSION = 1


class ChatBusyError(MLXNotebookError, RuntimeError):
    """A chat was changed while one of its turns runs."""


class Chat:
    """A conversation with one model: the message history and its options.

    Args:
        model: Model name for every turn (see :func:`mlx_notebook.generate`).
          Default: ``None`` (the default model).
        system: System message, put first in every prompt. Default: ``None``.
        keep_stopped: Keep a stopped answer in the history, marked
          ``"stopped": True``; ``False`` drops the whole turn (the user
          message too, so roles keep alternating). Default: ``True``.
        worker: The worker turns queue on. Default: :func:`mlx_notebook.default_worker`.
        **sampling: Options of every turn, as for :func:`mlx_notebook.generate`
          (``max_tokens``, ``temperature``, ``seed``...); :meth:`send` may
          override them for one turn.

    Raises:
        TypeError: An unknown option.
        InvalidArgumentError: A bad value.
    """

    def __init__(
        self,
        model: str | None = None,
        system: str | None = None,
        *,
        keep_stopped: bool = True,
        worker: Worker | None = None,
        **sampling: Any,
    ) -> None:
        if model is not None and not isinstance(model, str):
            raise InvalidArgumentError(f"model must be a name (string) or None, got {type(model).__name__}")
        check_option("system", system)
        self.model = model
        self.system = system
        self.keep_stopped = bool(keep_stopped)
        self.options = _checked_options(sampling)
        self.messages: list[dict[str, Any]] = []
        self.generation: Generation | None = None  # the latest turn's
        self._worker = worker
        # The KV cache file of a chat loaded with one (Chat.save(path, kv=True)), for its next turn.
        self._seed: persist.KVSeed | None = None
        # Turns sent whose answer is not in the history yet, by generation id.
        self._pending: dict[int, dict[str, Any]] = {}
        # The worker thread settles a turn while the user's thread may send or edit.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        last = f", last turn {self.generation.state}" if self.generation is not None else ""
        return f"<Chat {len(self.messages)} messages, model={self.model or 'default'}{last}>"

    @property
    def busy(self) -> bool:
        """Whether a turn runs (its answer is not in the history yet)."""
        return bool(self._pending)

    # -- turns -----------------------------------------------------------------------

    def send(self, text: str, **overrides: Any) -> Generation:
        """Append ``text`` as the next user message and generate the answer, in the background.

        The answer joins :attr:`messages` when the generation ends (``done``;
        ``stopped``: marked, or the turn dropped, see ``keep_stopped``;
        ``failed``: the user message is taken out again).

        Args:
            text: The user's message.
            **overrides: Options for this turn only (``max_tokens=...``).

        Returns:
            The turn's :class:`~mlx_notebook.generation.handle.Generation`.

        Raises:
            ChatBusyError: The previous turn still runs.
            InvalidArgumentError: An empty message, a bad option or history.
        """
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgumentError("the message is empty: give the text of the next user turn")
        options = {**self.options, **_checked_options(overrides)}
        user = {"role": "user", "content": text}
        with self._lock:
            self._check_idle("send")
            # Copies: later edits of the history do not reach the queued request.
            prompt: list[dict[str, Any]] = [_sent(m) for m in self.messages]
            prompt.append(dict(user))
            request = GenerationRequest(prompt, model=self.model, system=self.system, **options)
            from .cluster.routing import submit  # a chat on a running cluster's model runs on its ranks

            worker = self._worker or _default_worker()
            if self._seed is not None:
                # The first turn after Chat.load: served from the file's KV cache.
                gen = worker.submit_from(request, self._seed)
                self._seed = None
            else:
                gen = submit(request, worker)  # validates: a bad input changes nothing
            self.messages.append(user)
            self._pending[gen.id] = user
            self.generation = gen
        gen.add_listener(lambda event: self._on_event(gen, event))
        if gen.state.final:  # it ended before the listener was added
            self._settle(gen)
        return gen

    def undo(self) -> list[dict[str, Any]]:
        """Drop the last turn: the last answer and the user message before it.

        Returns:
            The messages dropped.

        Raises:
            ChatBusyError: A turn runs.
            InvalidArgumentError: The history is empty.
        """
        with self._lock:
            self._check_idle("undo")
            if not self.messages:
                raise InvalidArgumentError("the chat is empty: nothing to undo")
            dropped = [self.messages.pop()]
            if dropped[0].get("role") == "assistant" and self.messages and self.messages[-1].get("role") == "user":
                dropped.insert(0, self.messages.pop())
            return dropped

    def edit_last(self, text: str, *, role: str | None = None) -> dict[str, Any]:
        """Replace the content of the last message (of ``role``, if given); it is no longer marked stopped.

        Args:
            text: The new content.
            role: ``"user"``, ``"assistant"``... Default: ``None`` (the last message, whatever its role).

        Returns:
            The edited message.
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"the new content must be a string, got {type(text).__name__}")
        with self._lock:
            self._check_idle("edit")
            found = [m for m in self.messages if role is None or m.get("role") == role]
            if not found:
                raise InvalidArgumentError(f"no {role + ' ' if role else ''}message to edit")
            message = found[-1]
            message["content"] = text
            message.pop("stopped", None)
            return message

    # -- files --------------------------------------------------------------------------

    def save(self, path: str | Path, *, kv: bool = False) -> None:
        """Write the messages and the chat's options to ``path``: JSON, or with ``kv=True`` its KV cache too.

        With ``kv=True`` the file is mlx-lm's prompt-cache format (safetensors,
        the chat's JSON in its metadata) holding the KV cache of the history
        (what the model's prompt cache kept of the last turn): after a kernel
        restart, :meth:`load` gives a chat whose next turn is served from it
        instead of prefilling the whole history again. The save runs on the
        worker in budget-sized pieces; an interrupt stops it.

        Raises:
            ChatBusyError: A turn runs.
            InvalidArgumentError: ``kv=True`` on an empty chat, or with ``max_kv_size``.
        """
        with self._lock:
            self._check_idle("save")
            data = {
                _FORMAT_KEY: _FORMAT_VERSION,
                "model": self.model,
                "system": self.system,
                "keep_stopped": self.keep_stopped,
                "options": self.options,
                "messages": self.messages,
            }
            text = json.dumps(data, indent=1, ensure_ascii=False)
            history = [_sent(m) for m in self.messages]
        if not kv:
            Path(path).write_text(text + "\n", encoding="utf-8")
            return
        if not history:
            raise InvalidArgumentError("the chat is empty: there is no KV cache to keep; save it without kv=True")
        request = GenerationRequest(history, model=self.model, system=self.system, **self.options)
        request.validate()
        worker = self._worker or _default_worker()
        token = CancelToken()
        budget = request.stop_budget
        worker.run_inline(
            lambda session: save_chat(
                request, data, path, worker.store, Pace(token, budget, between=session.between if session else None)
            ),
            token,
        )

    @classmethod
    def load(cls, path: str | Path, *, worker: Worker | None = None) -> Chat:
        """A chat from a file :meth:`save` wrote.

        Raises:
            InvalidArgumentError: The file is not a saved chat.
            OSError: It cannot be read.
        """
        seed = None
        with open(path, "rb") as f:
            head = f.read(9)
        # A safetensors file (Chat.save(path, kv=True): the chat with its KV cache) starts with
        # its header's length (8 bytes, little-endian) and the header's JSON; a JSON save with "{".
        if len(head) == 9 and head[8:9] == b"{" and not head.lstrip().startswith(b"{"):
            found = persist.read(path, persist.CHAT_FORMAT)
            data = found.get("chat")
            tokens = found.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                raise InvalidArgumentError(f"{path}: 'tokens' must be a list of token ids")
            seed = persist.seed_of(found, str(path), tokens)
        else:
            try:
                data = json.loads(Path(path).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InvalidArgumentError(f"{path} is not a saved chat: {exc}") from None
        if not isinstance(data, dict) or data.get(_FORMAT_KEY) != _FORMAT_VERSION:
            raise InvalidArgumentError(
                f"{path} is not a saved chat (Chat.save writes {_FORMAT_KEY}: {_FORMAT_VERSION})"
            )
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise InvalidArgumentError(f"{path}: 'options' must be an object, got {type(options).__name__}")
        try:
            chat = cls(
                data.get("model"),
                data.get("system"),
                keep_stopped=data.get("keep_stopped", True),
                worker=worker,
                **options,
            )
        except (TypeError, MLXNotebookError) as exc:
            raise InvalidArgumentError(f"{path}: {exc}") from None
        chat.messages = _checked_messages(data.get("messages"), path)
        chat._seed = seed if seed is not None and seed.tokens else None
        return chat

    # -- the worker's side ---------------------------------------------------------------

    def _on_event(self, gen: Generation, event: GenerationEvent) -> None:
        # On the worker thread, at the final state change (before waiters wake):
        # whoever waits on the turn sees the history already settled.
        if event.kind == "state" and event.state.final:
            self._settle(gen)

    def _settle(self, gen: Generation) -> None:
        """Put a finished turn's answer in the history (once)."""
        with self._lock:
            user = self._pending.pop(gen.id, None)
            if user is None:
                return
            # Found by identity: the user may have edited the list around it meanwhile.
            at = next((i for i, m in enumerate(self.messages) if m is user), None)
            if gen.state is State.FAILED or (gen.state is State.STOPPED and not self.keep_stopped):
                if at is not None:
                    del self.messages[at]
                return
            answer: dict[str, Any] = {"role": "assistant", "content": gen.text}
            if gen.reasoning:
                answer["reasoning"] = gen.reasoning
            if gen.state is State.STOPPED:
                answer["stopped"] = True
            self.messages.insert(len(self.messages) if at is None else at + 1, answer)

    def _check_idle(self, action: str) -> None:
        if self._pending:
            gen = self.generation
            which = f"#{gen.id} is still {gen.state}" if gen is not None else "is still running"
            raise ChatBusyError(f"cannot {action} while this chat's turn {which}: wait for it or stop it first")


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    allowed = [name for name in option_names() if name not in _CHAT_FIELDS]
    for name, value in options.items():
        if name not in allowed:
            hint = " (a chat's model and system are set when it is made)" if name in _CHAT_FIELDS else ""
            raise TypeError(f"unknown chat option {name!r}{hint}; the options are: {', '.join(allowed)}")
        check_option(name, value)
    return dict(options)


def _checked_messages(messages: Any, path: str | Path) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise InvalidArgumentError(f"{path}: 'messages' must be a list, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidArgumentError(f"{path}: message {i} must be an object with 'role' and 'content' strings")
        kept = {"role": m["role"], "content": m["content"]}
        if isinstance(m.get("reasoning"), str) and m["reasoning"]:
            kept["reasoning"] = m["reasoning"]
        if m.get("stopped"):
            kept["stopped"] = True
        out.append(kept)
    return out


def _sent(message: dict[str, Any]) -> dict[str, Any]:
    """What a history message contributes to a prompt: role, content, and its reasoning (the prompt code
    passes that on only to templates that read it)."""
    sent = {"role": message.get("role"), "content": message.get("content")}
    if message.get("reasoning"):
        sent["reasoning"] = message["reasoning"]
    return sent


def _default_worker() -> Worker:
    found = default_worker()
    assert found is not None  # create=True always gives one
    return found


__all__ = ["Chat", "ChatBusyError"]
