"""``%mlxgen_stop``, ``%mlxgen_jobs``, ``%mlxgen_models``: this kernel's generations and models.

Line magics on the worker (and the cluster) that ``%%mlxgen`` queues on; they
share its config through the registered :class:`~.magics.MLXGen`. Like every
magic here, a mistake ends the cell with one ``UsageError`` line.

Example (in a notebook)::

    %mlxgen_jobs            # id, state, tokens, tok/s, prompt
    %mlxgen_stop 3          # or: %mlxgen_stop (all)
    %mlxgen_models --unload default
"""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..cluster import routing
from ..errors import MLXNotebookError
from ..generation.handle import Generation
from ..generation.request import is_messages
from ..loading.names import resolve
from .magics import MLXGen, fail, parse_or_fail
from .text_form import error_line


@magics_class
class JobMagics(Magics):
    """The job line magics; they act on the worker of ``gen_magics``.

    Args:
        shell: The IPython shell.
        gen_magics: The registered ``%%mlxgen`` magics (their worker).
    """

    def __init__(self, shell: Any, gen_magics: MLXGen) -> None:
        super().__init__(shell=shell)
        self.gen_magics = gen_magics

    def used_worker(self) -> Any:
        return self.gen_magics.used_worker()

    # -- %mlxgen_stop -------------------------------------------------------------------------

    @magic_arguments()
    @argument("target", nargs="?", default="all", help="a generation id (see %%mlxgen_jobs), or 'all'")
    @line_magic
    def mlxgen_stop(self, line: str) -> None:
        """Stop one generation, or all running and queued ones (the default)."""
        args = parse_or_fail(self.mlxgen_stop, line)
        worker = self.used_worker()
        if args.target == "all":
            stopped = routing.cancel_all(worker)
            if stopped:
                print("stopping " + ", ".join(f"#{g.id}" for g in stopped))
            else:
                print("nothing to stop")
            return
        gen = self._find(args.target)
        if gen.finished:
            print(f"#{gen.id} is already {gen.state}")
            return
        gen.cancel()
        print(f"stopping #{gen.id}")

    def _find(self, target: str) -> Generation:
        text = target.lstrip("#")
        if not text.isdigit():
            raise fail(f"give a generation id or 'all', got {target!r}")
        for gen in self._history():
            if gen.id == int(text):
                return gen
        raise fail(f"no generation #{text}: %mlxgen_jobs lists them")

    def _history(self) -> list[Generation]:
        """This kernel's generations, local and on its cluster, oldest first."""
        return routing.history(self.used_worker())

    # -- %mlxgen_jobs ---------------------------------------------------------------------------

    @line_magic
    def mlxgen_jobs(self, line: str = "") -> None:
        """List this kernel's generations: id, state, tokens, tok/s, prompt."""
        if line.strip():
            raise fail("%mlxgen_jobs takes no arguments")
        gens = self._history()
        if not gens:
            print("no generations yet")
            return
        rows = [["id", "state", "tokens", "tok/s", "prompt"]]
        for gen in gens:
            tps = gen.stats.generation_tps
            prompt = gen.request.prompt
            if isinstance(prompt, str):
                head = " ".join(prompt.split())
            elif is_messages(prompt):  # a chat turn: its last message
                head = " ".join(prompt[-1]["content"].split())
            else:
                head = f"<{len(prompt)} token ids>"
            rows.append(
                [
                    f"#{gen.id}",
                    gen.state,
                    str(gen.stats.generated_tokens),
                    f"{tps:.1f}" if tps else "-",
                    head if len(head) <= 40 else head[:39] + "…",
                ]
            )
        print(_table(rows))

    # -- %mlxgen_models -------------------------------------------------------------------------

    @magic_arguments()
    @argument("--unload", metavar="NAME", default=None, help="forget a loaded model and free its memory")
    @line_magic
    def mlxgen_models(self, line: str) -> None:
        """List loaded models and their memory; ``--unload NAME`` frees one."""
        args = parse_or_fail(self.mlxgen_models, line)
        worker = self.used_worker()
        if args.unload is not None:
            self._unload(args.unload)
            return
        loaded = worker.store.loaded() if worker is not None else []
        if not loaded:
            print("no model loaded")
            return
        rows = [["model", "parameters", "loaded in", "KV of running", "prompt cache", "path"]]
        running = worker.running() if worker is not None else []
        for m in loaded:
            kept = m.prompt_cache
            cached = f"{len(kept)} x, {kept.nbytes / 2**20:.0f} MB" if kept is not None else "-"
            kv = sum(g.stats.kv_bytes for g in running if g.model_key == m.source.key)
            rows.append(
                [
                    m.source.name,
                    f"{m.nbytes / 2**20:.0f} MB",
                    f"{m.load_s:.1f} s",
                    f"{kv / 2**20:.1f} MB",
                    cached,
                    str(m.source.path),
                ]
            )
        print(_table(rows))
        try:
            import mlx.core as mx

            print(
                f"MLX memory: {mx.get_active_memory() / 2**20:.0f} MB active, "
                f"{mx.get_cache_memory() / 2**20:.0f} MB cached"
            )
        except Exception:  # memory figures are a nicety
            pass

    def _unload(self, name: str) -> None:
        try:
            resolve(name)  # a typo is an error, not "not loaded"
        except MLXNotebookError as exc:
            raise fail(error_line(exc)) from None
        worker = self.used_worker()
        busy = worker.active() if worker is not None else []
        if busy:
            ids = ", ".join(f"#{g.id}" for g in busy)
            raise fail(f"generations {ids} are running or queued; stop them first (%mlxgen_stop)")
        if worker is None:
            print(f"{name}: not loaded")
            return
        try:
            # On the worker thread: MLX work (freeing included) belongs to it.
            removed = worker.call(lambda store: store.unload(name), timeout=30)
        except MLXNotebookError as exc:
            raise fail(error_line(exc)) from None
        except TimeoutError as exc:
            raise fail(str(exc)) from None
        print(f"{name}: unloaded" if removed else f"{name}: not loaded")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def register(ipython: Any, gen_magics: MLXGen) -> JobMagics:
    """Register the job magics in ``ipython`` beside ``gen_magics``."""
    magics = JobMagics(ipython, gen_magics)
    ipython.register_magics(magics)
    return magics


__all__ = ["JobMagics", "register"]
