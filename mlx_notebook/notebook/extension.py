"""``%load_ext mlx_notebook`` / ``%unload_ext mlx_notebook``: wire and unwire everything.

Loading registers the :class:`~mlx_notebook.notebook.magics.MLXGen` magics (and with
them the ``MLXGen`` config section), the IPython events the display router
needs, and the kernel hooks (idle SIGINT, shutdown, exit). Unloading stops
the running and queued generations and waits for the worker to park, then
removes the magics and restores every hook; the worker keeps its loaded
models for the next load.

On Linux CPU, if ``mlx`` was imported before this package (a notebook that
starts with ``import mlx.core as mx``), MLX's matmuls use the reference BLAS,
about 10x slower prefill: loading says so in one line, with the fix, and the
first widget repeats it (:func:`slow_blas_notice`). The loaded state lives in IPython's own magics
registry, so loading twice (IPython already refuses a second ``%load_ext``;
a direct second call is caught here) never doubles anything.

Example::

    %load_ext mlx_notebook
    %unload_ext mlx_notebook
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from traitlets import TraitError

from ..loading.blas import reference_blas_fix
from .kernel_hooks import SHUTDOWN_DRAIN_S, KernelHooks
from .magics import MLXGen

# IPython registers a Magics instance under its class name.
_REGISTRY_KEY = MLXGen.__name__
_EVENTS = ("pre_run_cell", "post_run_cell")


def slow_blas_notice() -> str:
    """One line when MLX computes on the CPU with the reference BLAS by accident, else ``""``."""
    fix = reference_blas_fix()
    if not fix or "mlx.core" not in sys.modules:
        return ""  # nothing to fix, or mlx not imported yet: it will bind OpenBLAS
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return ""  # the model runs on a GPU; the CPU's BLAS hardly matters
    return f"mlx-notebook: MLX's CPU matmuls use the slow reference BLAS (prefill ~10x slower); fix: {fix}"


def loaded_magics(ipython: Any) -> MLXGen | None:
    """The ``MLXGen`` instance registered in ``ipython``, or ``None``."""
    magics = ipython.magics_manager.registry.get(_REGISTRY_KEY)
    return magics if isinstance(magics, MLXGen) else None


def load(ipython: Any) -> MLXGen:
    """Register the magics, events and kernel hooks; return the magics (idempotent)."""
    existing = loaded_magics(ipython)
    if existing is not None:
        return existing
    try:
        magics = MLXGen(shell=ipython)
    except TraitError as exc:
        # IPython keeps a value %config rejected in the shell's config, and a
        # new MLXGen reads it from there: one line with the fix, no traceback.
        raise UsageError(
            f"mlxgen: {exc} (in the IPython config); set a valid value with %config, then load again"
        ) from None
    ipython.register_magics(magics)
    from .cluster_magic import register as register_cluster_magic  # %mlxgen_cluster

    register_cluster_magic(ipython)
    from .chat_magic import register as register_chat_magic  # %%mlxchat, on MLXGen's config
    from .job_magics import register as register_job_magics  # %mlxgen_stop, _jobs, _models
    from .save_magics import register as register_save_magics  # %mlxgen_save, _resume

    register_chat_magic(ipython, magics)
    register_job_magics(ipython, magics)
    register_save_magics(ipython, magics)
    for event in _EVENTS:
        ipython.events.register(event, getattr(magics.router, event))
    magics.hooks = KernelHooks(ipython, worker=magics.used_worker, views=magics.router)
    magics.hooks.install()
    notice = slow_blas_notice()
    if notice:
        print(notice, file=sys.stderr)
        magics.first_view_notice = notice
    return magics


def unload(ipython: Any) -> None:
    """Remove the magics and restore every hook :func:`load` installed."""
    magics = loaded_magics(ipython)
    if magics is None:
        return
    worker = magics.used_worker()
    if worker is not None:
        # Without the magics and the interrupt hook, %mlxgen_stop and
        # Interrupt could no longer stop them.
        worker.cancel_all()
        worker.drain(SHUTDOWN_DRAIN_S)
    hooks = getattr(magics, "hooks", None)
    if hooks is not None:
        hooks.uninstall()
    for event in _EVENTS:
        try:
            ipython.events.unregister(event, getattr(magics.router, event))
        except ValueError:  # already gone
            pass
    from .chat_magic import ChatMagics
    from .cluster_magic import ClusterMagics
    from .job_magics import JobMagics
    from .save_magics import SaveMagics

    for kind in (ChatMagics, ClusterMagics, JobMagics, SaveMagics):
        others = ipython.magics_manager.registry.get(kind.__name__)
        if isinstance(others, kind):
            _remove(ipython, others, kind.__name__)
    _remove(ipython, magics, _REGISTRY_KEY)
    if magics in getattr(ipython, "configurables", []):
        ipython.configurables.remove(magics)


def _remove(ipython: Any, magics: Any, key: str) -> None:
    """Take ``magics``' entries out of ``ipython``'s tables, and it out of the registry."""
    manager = ipython.magics_manager
    registered: dict[str, dict[str, str]] = magics.magics or {}
    for kind, names in registered.items():
        table = manager.magics.get(kind, {})
        for name in names:
            # Only our own entries: another extension may have taken a name since.
            if getattr(table.get(name), "__self__", None) is magics:
                del table[name]
    manager.registry.pop(key, None)
