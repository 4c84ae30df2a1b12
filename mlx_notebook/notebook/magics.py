"""``%%mlxgen`` and its line-magic companions; ``MLXGen`` is also the config class.

The magics are thin: they parse, fill ``{name}`` placeholders, and call
:func:`mlx_notebook.generate` on the shared worker; a view shows the result
(:mod:`.widget`) and :mod:`.kernel_hooks` makes
interrupts safe. Every mistake a user can make (a bad flag, an unknown
variable or model, a bad value) ends the cell with one ``UsageError`` line.

Example (in a notebook)::

    %load_ext mlx_notebook
    %config MLXGen.max_tokens = 64

    %%mlxgen -o gen -t 0.7 --seed 1
    Write a haiku about {topic}.

    gen.pause(); gen.resume(); gen.cancel()
    %mlxgen_jobs
"""

from __future__ import annotations

import json
import keyword
from collections.abc import Sequence
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, validate

from ..control import DEFAULT_STOP_BUDGET_S
from ..errors import MLXNotebookError
from ..generation.handle import Generation
from ..generation.prefix_cache import DEFAULT_PROMPT_CACHE_GB
from ..generation.request import DEFAULT_MAX_BATCH, GenerationRequest, check_option, is_messages
from ..generation.states import State
from ..generation.worker import Worker, default_worker
from ..loading.names import resolve
from ..many import Batch, generate_many
from .interpolate import interpolate
from .kernel_hooks import KernelHooks, deferred_interrupts, wait_for
from .map_inputs import map_prompts
from .map_widget import make_map_view
from .widget import FORMAT_CHOICES, UI_CHOICES, DisplayRouter, error_line, make_view

# Traits that are defaults of GenerationRequest fields of the same name.
_REQUEST_TRAITS = (
    "model",
    "max_tokens",
    "temperature",
    "system",
    "stop_budget",
    "max_batch",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context",
    "logit_bias",
    "stop",
    "logprobs",
)


def _fail(message: str) -> UsageError:
    # One line, no traceback: IPython prints a UsageError as "UsageError: <message>".
    return UsageError(f"mlxgen: {message}")


