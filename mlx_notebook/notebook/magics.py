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
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, validate

from ..control import DEFAULT_STOP_BUDGET_S
from ..errors import MLXNotebookError
from ..generation.handle import Generation
from ..generation.kv_settings import DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START
from ..generation.prefix_cache import DEFAULT_PROMPT_CACHE_GB
from ..generation.request import DEFAULT_MAX_BATCH, GenerationRequest, check_option, option_names
from ..generation.states import State
from ..generation.worker import Worker, default_worker
from ..many import Batch, generate_many
from .interpolate import interpolate
from .kernel_hooks import KernelHooks, deferred_interrupts, wait_for
from .map_inputs import map_prompts
from .map_widget import make_map_view
from .option_flags import given_options, option_arguments
from .routing import DisplayRouter
from .structured import choices_from, schema_from
from .text_form import error_line
from .widget import FORMAT_CHOICES, UI_CHOICES, make_view


def fail(message: str) -> UsageError:
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
    thinking = Bool(
        None,
        allow_none=True,
        help="Whether a reasoning model thinks before it answers (--thinking on|off); "
        "None leaves the chat template's default.",
    ).tag(config=True)
    thinking_budget = Integer(
        None, allow_none=True, help="Most reasoning tokens before the answer is forced (--thinking-budget)."
    ).tag(config=True)
    chat_template_kwargs = Dict(
        None, allow_none=True, help="More chat template variables (--template-arg KEY=VALUE, repeatable)."
    ).tag(config=True)
    kv_bits = Integer(
        None, allow_none=True, help="Quantize the KV cache to this many bits, 4 or 8 (--kv-bits); None keeps the dtype."
    ).tag(config=True)
    kv_group_size = Integer(
        DEFAULT_KV_GROUP_SIZE, help="Values per quantization group of the KV cache (--kv-group-size)."
    ).tag(config=True)
    quantized_kv_start = Integer(
        DEFAULT_QUANTIZED_KV_START, help="Tokens in the KV cache before it is quantized (--quantized-kv-start)."
    ).tag(config=True)
    max_kv_size = Integer(
        None, allow_none=True, help="A rotating KV cache of at most this many tokens (--max-kv-size)."
    ).tag(config=True)
    show_thinking = Bool(
        False, help="Text output (headless, --plain) shows the reasoning in full, not one line (--show-thinking)."
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

    @validate(*option_names())  # those that are traits
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
    @option_arguments()
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
    @argument("--plain", action="store_true", help="plain text display instead of the widget")
    @argument("--format", choices=FORMAT_CHOICES, default=None, help="markdown or text (MLXGen.format)")
    @argument(
        "--show-thinking",
        action="store_true",
        help="text output shows the reasoning in full, not one line (MLXGen.show_thinking)",
    )
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
        args = parse_or_fail(self.mlxgen, line)
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise fail(f"--out needs a Python variable name, got {args.out!r}")
        if not cell.strip():
            raise fail("the cell is empty: write the prompt below the %%mlxgen line")
        if args.map is not None:
            self._mlxgen_map(args, cell.strip())
            return
        try:
            prompt = interpolate(cell.strip(), self.shell.user_ns)
        except MLXNotebookError as exc:
            raise fail(error_line(exc)) from None
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
                raise fail(error_line(exc)) from None
            if args.out is not None:
                self.shell.user_ns[args.out] = gen
            self.show(gen, args, waiting=waiting, interrupted=interrupted)
        if waiting:
            if gen.state is State.FAILED and gen.error is not None:
                raise fail(f"#{gen.id} failed: {error_line(gen.error)}")

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
            show_thinking=getattr(args, "show_thinking", False) or self.show_thinking,
        )
        self.first_view_notice = ""
        view.show()
        if waiting or interrupted:
            wait_for(gen, interrupted=bool(interrupted))

    def request_traits(self) -> list[str]:
        """The request options that are also traits (config) of this class."""
        return [name for name in option_names() if self.has_trait(name)]

    def _options(self, args: Any) -> dict[str, Any]:
        """The request's options from the cell's flags; a flag wins over the trait of the same name."""
        given = given_options(args, option_names())
        if "logit_bias" in given:
            given["logit_bias"] = self.logit_bias_from(given["logit_bias"])
        try:  # --schema NAME / --choices a,b,c (structured output)
            if "schema" in given:
                given["schema"] = schema_from(given["schema"], self.shell.user_ns)
            if "choices" in given:
                given["choices"] = choices_from(given["choices"], self.shell.user_ns)
        except MLXNotebookError as exc:
            raise fail(error_line(exc)) from None
        return {**{name: getattr(self, name) for name in self.request_traits()}, **given}

    def logit_bias_from(self, text: str | None) -> dict[int, float] | None:
        """``--logit-bias``: a dict variable's name, or JSON such as ``{"1234": -100}``."""
        if text is None:
            return None
        if text.isidentifier() and text in self.shell.user_ns:
            value = self.shell.user_ns[text]
        else:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise fail(
                    f"--logit-bias must be JSON like '{{\"1234\": -100}}' or a dict variable's name: {exc.msg}"
                ) from None
        if not isinstance(value, dict):
            raise fail(f"--logit-bias must be a dict of token id to bias, got {type(value).__name__}")
        try:
            return {int(k): v for k, v in value.items()}
        except (TypeError, ValueError):
            raise fail("--logit-bias keys must be token ids (integers)") from None

    def _mlxgen_map(self, args: Any, template: str) -> None:
        """``%%mlxgen --map NAME``: one generation per item, one view for all."""
        __tracebackhide__ = True
        try:
            prompts = map_prompts(template, args.map, self.shell.user_ns)
        except MLXNotebookError as exc:
            raise fail(error_line(exc)) from None
        waiting = self.wait if args.wait is None else args.wait
        # As for one generation: an interrupt from queueing to waiting is noted, then stops them all.
        with deferred_interrupts() as interrupted:
            try:
                batch = generate_many(prompts, worker=self.worker, **self._options(args))
            except MLXNotebookError as exc:
                raise fail(f"--map {args.map}: {error_line(exc)}") from None
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
            raise fail(f"{len(failed)} of {len(batch)} failed; {args.map}[{index}] (#{gen.id}): {error_line(error)}")


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


def parse_or_fail(magic: Any, line: str) -> Any:
    try:
        return parse_options(magic, line)
    except UsageError as exc:
        raise fail(str(exc)) from None


def as_cell_magic_help(magic: Any) -> None:
    # magic_arguments writes usage as "%name"; a cell magic is typed "%%name".
    name = magic.parser.prog.lstrip("%")
    magic.parser.prog = f"%%{name}"
    magic.__doc__ = magic.__doc__.replace(f"%{name} [", f"%%{name} [", 1)


as_cell_magic_help(MLXGen.mlxgen)
