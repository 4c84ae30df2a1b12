"""The flags of a request's options, for ``%%mlxgen`` and ``%%mlxchat``: one spelling per option.

:class:`~mlx_notebook.generation.request.GenerationRequest` declares the
options; this table says how each is typed on a magic's line. Every option
of :func:`~mlx_notebook.generation.request.option_names` should have exactly
one entry (:func:`without_flag` lists those that do not, and a test wants
none; an option without one is simply not on the line), and the
argparse destination of a flag is its option's name: ``--budget`` fills
``args.stop_budget``. :func:`option_arguments` adds them to a magic;
:func:`given_options` reads back the ones that were typed.

Example::

    @magic_arguments()
    @option_arguments(exclude=("model", "system", "chat"))
    @cell_magic
    def mlxchat(self, line, cell): ...
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from IPython.core.magic_arguments import argument

from ..generation.request import option_names


def on_off(text: str) -> bool:
    """``--thinking on|off`` (also true/false, yes/no, 1/0)."""
    value = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    found = value.get(text.strip().lower())
    if found is None:
        raise argparse.ArgumentTypeError(f"give on or off, got {text!r}")
    return found


def key_value(text: str) -> tuple[str, Any]:
    """``--template-arg KEY=VALUE``: the value as JSON when it parses (``true``, ``3``), else as text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"give KEY=VALUE, e.g. enable_thinking=false, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


@dataclass(frozen=True)
class Flag:
    """How one option is typed on a magic's line (argparse's arguments, the destination aside)."""

    flags: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    action: str | None = None
    const: Any = None


FLAGS: dict[str, Flag] = {
    "model": Flag(("-m", "--model"), "model name, folder or .gguf file (MLXGen.model)"),
    "max_tokens": Flag(("-n", "--max-tokens"), "most tokens to generate (MLXGen.max_tokens)", int),
    "temperature": Flag(("-t", "--temperature"), "0 is greedy (MLXGen.temperature)", float),
    "top_p": Flag(("--top-p",), "nucleus sampling mass, 1 disables it (default 1)", float),
    "seed": Flag(("--seed",), "sampling seed, for reproducible sampling", int),
    "system": Flag(("-s", "--system"), "system message (MLXGen.system)"),
    "chat": Flag(("--raw",), "no chat template: feed the prompt as is", action="store_const", const=False),
    "stop_budget": Flag(("--budget",), "longest a stop or pause may wait (MLXGen.stop_budget)", float, "SECONDS"),
    "max_batch": Flag(("--max-batch",), "most generations decoded together (MLXGen.max_batch)", int, "N"),
    "top_k": Flag(("--top-k",), "sample among the k most likely tokens (MLXGen.top_k)", int),
    "min_p": Flag(("--min-p",), "min-p sampling threshold (MLXGen.min_p)", float),
    "repetition_penalty": Flag(("--repetition-penalty",), "> 1 discourages repeats", float),
    "repetition_context": Flag(("--repetition-context",), "tokens the penalty looks back at (20)", int),
    "logit_bias": Flag(("--logit-bias",), "{token_id: bias} as JSON, or a dict variable's name", metavar="JSON|NAME"),
    "stop": Flag(("--stop",), "end the answer at TEXT (repeatable)", metavar="TEXT", action="append"),
    "logprobs": Flag(("--logprobs",), "keep log-probs and K alternatives", int, "K"),
    "thinking": Flag(("--thinking",), "a reasoning model thinks first, or not (MLXGen.thinking)", on_off, "on|off"),
    "chat_template_kwargs": Flag(
        ("--template-arg",), "a variable for the chat template (repeatable)", key_value, "KEY=VALUE", "append"
    ),
    "thinking_budget": Flag(
        ("--thinking-budget",), "close the reasoning after N tokens (MLXGen.thinking_budget)", int, "N"
    ),
    "kv_bits": Flag(("--kv-bits",), "quantize the KV cache to N bits: 4 or 8 (MLXGen.kv_bits)", int, "N"),
    "kv_group_size": Flag(("--kv-group-size",), "values per KV quantization group (64)", int, "N"),
    "quantized_kv_start": Flag(("--quantized-kv-start",), "tokens before the KV cache is quantized (5000)", int, "N"),
    "max_kv_size": Flag(("--max-kv-size",), "a rotating KV cache of N tokens (MLXGen.max_kv_size)", int, "N"),
    "schema": Flag(("--schema",), "the answer is JSON of this Pydantic class or dict (gen.parsed)", metavar="NAME"),
    "choices": Flag(("--choices",), "the answer is exactly one of these (comma-separated)", metavar="A,B,C"),
    "regex": Flag(
        ("--regex",), "the answer matches this regular expression ({{n}} for {n}: IPython fills {x})", metavar="RE"
    ),
}


def without_flag() -> list[str]:
    """Request options that have no flag here yet (tests/test_option_flags.py wants none).

    Not an import-time error: an option added to the request while its flag
    is still being written must not take the whole extension down.
    """
    return [name for name in option_names() if name not in FLAGS]


def option_arguments(*, exclude: Iterable[str] = ()) -> Callable[[Any], Any]:
    """A decorator adding the flag of every request option but ``exclude`` to a magic (after ``magic_arguments``)."""
    names = [name for name in option_names() if name in FLAGS and name not in set(exclude)]

    def decorate(func: Any) -> Any:
        # magic_arguments builds the parser from the decorators in reverse: the table's order shows in help.
        for name in reversed(names):
            spec = FLAGS[name]
            kwargs: dict[str, Any] = dict(dest=name, default=None, help=spec.help)
            if spec.action is not None:
                kwargs["action"] = spec.action
            if spec.action == "store_const":
                kwargs["const"] = spec.const
            else:
                kwargs.update(type=spec.type, metavar=spec.metavar)
            func = argument(*spec.flags, **{k: v for k, v in kwargs.items() if v is not None or k == "default"})(func)
        return func

    return decorate


def given_options(args: Any, names: Iterable[str]) -> dict[str, Any]:
    """The options of ``names`` typed on the line (``None``: not typed), as the request takes them."""
    given = {name: getattr(args, name, None) for name in names}
    pairs = given.get("chat_template_kwargs")
    if pairs is not None:
        given["chat_template_kwargs"] = dict(pairs)  # [(key, value), ...]: the last one of a key wins
    return {name: value for name, value in given.items() if value is not None}


__all__ = ["FLAGS", "Flag", "given_options", "key_value", "on_off", "option_arguments", "without_flag"]
