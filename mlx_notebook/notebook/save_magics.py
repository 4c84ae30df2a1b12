"""``%mlxgen_save`` and ``%mlxgen_resume``: a generation written to a file, and continued from one.

A kernel restart (after a ``pip install``, a stuck cell) loses every paused
generation; these magics keep one across it. ``%mlxgen_save 3 story.kv``
writes generation #3 (paused: exactly; stopped or done: with what the prompt
cache still holds of it) with :meth:`~mlx_notebook.Generation.save`;
``%mlxgen_resume story.kv`` in the new kernel continues it in a widget like
``%%mlxgen``'s, with the uninterrupted run's tokens. Interrupt Kernel stops a
save or the resume's read like any phase; a mistake is one ``UsageError`` line.

Example (in a notebook)::

    %mlxgen_save 3 story.kv
    # ... restart the kernel ...
    %load_ext mlx_notebook
    %mlxgen_resume story.kv -o gen
"""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..cluster import routing
from ..errors import MLXNotebookError
from .magics import MLXGen, fail, parse_or_fail
from .text_form import error_line
from .widget import FORMAT_CHOICES


@magics_class
class SaveMagics(Magics):
    """The save and resume line magics; they act on the worker of ``gen_magics``.

    Args:
        shell: The IPython shell.
        gen_magics: The registered ``%%mlxgen`` magics (their worker, display and config).
    """

    def __init__(self, shell: Any, gen_magics: MLXGen) -> None:
        super().__init__(shell=shell)
        self.gen_magics = gen_magics

    @magic_arguments()
    @argument("target", help="a generation id (see %%mlxgen_jobs)")
    @argument("path", help="the file to write (mlx-lm's prompt-cache format, .safetensors)")
    @line_magic
    def mlxgen_save(self, line: str) -> None:
        """Write a paused, stopped or finished generation to a file that ``%mlxgen_resume`` continues."""
        args = parse_or_fail(self.mlxgen_save, line)
        text = args.target.lstrip("#")
        if not text.isdigit():
            raise fail(f"give a generation id, got {args.target!r}")
        gen = next((g for g in routing.history(self.gen_magics.used_worker()) if g.id == int(text)), None)
        if gen is None:
            raise fail(f"no generation #{text}: %mlxgen_jobs lists them")
        try:
            written = gen.save(args.path)
        except KeyboardInterrupt:
            print(f"save of #{gen.id} stopped: {args.path} was not written")
            raise
        except (MLXNotebookError, OSError) as exc:
            raise fail(error_line(exc)) from None
        print(f"#{gen.id} ({gen.state}, {len(gen.tokens)} tokens) saved to {args.path}: {written / 1e6:,.1f} MB")

    @magic_arguments()
    @argument("path", help="a file %%mlxgen_save (or gen.save) wrote")
    @argument("-o", "--out", metavar="NAME", default=None, help="bind the Generation handle to NAME")
    @argument("-n", "--max-tokens", type=int, default=None, help="most tokens in all (may extend a finished one)")
    @argument("--wait", action="store_true", help="block the cell until done")
    @argument("--plain", action="store_true", help="plain text output (no widget)")
    @argument("--format", choices=FORMAT_CHOICES, default=None, help="how the text is shown")
    @line_magic
    def mlxgen_resume(self, line: str) -> None:
        """Continue a saved generation exactly where it was, shown like ``%%mlxgen``'s."""
        args = parse_or_fail(self.mlxgen_resume, line)
        if args.out is not None and not args.out.isidentifier():
            raise fail(f"-o needs a Python name, got {args.out!r}")
        try:
            gen = self.gen_magics.worker.resume(args.path, max_tokens=args.max_tokens)
        except (MLXNotebookError, OSError) as exc:
            raise fail(error_line(exc)) from None
        if args.out is not None and self.shell is not None:
            self.shell.user_ns[args.out] = gen
        self.gen_magics.show(gen, args, waiting=args.wait)


def register(ipython: Any, gen_magics: MLXGen) -> SaveMagics:
    """Register the save and resume magics on ``ipython``."""
    magics = SaveMagics(ipython, gen_magics)
    ipython.register_magics(magics)
    return magics


__all__ = ["SaveMagics", "register"]
