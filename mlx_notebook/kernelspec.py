"""A Jupyter kernel that loads mlx-notebook before any cell runs.

On Linux, MLX's CPU matmuls use a system OpenBLAS only if it is loaded before
``mlx`` is imported (:mod:`mlx_notebook.loading.blas`). A notebook whose first
cell is ``import mlx.core as mx`` gets the reference BLAS, about 10x slower
prefill. This kernel loads the extension at start (IPython's
``--ext=mlx_notebook``), so the order of the cells no longer matters and
``%%mlxgen`` works without ``%load_ext``.

Usage::

    python -m mlx_notebook.kernelspec install            # for this user
    python -m mlx_notebook.kernelspec install --sys-prefix
    python -m mlx_notebook.kernelspec install --name mlx --display-name "Python (MLX)"

Then pick "Python 3 (mlx-notebook)" as the notebook's kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

KERNEL_NAME = "mlx-notebook"
DISPLAY_NAME = "Python 3 (mlx-notebook)"


def kernel_json(*, display_name: str = DISPLAY_NAME, python: str = sys.executable) -> dict[str, Any]:
    """The ``kernel.json`` of the kernel: ipykernel, with the extension loaded at start.

    Args:
        display_name: The name frontends show. Default: ``"Python 3 (mlx-notebook)"``.
        python: The interpreter. Default: this one (``sys.executable``).
    """
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=mlx_notebook"],
        "display_name": display_name,
        "language": "python",
        "metadata": {"debugger": True},
    }


def install(
    *,
    name: str = KERNEL_NAME,
    display_name: str = DISPLAY_NAME,
    user: bool = True,
    prefix: str | None = None,
) -> str:
    """Install the kernel spec; return the folder it went to.

    Args:
        name: The kernel's name. Default: ``"mlx-notebook"``.
        display_name: The name frontends show. Default: ``"Python 3 (mlx-notebook)"``.
        user: Into the user's Jupyter data folder. Default: ``True``.
        prefix: Into ``PREFIX/share/jupyter/kernels`` instead (e.g. ``sys.prefix``
          for a virtual environment). Default: ``None``.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "kernel.json").write_text(json.dumps(kernel_json(display_name=display_name), indent=1))
        return KernelSpecManager().install_kernel_spec(
            folder, kernel_name=name, user=user and prefix is None, prefix=prefix
        )


def main(argv: list[str] | None = None) -> None:
    """``python -m mlx_notebook.kernelspec install [--name N] [--display-name D] [--sys-prefix | --prefix P]``."""
    parser = argparse.ArgumentParser(prog="python -m mlx_notebook.kernelspec", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("install", help="install the kernel spec")
    add.add_argument("--name", default=KERNEL_NAME, help=f"kernel name (default {KERNEL_NAME})")
    add.add_argument("--display-name", default=DISPLAY_NAME, help=f"shown name (default {DISPLAY_NAME!r})")
    where = add.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user (the default)")
    where.add_argument("--sys-prefix", action="store_true", help="into this Python environment (sys.prefix)")
    where.add_argument("--prefix", default=None, help="into PREFIX/share/jupyter/kernels")
    args = parser.parse_args(argv)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(name=args.name, display_name=args.display_name, prefix=prefix)
    print(f"installed kernel {args.name!r} ({args.display_name}) in {path}")


if __name__ == "__main__":
    main()
