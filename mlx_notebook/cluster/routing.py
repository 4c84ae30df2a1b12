"""The kernel's cluster, and where a request runs: on it, or on the local worker.

One cluster per process, like :func:`mlx_notebook.default_worker`: started
with :func:`start`, asked with :func:`current` / :func:`status`, ended with
:func:`stop`. This module is the one place that decides "worker or
cluster?": :func:`submit` (the API, chats, ``generate_many`` and the magic
call it instead of ``worker.submit``: a request whose model the running
cluster serves goes there, any other to the worker), :func:`active`,
:func:`history` and :func:`cancel_all` (the job magics and the kernel's
interrupt hook see both).

Example::

    from mlx_notebook import cluster, generate
    cluster.start("/models/llama-8b", ranks=2, backend="ring")
    gen = generate("Hello", model="/models/llama-8b")   # runs on the ranks
    cluster.stop()

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError
from ..generation.handle import Generation
from ..generation.request import GenerationRequest

if TYPE_CHECKING:
    from ..generation.worker import Worker
    from .client import Cluster, ClusterStatus

_current: Cluster | None = None
_lock = threading.Lock()


def start(
    model: str,
    *,
    ranks: int = 2,
    backend: str = "ring",
    hostfile: str | None = None,
    pipeline: bool = False,
    name: str | None = None,
    python: str | None = None,
    watchdog_s: float | None = None,
) -> Cluster:
    """Start the kernel's cluster and wait until every rank has loaded its shard.

    Args:
        model: A local MLX model folder, a ``.gguf`` file, ``default``, or a
          hub id in the local cache (nothing is downloaded). Every host of a
          hostfile must have it at the same path.
        ranks: Number of ranks on this host (ignored with ``hostfile``). Default: ``2``.
        backend: ``ring``, ``mpi``, ``jaccl``, ``jaccl-ring`` or ``nccl``. Default: ``"ring"``.
        hostfile: An ``mlx.launch`` hostfile; rank 0 (its first host) must be
          this machine. Default: ``None`` (all ranks here).
        pipeline: Pipeline stages instead of tensor parallel. Default: ``False``.
        name: The model name generations use to run here. Default: ``model``.
        python: The interpreter on the other hosts. Default: this one's path.
        watchdog_s: Seconds rank 0 may stay silent before the running
          generations fail and the cluster ends. Default: ``None`` (5 s).

    Raises:
        ClusterError: One already runs, or the ranks could not start.
        ModelNotFoundError: The model is not on this machine.
    """
    from .client import DEFAULT_WATCHDOG_S, Cluster
    from .errors import ClusterError
    from .launch import LaunchSpec

    global _current
    with _lock:
        if _current is not None and _current.ready:
            raise ClusterError(f"a cluster already runs {_current.name!r}: stop or restart it first")
        spec = LaunchSpec(model, ranks=ranks, backend=backend, hostfile=hostfile, pipeline=pipeline, python=python)
        cluster = Cluster(spec, name=name, watchdog_s=watchdog_s or DEFAULT_WATCHDOG_S)
        _current = cluster
    return cluster.start()


def current() -> Cluster | None:
    """The kernel's last cluster (running or ended), or ``None`` when none was started."""
    return _current


def status() -> ClusterStatus | None:
    """The kernel's cluster's :class:`~.client.ClusterStatus`, or ``None``."""
    cluster = _current
    return cluster.status() if cluster is not None else None


def stop() -> bool:
    """End the kernel's cluster (:func:`restart` starts it again); return whether one was running."""
    cluster = _current
    if cluster is None or cluster.status().launcher_pid is None:
        return False
    cluster.stop()
    return True


def restart() -> Cluster:
    """Start the kernel's last cluster again (after a fault or a stop).

    Raises:
        ClusterError: No cluster was started in this process.
    """
    from .errors import ClusterError

    cluster = _current
    if cluster is None:
        raise ClusterError("no cluster to restart: start one first")
    return cluster.restart()


def submit(request: GenerationRequest, worker: Worker) -> Generation:
    """Run ``request`` on the cluster when it serves the request's model, else queue it on ``worker``."""
    cluster = _current
    if cluster is not None and cluster.serves(request.model):
        if request.constraint is not None:
            # The ranks sample with no matcher yet (issue 22): refuse rather than ignore it.
            raise InvalidArgumentError("schema=, choices= and regex= do not run on a cluster yet; use a local model")
        if request.kv_bits is not None or request.max_kv_size is not None:
            raise InvalidArgumentError("kv_bits and max_kv_size do not run on a cluster yet; use a local model")
        return cluster.submit(request)
    return worker.submit(request)


def active(worker: Worker | None) -> list[Generation]:
    """The unfinished generations of ``worker`` (when there is one) and of the cluster."""
    found = worker.active() if worker is not None else []
    cluster = _current
    return found + (cluster.active() if cluster is not None else [])


def history(worker: Worker | None) -> list[Generation]:
    """Every generation submitted to ``worker`` and to the cluster, oldest first."""
    found = list(worker.history) if worker is not None else []
    cluster = _current
    if cluster is not None:
        found += cluster.history
    return sorted(found, key=lambda gen: gen.id)


def cancel_all(worker: Worker | None) -> list[Generation]:
    """Stop every unfinished generation, on ``worker`` and on the cluster; return them."""
    stopped = worker.cancel_all() if worker is not None else []
    cluster = _current
    return stopped + (cluster.cancel_all() if cluster is not None else [])
