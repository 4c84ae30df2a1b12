"""``%%mlxchat NAME``: the cell body is the next user turn of the :class:`~mlx_notebook.Chat` bound to ``NAME``.

Thin, like ``%%mlxgen`` (whose config, worker, widget and interrupt handling
it shares through the registered :class:`~.magics.MLXGen`): it parses, makes
the chat on first use, calls :meth:`Chat.send`, shows the turn's widget. The
chat is an ordinary variable: ``NAME.undo()``, ``NAME.edit_last(...)``,
``NAME.save(path)``, ``NAME.messages``, ``NAME.generation`` (the latest turn).
Every mistake ends the cell with one ``UsageError`` line and changes nothing.

Example (in a notebook)::

    %%mlxchat c -s "Answer briefly." -n 64
    Name a river in France.

    %%mlxchat c --wait
    How long is it?

    c.undo(); c.save("rivers.json")
"""

from __future__ import annotations

import keyword
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..chat import Chat
from ..errors import MLXNotebookError
from ..generation.request import option_names
from ..generation.states import State
from .interpolate import interpolate
from .kernel_hooks import deferred_interrupts
from .magics import MLXGen, as_cell_magic_help, parse_or_fail
from .option_flags import given_options, option_arguments
from .text_form import error_line
from .widget import FORMAT_CHOICES

# Options fixed when a chat is made (-m, -s), or always on (the chat template).
_CHAT_MADE = ("model", "system", "chat")


def _fail(message: str) -> UsageError:
    return UsageError(f"mlxchat: {message}")


@magics_class
class ChatMagics(Magics):
    """The ``%%mlxchat`` cell magic; its defaults are ``MLXGen``'s config.

    Args:
        shell: The IPython shell.
        gen_magics: The registered ``%%mlxgen`` magics (config, worker, display router).
    """

    shell: Any  # the InteractiveShell (typed None in Magics)

    def __init__(self, shell: Any, gen_magics: MLXGen) -> None:
        super().__init__(shell=shell)
        self.gen_magics = gen_magics

    @magic_arguments()
    @argument("name", metavar="NAME", help="the variable holding the chat (made on first use)")
    @argument("-m", "--model", default=None, help="model of a new chat (MLXGen.model)")
    @argument("-s", "--system", default=None, help="system message of a new chat (MLXGen.system)")
    @option_arguments(exclude=_CHAT_MADE)
    @argument("--drop-stopped", action="store_true", help="a new chat drops a stopped turn instead of keeping it")
    @argument("--wait", dest="wait", action="store_const", const=True, default=None, help="block until done")
    @argument("--no-wait", dest="wait", action="store_const", const=False, help="run in the background")
    @argument("--plain", action="store_true", help="plain text display instead of the widget")
    @argument("--format", choices=FORMAT_CHOICES, default=None, help="markdown or text (MLXGen.format)")
    @argument("--show-thinking", action="store_true", help="text output shows the reasoning in full")
    @cell_magic
    def mlxchat(self, line: str, cell: str) -> None:
        """Send the cell body as the next user message of the chat ``NAME``.

        The first ``%%mlxchat NAME`` makes a :class:`mlx_notebook.Chat` with the
        given model and system message, its options from ``MLXGen``'s config
        (every option it has a trait for), and binds it to ``NAME``; later
        cells continue it. A cell's option flags (all of ``%%mlxgen``'s but
        ``-m``, ``-s`` and ``--raw``) apply to its turn only, the first included.
        Each turn prefills only what is new since the last one (the prompt
        cache). ``{name}`` in the body inserts variables, as in ``%%mlxgen``.
        """
        __tracebackhide__ = True
        try:
            args = parse_or_fail(self.mlxchat, line)  # split as a shell does, as %%mlxgen's options
        except UsageError as exc:
            raise _fail(str(exc).removeprefix("mlxgen: ")) from None
        if not args.name.isidentifier() or keyword.iskeyword(args.name):
            raise _fail(f"NAME must be a Python variable name, got {args.name!r}")
        if not cell.strip():
            raise _fail(f"the cell is empty: write the next message to {args.name} below the %%mlxchat line")
        try:
            text = interpolate(cell.strip(), self.shell.user_ns)
            chat = self._chat(args)
        except MLXNotebookError as exc:
            raise _fail(error_line(exc)) from None
        except TypeError as exc:  # an option a chat does not take
            raise _fail(str(exc)) from None
        gen_magics = self.gen_magics
        waiting = gen_magics.wait if args.wait is None else args.wait
        # As in %%mlxgen: an interrupt from sending to waiting is noted, then stops the turn.
        with deferred_interrupts() as interrupted:
            try:
                gen = chat.send(text, **self._turn_options(args))
            except MLXNotebookError as exc:
                raise _fail(f"{args.name}: {error_line(exc)}") from None
            self.shell.user_ns[args.name] = chat
            gen_magics.show(gen, args, waiting=waiting, interrupted=interrupted)
        if waiting and gen.state is State.FAILED and gen.error is not None:
            raise _fail(f"{args.name} #{gen.id} failed: {error_line(gen.error)}; the message was taken back")

    def _chat(self, args: Any) -> Chat:
        """The chat bound to ``args.name``, or a new one (not bound yet: only a sent turn binds it)."""
        found = self.shell.user_ns.get(args.name)
        if found is None:
            config = self.gen_magics
            # Every MLXGen request trait: a chat's defaults are %%mlxgen's (a cell's flags are its turn's).
            options = {
                name: getattr(config, name)
                for name in config.request_traits()
                if name not in _CHAT_MADE and getattr(config, name) is not None
            }
            return Chat(
                args.model if args.model is not None else config.model,
                args.system if args.system is not None else config.system,
                keep_stopped=not args.drop_stopped,
                # A worker given to %%mlxgen's magics (tests) serves the chat too; else the shared one.
                worker=getattr(config, "_given_worker", None),
                **options,
            )
        if not isinstance(found, Chat):
            raise _fail(
                f"{args.name} is a {type(found).__name__}, not a Chat: pick another name (or del {args.name} first)"
            )
        for flag, given, has in (
            ("-m", args.model, found.model),
            ("-s", args.system, found.system),
            ("--drop-stopped", False if args.drop_stopped else None, found.keep_stopped),
        ):
            if given is not None and given != has:
                raise _fail(
                    f"{flag} applies when a chat is made, and {args.name} exists: "
                    f"set {args.name}.model / .system / .keep_stopped, or use a new name"
                )
        return found

    def _given(self, args: Any) -> dict[str, Any]:
        """The option flags typed on the line (``--logit-bias`` read as in %%mlxgen)."""
        given = given_options(args, [name for name in option_names() if name not in _CHAT_MADE])
        if "logit_bias" in given:
            given["logit_bias"] = self.gen_magics.logit_bias_from(given["logit_bias"])
        return given

    def _turn_options(self, args: Any) -> dict[str, Any]:
        """This turn's overrides: the flags given, and the stop budget and batch size of the config."""
        config = self.gen_magics
        options = {"stop_budget": config.stop_budget, "max_batch": config.max_batch, **self._given(args)}
        # Asked each time: syncs MLXGen.prompt_cache_gb to the worker, as %%mlxgen does.
        _ = config.worker
        return options


as_cell_magic_help(ChatMagics.mlxchat)


def register(ipython: Any, gen_magics: MLXGen) -> ChatMagics:
    """Register ``%%mlxchat`` in ``ipython`` beside ``gen_magics``."""
    magics = ChatMagics(ipython, gen_magics)
    ipython.register_magics(magics)
    return magics


__all__ = ["ChatMagics", "register"]