@magics_class
class MLXGen(Magics):
    """Cancellable MLX generation from notebook cells.

    The class name is the config section: ``%config MLXGen.model = "..."``,
    ``c.MLXGen.max_tokens = 64`` in ``ipython_config.py``, or
    ``--MLXGen.max_tokens=64`` on the kernel's command line.

    Args:
        shell: The IPython shell.
        worker: The worker to queue on. Default: :func:`mlx_notebook.default_worker`,
          shared with :func:`mlx_notebook.generate`.
        router: Re-sends final displays for headless clients. Default: a new one.
    """

    model = Unicode(
        None,
        allow_none=True,
        help="Model for %%mlxgen without -m: 'default' (SmolLM2-135M), a local MLX "
        "folder, a .gguf file, or a cached hub id. None means the default model.",
    ).tag(config=True)
    max_tokens = Integer(256, help="Most tokens a generation makes (-n).").tag(config=True)
    temperature = Float(0.0, help="Sampling temperature; 0 is greedy (-t).").tag(config=True)
    system = Unicode(None, allow_none=True, help="System message (-s).").tag(config=True)
    stop_budget = Float(
        DEFAULT_STOP_BUDGET_S, help="Seconds one piece of work may take: the longest a stop or pause waits (--budget)."
    ).tag(config=True)
    top_k = Integer(None, allow_none=True, help="Sample among the k most likely tokens only (--top-k).").tag(
        config=True
    )
    min_p = Float(
        None, allow_none=True, help="Drop tokens less likely than min_p times the most likely (--min-p)."
    ).tag(config=True)
    repetition_penalty = Float(
        None, allow_none=True, help="mlx-lm's repetition penalty, > 1 discourages repeats (--repetition-penalty)."
    ).tag(config=True)
    repetition_context = Integer(20, help="Tokens the repetition penalty looks back at (--repetition-context).").tag(
        config=True
    )
    logit_bias = Dict(
        None, allow_none=True, help="{token_id: bias} added to the logits (--logit-bias JSON or NAME)."
    ).tag(config=True)
    stop = List(
        Unicode(), default_value=None, allow_none=True, help="Strings that end the generation (--stop, repeatable)."
    ).tag(config=True)
    logprobs = Integer(
        0, help="Keep each token's log-probability and this many alternatives in gen.logprobs (--logprobs)."
    ).tag(config=True)
    max_batch = Integer(
        DEFAULT_MAX_BATCH,
        help="Most generations of one model decoded together (1 runs each alone); "
        "cells started while others run join their batch.",
    ).tag(config=True)
    prompt_cache_gb = Float(
        DEFAULT_PROMPT_CACHE_GB,
        help="GB of KV caches of past generations kept per model, so that a prompt "
        "sharing a prefix with an earlier one prefills only the rest; 0 turns it off.",
    ).tag(config=True)
    wait = Bool(False, help="Block the cell until the generation ends (--wait); else it runs in the background.").tag(
        config=True
    )
    throttle = Float(0.1, help="Least seconds between two display updates while tokens stream.").tag(config=True)
    format = Enum(
        FORMAT_CHOICES,
        "markdown",
        help="'markdown': the answer rendered as Markdown (code highlighted), and one "
        "Markdown output when it ends; 'text': plain text (--format).",
    ).tag(config=True)
    ui = Enum(
        UI_CHOICES,
        "auto",
        help="'widget' (Stop/Pause buttons), 'text' (plain text display), or 'auto': "
        "widget in a kernel with ipywidgets, text otherwise.",
    ).tag(config=True)

    shell: Any  # the InteractiveShell (typed None in Magics)

    def __init__(
        self,
        shell: Any = None,
        *,
        worker: Worker | None = None,
        router: DisplayRouter | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(shell=shell, **kwargs)
        self._given_worker = worker
        self._worker = worker
        self.router = router or DisplayRouter()
        self.hooks: KernelHooks | None = None  # set by mlx_notebook.notebook.extension.load
        self.first_view_notice = ""  # one line for the next widget only (extension.load)

    # -- config checks (shown in one line by %config) --------------------------------

    @validate(*_REQUEST_TRAITS)
    def _check_request_option(self, proposal: Any) -> Any:
        # The request's own checks: one validation for the API, the magic and %config.
        try:
            check_option(proposal["trait"].name, proposal["value"])
        except MLXNotebookError as exc:
            raise TraitError(f"MLXGen.{exc}") from None
        return proposal["value"]

    @validate("prompt_cache_gb")
    def _check_prompt_cache_gb(self, proposal: Any) -> float:
        value = proposal["value"]
        if not value >= 0 or value == float("inf"):
            raise TraitError(f"MLXGen.prompt_cache_gb must be a number of GB >= 0 (0 turns it off), got {value}")
        return value

    @validate("throttle")
    def _check_throttle(self, proposal: Any) -> float:
        if not proposal["value"] >= 0:
            raise TraitError(f"MLXGen.throttle must be >= 0 seconds, got {proposal['value']}")
        return proposal["value"]

    # -- the worker ---------------------------------------------------------------------

    @property
    def worker(self) -> Worker:
        """The worker generations queue on (made on first use)."""
        if self._given_worker is not None:
            return self._given_worker
        # Asked each time: default_worker() replaces a worker that was shut down.
        worker = default_worker()
        assert worker is not None  # create=True always gives one
        self._worker = worker
        if worker.prompt_cache_gb != self.prompt_cache_gb:
            worker.prompt_cache_gb = self.prompt_cache_gb
        return worker

    def used_worker(self) -> Worker | None:
        """The worker generations run on, or ``None`` when none was started yet.

        Includes the shared worker of :func:`mlx_notebook.generate`, so hooks
        also stop generations started from Python rather than the magic.
        """
        if self._given_worker is not None:
            return self._given_worker
        return default_worker(create=False) or self._worker

    # -- %%mlxgen ---------------------------------------------------------------------------

    @magic_arguments()
    @argument("-m", "--model", default=None, help="model name, folder or .gguf file (config: MLXGen.model)")
    @argument("-n", "--max-tokens", type=int, default=None, help="most tokens to generate (MLXGen.max_tokens)")
    @argument("-t", "--temperature", type=float, default=None, help="0 is greedy (MLXGen.temperature)")
    @argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 disables it (default 1)")
    @argument("--seed", type=int, default=None, help="sampling seed, for reproducible sampling")
    @argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (MLXGen.top_k)")
    @argument("--min-p", type=float, default=None, help="min-p sampling threshold (MLXGen.min_p)")
    @argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats")
    @argument("--repetition-context", type=int, default=None, help="tokens the penalty looks back at (20)")
    @argument(
        "--logit-bias", default=None, metavar="JSON|NAME", help="{token_id: bias} as JSON, or a dict variable's name"
    )
    @argument("--stop", action="append", default=None, metavar="TEXT", help="end the generation at TEXT (repeatable)")
    @argument("--logprobs", type=int, default=None, metavar="K", help="keep log-probs and K alternatives")
    @argument("-s", "--system", default=None, help="system message (MLXGen.system)")
    @argument("--raw", action="store_true", help="no chat template: feed the prompt as is")
    @argument("-o", "--out", default=None, metavar="NAME", help="bind the Generation handle to NAME")
    @argument(
        "--wait",
        dest="wait",
        action="store_const",
        const=True,
        default=None,
        help="block the cell until done; Interrupt stops it safely (MLXGen.wait)",
    )
    @argument(
        "--no-wait",
        dest="wait",
        action="store_const",
        const=False,
        help="run in the background even if MLXGen.wait is set",
    )
    @argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="longest a stop or pause may wait (MLXGen.stop_budget)",
    )
    @argument("--plain", action="store_true", help="plain text display instead of the widget")
    @argument("--format", choices=FORMAT_CHOICES, default=None, help="markdown or text (MLXGen.format)")
    @argument(
        "--map",
        default=None,
        metavar="NAME",
        help="one generation per item of the list NAME, {item} in the body being the item "
        "({item.field}, {item[key]}); one widget for all, -o binds their Batch",
    )
    @cell_magic
    def mlxgen(self, line: str, cell: str) -> None:
        """Generate from the cell body with a local MLX model, in the background.

        The cell body is the prompt; ``{name}`` and ``{name.attr}`` insert
        variables, ``{{name}}`` is a literal ``{name}``, other braces stay as
        written. The cell returns at once and the text streams into a widget
        with Stop and Pause/Resume buttons; with ``--wait`` the cell blocks and
        "Interrupt kernel" stops the generation safely. With ``--map NAME`` the
        body is filled once per item of the list ``NAME`` (``{item}``,
        ``{item.field}``, ``{item[key]}``) and one widget shows every input.
        """
        __tracebackhide__ = True
        args = _parse(self.mlxgen, line)
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise _fail(f"--out needs a Python variable name, got {args.out!r}")
        if not cell.strip():
            raise _fail("the cell is empty: write the prompt below the %%mlxgen line")
        if args.map is not None:
            self._mlxgen_map(args, cell.strip())
            return
        try:
            prompt = interpolate(cell.strip(), self.shell.user_ns)
        except MLXNotebookError as exc:
            raise _fail(error_line(exc)) from None
        request = GenerationRequest(prompt, **self._options(args))
        waiting = self.wait if args.wait is None else args.wait
        # From queueing to waiting, an interrupt is noted rather than raised: raised
        # mid-way it would leave the generation running unseen, or a widget that
        # no longer updates (ipywidgets' hold_sync). Noted, it stops the generation.
        with deferred_interrupts() as interrupted:
            try:
                from ..cluster.routing import submit  # a request for a running cluster's model runs on its ranks

                gen = submit(request, self.worker)
            except MLXNotebookError as exc:
                raise _fail(error_line(exc)) from None
            if args.out is not None:
                self.shell.user_ns[args.out] = gen
            self.show(gen, args, waiting=waiting, interrupted=interrupted)
        if waiting:
            if gen.state is State.FAILED and gen.error is not None:
                raise _fail(f"#{gen.id} failed: {error_line(gen.error)}")

    def show(self, gen: Generation, args: Any, *, waiting: bool, interrupted: Sequence[float] = ()) -> None:
        """Show ``gen``'s view in the cell (``--plain``, ``--format``) and wait for it when asked.

        ``interrupted`` is the live list from :func:`deferred_interrupts`: it is
        read after the view is shown, since an interrupt may land while it is.
        """
        view = make_view(
            gen,
            shell=self.shell,
            ui="text" if args.plain else self.ui,
            throttle=self.throttle,
            router=self.router,
            waiting=waiting,
            format=args.format or self.format,
            notice=self.first_view_notice,
        )
        self.first_view_notice = ""
        view.show()
        if waiting or interrupted:
            wait_for(gen, interrupted=bool(interrupted))

    def _options(self, args: Any) -> dict[str, Any]:
        """The request's options from the cell's flags; a flag wins over the trait of the same name."""
        given = {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "system": args.system,
            "stop_budget": args.budget,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "repetition_context": args.repetition_context,
            "logit_bias": self._logit_bias(args.logit_bias),
            "stop": args.stop,
            "logprobs": args.logprobs,
        }
        options = {name: getattr(self, name) if given.get(name) is None else given[name] for name in _REQUEST_TRAITS}
        return dict(options, top_p=args.top_p, seed=args.seed, chat=not args.raw)

    def _logit_bias(self, text: str | None) -> dict[int, float] | None:
        """``--logit-bias``: a dict variable's name, or JSON such as ``{"1234": -100}``."""
        if text is None:
            return None
        if text.isidentifier() and text in self.shell.user_ns:
            value = self.shell.user_ns[text]
        else:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _fail(
                    f"--logit-bias must be JSON like '{{\"1234\": -100}}' or a dict variable's name: {exc.msg}"
                ) from None
        if not isinstance(value, dict):
            raise _fail(f"--logit-bias must be a dict of token id to bias, got {type(value).__name__}")
        try:
            return {int(k): v for k, v in value.items()}
        except (TypeError, ValueError):
            raise _fail("--logit-bias keys must be token ids (integers)") from None

    def _mlxgen_map(self, args: Any, template: str) -> None:
        """``%%mlxgen --map NAME``: one generation per item, one view for all."""
        __tracebackhide__ = True
        try:
            prompts = map_prompts(template, args.map, self.shell.user_ns)
        except MLXNotebookError as exc:
            raise _fail(error_line(exc)) from None
        waiting = self.wait if args.wait is None else args.wait
        # As for one generation: an interrupt from queueing to waiting is noted, then stops them all.
        with deferred_interrupts() as interrupted:
            try:
                batch = generate_many(prompts, worker=self.worker, **self._options(args))
            except MLXNotebookError as exc:
                raise _fail(f"--map {args.map}: {error_line(exc)}") from None
            if args.out is not None:
                self.shell.user_ns[args.out] = batch
            view = make_map_view(
                batch,
                shell=self.shell,
                ui="text" if args.plain else self.ui,
                throttle=self.throttle,
                router=self.router,
                waiting=waiting,
            )
            view.show()
            if waiting or interrupted:
                _wait_for_batch(batch, interrupted)
        failed = [(i, g, g.error) for i, g in enumerate(batch) if g.state is State.FAILED and g.error is not None]
        if waiting and failed:
            index, gen, error = failed[0]
            raise _fail(f"{len(failed)} of {len(batch)} failed; {args.map}[{index}] (#{gen.id}): {error_line(error)}")

    # -- %mlxgen_stop -------------------------------------------------------------------------

    @magic_arguments()
    @argument("target", nargs="?", default="all", help="a generation id (see %%mlxgen_jobs), or 'all'")
    @line_magic
    def mlxgen_stop(self, line: str) -> None:
        """Stop one generation, or all running and queued ones (the default)."""
        args = _parse(self.mlxgen_stop, line)
        worker = self.used_worker()
        if args.target == "all":
            stopped = worker.cancel_all() if worker is not None else []
            cluster = _cluster()
            if cluster is not None:
                stopped += cluster.cancel_all()
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
            raise _fail(f"give a generation id or 'all', got {target!r}")
        for gen in self._history():
            if gen.id == int(text):
                return gen
        raise _fail(f"no generation #{text}: %mlxgen_jobs lists them")

    def _history(self) -> list[Generation]:
        """This kernel's generations, local and on its cluster, oldest first."""
        worker = self.used_worker()
        gens = list(worker.history) if worker is not None else []
        cluster = _cluster()
        if cluster is not None:
            gens += cluster.history
        return sorted(gens, key=lambda g: g.id)

    # -- %mlxgen_jobs ---------------------------------------------------------------------------

    @line_magic
    def mlxgen_jobs(self, line: str = "") -> None:
        """List this kernel's generations: id, state, tokens, tok/s, prompt."""
        if line.strip():
            raise _fail("%mlxgen_jobs takes no arguments")
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
        args = _parse(self.mlxgen_models, line)
        worker = self.used_worker()
        if args.unload is not None:
            self._unload(args.unload)
            return
        loaded = worker.store.loaded() if worker is not None else []
        if not loaded:
            print("no model loaded")
            return
        rows = [["model", "parameters", "loaded in", "prompt cache", "path"]]
        for m in loaded:
            kept = m.prompt_cache
            cached = f"{len(kept)} x, {kept.nbytes / 2**20:.0f} MB" if kept is not None else "-"
            rows.append([m.source.name, f"{m.nbytes / 2**20:.0f} MB", f"{m.load_s:.1f} s", cached, str(m.source.path)])
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
            raise _fail(error_line(exc)) from None
        worker = self.used_worker()
        busy = worker.active() if worker is not None else []
        if busy:
            ids = ", ".join(f"#{g.id}" for g in busy)
            raise _fail(f"generations {ids} are running or queued; stop them first (%mlxgen_stop)")
        if worker is None:
            print(f"{name}: not loaded")
            return
        try:
            # On the worker thread: MLX work (freeing included) belongs to it.
            removed = worker.call(lambda store: store.unload(name), timeout=30)
        except MLXNotebookError as exc:
            raise _fail(error_line(exc)) from None
        except TimeoutError as exc:
            raise _fail(str(exc)) from None
        print(f"{name}: unloaded" if removed else f"{name}: not loaded")


