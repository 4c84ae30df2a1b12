"""``%mlxgen_cluster``: start, inspect, stop and restart the kernel's cluster from a cell.

Thin: it parses and calls :mod:`mlx_notebook.cluster`, which also works
without IPython. Every mistake (a bad flag, backend, hostfile or model, a
cluster that cannot start) ends the cell with one ``UsageError`` line.

Example (in a notebook)::

    %load_ext mlx_notebook
    %mlxgen_cluster start -n 2 --backend ring --model /models/llama --name llama
    %%mlxgen -m llama
    Name three rivers.

    %mlxgen_cluster status
    %mlxgen_cluster stop
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .. import cluster
from ..errors import MLXNotebookError
from .magics import parse_options
from .widget import error_line


def _fail(message: str) -> UsageError:
    return UsageError(f"mlxgen_cluster: {message}")


@magics_class
class ClusterMagics(Magics):
    """The ``%mlxgen_cluster`` line magic."""

    @magic_arguments()
    @argument("action", choices=["start", "status", "stop", "restart"], help="what to do")
    @argument("--model", "-m", default=None, help="local MLX folder, .gguf file or cached hub id (start)")
    @argument("-n", "--ranks", type=int, default=2, help="ranks on this host, without --hostfile (default 2)")
    @argument("--backend", default="ring", help="ring, mpi, jaccl, jaccl-ring or nccl (default ring)")
    @argument("--hostfile", default=None, metavar="FILE", help="mlx.launch hostfile; its first host is this machine")
    @argument("--pipeline", action="store_true", help="pipeline stages instead of tensor parallel")
    @argument("--name", default=None, help="the name %%mlxgen -m uses for this model (default: --model)")
    @argument("--watchdog", type=float, default=None, metavar="SECONDS", help="fail a silent cluster after this (5)")
    @line_magic
    def mlxgen_cluster(self, line: str) -> None:
        """Start a model sharded over ranks with ``mlx.launch``; ``%%mlxgen -m NAME`` then runs there."""
        try:
            args = parse_options(self.mlxgen_cluster, line)
        except UsageError as exc:
            raise _fail(str(exc)) from None
        try:
            self._run(args)
        except MLXNotebookError as exc:
            raise _fail(error_line(exc)) from None

    def _run(self, args: Any) -> None:
        if args.action == "start":
            if not args.model:
                raise _fail("start needs --model: a local MLX model folder or a .gguf file")
            started = cluster.start(
                args.model,
                ranks=args.ranks,
                backend=args.backend,
                hostfile=args.hostfile,
                pipeline=args.pipeline,
                name=args.name,
                watchdog_s=args.watchdog,
            )
            print(f"{started.status()}; %%mlxgen -m {started.name} runs there")
        elif args.action == "status":
            found = cluster.status()
            print(found if found is not None else "no cluster: %mlxgen_cluster start --model PATH")
        elif args.action == "stop":
            print("cluster stopped" if cluster.stop() else "no cluster to stop")
        else:
            print(cluster.restart().status())


def register(ipython: Any) -> None:
    """Register ``%mlxgen_cluster`` in ``ipython``."""
    ipython.register_magics(ClusterMagics(shell=ipython))
