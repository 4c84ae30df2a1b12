"""Use the system's OpenBLAS for MLX's CPU matmuls on Linux.

The Linux ``mlx-cpu`` wheel links the reference BLAS: a 2048x2048 fp32 matmul
takes ~2-3 s on a 2-core machine, ~0.06 s with OpenBLAS. Loading OpenBLAS with
``RTLD_GLOBAL`` *before* ``mlx`` is imported makes the dynamic linker bind
MLX's ``cblas_*`` / ``sgemm_`` calls to it (Python loads extensions with
``RTLD_NOW``, so it has to happen before the import, not after).

Set ``MLX_NOTEBOOK_BLAS=reference`` to keep the wheel's BLAS, or
``MLX_NOTEBOOK_BLAS=/path/to/libblas.so`` to pick a library.
:func:`active_blas` says which one is in use.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

# Debian/Ubuntu (libopenblas0-pthread / libopenblas0), then Fedora's name.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded: str | None = None
_note: str = "not tried"
_fix: str = ""  # how to get OpenBLAS when the reference BLAS is in use by accident


def preload_openblas() -> str | None:
    """Load a system OpenBLAS globally if that can still help; return its path.

    Does nothing off Linux, when ``MLX_NOTEBOOK_BLAS=reference``, or when
    ``mlx`` was imported already (too late to rebind; :func:`active_blas`
    says so).
    """
    global _loaded, _note, _fix
    if _loaded is not None:
        return _loaded
    choice = os.environ.get("MLX_NOTEBOOK_BLAS", "auto").strip()
    if not sys.platform.startswith("linux"):
        _note = "not Linux: MLX uses Accelerate or its own kernels"
        return None
    if choice.lower() in ("reference", "off", "0", "none"):
        _note = "reference BLAS kept (MLX_NOTEBOOK_BLAS=reference)"
        return None
    if "mlx.core" in sys.modules:
        _note = "mlx was imported before mlx_notebook; import mlx_notebook first to use OpenBLAS"
        _fix = (
            "restart the kernel and run %load_ext mlx_notebook before importing mlx, "
            "or use a kernel that loads it first: python -m mlx_notebook.kernelspec install"
        )
        return None
    candidates = (choice,) if choice.lower() != "auto" else _CANDIDATES
    for path in candidates:
        if not Path(path).exists():
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            _note = f"could not load {path}: {exc}"
            continue
        _loaded = path
        _note = f"OpenBLAS from {path}"
        return path
    if choice.lower() == "auto":
        _note = "no system OpenBLAS found (apt-get install libopenblas0-pthread makes fp32 CPU matmuls ~30x faster)"
        _fix = "apt-get install libopenblas0-pthread, then restart the kernel"
    else:
        _note = f"MLX_NOTEBOOK_BLAS={choice} could not be loaded; reference BLAS in use"
    return None


def openblas_path() -> str | None:
    """The system OpenBLAS loaded for MLX's CPU matmuls, if one was."""
    return _loaded


def openblas_active() -> bool:
    """Whether MLX's CPU matmuls are bound to a system OpenBLAS."""
    return _loaded is not None


def reference_blas_fix() -> str:
    """How to get OpenBLAS, when MLX on Linux uses the reference BLAS by accident.

    ``""`` when there is nothing to fix: OpenBLAS is in use, not Linux, or the
    reference BLAS was chosen (``MLX_NOTEBOOK_BLAS``).
    """
    return "" if _loaded is not None else _fix


def active_blas() -> str:
    """A one-line description of the BLAS that MLX's CPU matmuls use."""
    if _loaded is not None:
        return _note
    return f"reference BLAS ({_note})"