def _wait_for_batch(batch: Batch, interrupted: list[float]) -> None:
    """Wait for every member; on an interrupt stop them all, drain, then raise ``KeyboardInterrupt``.

    Runs inside :func:`.kernel_hooks.deferred_interrupts`: :func:`.kernel_hooks.wait_for`
    turns an interrupt during its wait into a drained stop of that member, and
    one between two waits is noted in ``interrupted``; either way the others
    are stopped and waited for before the interrupt is raised.
    """
    __tracebackhide__ = True
    try:
        for gen in batch:
            wait_for(gen, interrupted=bool(interrupted))
    except KeyboardInterrupt:
        pass
    else:
        return
    batch.cancel()
    batch.wait()  # further interrupts are noted by deferred_interrupts, never abandon the drain
    raise KeyboardInterrupt(f"mlxgen map stopped: {batch.summary()}; the model stays loaded")


def _cluster() -> Any:
    """The kernel's cluster, if one was started (its generations are listed and stopped too)."""
    from ..cluster.routing import current

    return current()


def parse_options(magic: Any, line: str) -> Any:
    """A magic's options, split as a shell does.

    IPython's ``parse_argstring`` keeps the quotes: ``-s 'Be terse'`` would
    give the system message ``'Be terse'`` quotes included.

    Raises:
        UsageError: argparse's message (e.g. "unrecognized arguments: --x"),
          or an unclosed quote.
    """
    try:
        argv = arg_split(line, posix=True)
    except ValueError as exc:  # shlex: "No closing quotation"
        raise UsageError(f"{str(exc).lower()} in the magic's options") from None
    return magic.parser.parse_args(argv)


def _parse(magic: Any, line: str) -> Any:
    try:
        return parse_options(magic, line)
    except UsageError as exc:
        raise _fail(str(exc)) from None


def _as_cell_magic_help(magic: Any) -> None:
    # magic_arguments writes usage as "%name"; a cell magic is typed "%%name".
    name = magic.parser.prog.lstrip("%")
    magic.parser.prog = f"%%{name}"
    magic.__doc__ = magic.__doc__.replace(f"%{name} [", f"%%{name} [", 1)


_as_cell_magic_help(MLXGen.mlxgen)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
