"""Generations on a model sharded over processes and GPUs with MLX distributed.

Rank servers (:mod:`.rank`) started by ``mlx.launch`` (:mod:`.launch`) load
the model sharded by mlx-lm and run our budgeted pieces with every
checkpoint agreed by all ranks (:mod:`.agreement`, :mod:`.steps`); the
kernel reaches rank 0 over a local socket (:mod:`.protocol`,
:mod:`.client`). The handle, the widget and the magics are the local
ones; ``docs/cluster.md`` says how to run it and what is guaranteed.

Example::

    from mlx_notebook import cluster, generate
    cluster.start("/models/llama", ranks=2, backend="ring")
    print(generate("Hi", model="/models/llama", max_tokens=16).result(60))
    cluster.stop()

This package never imports IPython or ipywidgets.
"""

from __future__ import annotations

from .errors import ClusterError
from .routing import current, restart, start, status, stop, submit

__all__ = ["ClusterError", "current", "restart", "start", "status", "stop", "submit"]
