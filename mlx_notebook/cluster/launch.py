"""Starting and ending the rank processes: ``mlx.launch`` in its own process group.

``mlx.launch`` starts one rank server (:mod:`.rank`) per rank (over ssh for
other hosts of a hostfile) and ends them all when one fails. Ended itself by
a signal it leaves its local ranks running, so it runs in a session of its
own and :meth:`Launcher.stop` signals the whole group; ranks on the kernel's
host also watch the kernel's process (:mod:`.rank`'s lifeline), so a killed
kernel leaves nothing behind either.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import ModelNotFoundError
from ..loading.names import SourceKind, cache_dir, resolve
from .errors import ClusterError

BACKENDS = ("ring", "mpi", "jaccl", "jaccl-ring", "nccl")
# mlx.launch's own entry point, run with this interpreter, with stdin forwarding off: each of
# its per-rank threads select()s on the rank's stdin pipe, which is always writable, so
# without this they spin (measured: ~30% of a core for the cluster's whole life).
LAUNCH_MAIN = (
    "import select, sys; from mlx._distributed_utils import launch; "
    "launch.select = lambda r, w, x, t=None: (select.select(r, [], x, t)[0], [], []); "
    "sys.exit(launch.main())"
)


@dataclass
class LaunchSpec:
    """What to launch.

    Args:
        model: The model name as given (a local MLX folder, a ``.gguf`` file,
          ``default``, or a hub id in the local cache).
        ranks: Number of ranks (with ``hostfile``: the hosts in it). Default: ``2``.
        backend: MLX distributed backend: ``ring``, ``mpi``, ``jaccl``,
          ``jaccl-ring`` or ``nccl``. Default: ``"ring"``.
        hostfile: An ``mlx.launch`` JSON hostfile; ``None`` runs every rank on
          this host. Default: ``None``.
        pipeline: Pipeline stages (``model.model.pipeline``) instead of tensor
          parallel (``model.shard``). Default: ``False``.
        python: The interpreter on the other hosts. Default: ``None`` (this one's path).
    """

    model: str
    ranks: int = 2
    backend: str = "ring"
    hostfile: str | None = None
    pipeline: bool = False
    python: str | None = None

    def check(self) -> None:
        """Raise :class:`ClusterError` (one line, with the fix) for a bad backend, rank count or hostfile."""
        if self.backend not in BACKENDS:
            raise ClusterError(f"unknown backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ClusterError(f"ranks must be a positive integer, got {self.ranks!r}")
        if self.hostfile is not None:
            self.ranks = hostfile_ranks(self.hostfile)


def hostfile_ranks(path: str) -> int:
    """The number of hosts in an ``mlx.launch`` hostfile, or :class:`ClusterError` saying what is wrong."""
    from mlx._distributed_utils.common import Hostfile

    if not Path(path).expanduser().is_file():
        raise ClusterError(f"hostfile {path!r} not found: give a JSON file listing the hosts (see docs/cluster.md)")
    try:
        hosts = Hostfile.from_file(str(Path(path).expanduser())).hosts
    except Exception as exc:  # mlx's parser raises ValueError, KeyError, JSONDecodeError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(
            f"hostfile {path!r} is not valid ({first}): expected JSON with a 'hosts' list of "
            '{"ssh": NAME, "ips": [IP]} entries (see docs/cluster.md)'
        ) from None
    if not hosts:
        raise ClusterError(f"hostfile {path!r} lists no hosts")
    return len(hosts)


def model_folder(name: str) -> Path:
    """The local MLX folder the ranks load for ``name`` (a GGUF file is converted once, here).

    Raises:
        ModelNotFoundError: Nothing local matches (hub ids are never downloaded).
    """
    source = resolve(name)
    if source.kind is SourceKind.GGUF:
        from ..loading import gguf

        return Path(gguf.cached_conversion(source.path, cache_dir())).resolve()
    if source.kind is not SourceKind.MLX:
        raise ModelNotFoundError(f"model {name!r} lives in memory only: give a local MLX folder to a cluster")
    return source.path.resolve()


# The config fields tensor parallelism splits over the ranks (mlx-lm's ``shard`` of llama, qwen3...).
SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def shape_config(config: dict) -> dict:
    """The part of a model config that holds the layer shapes (``text_config`` of a multimodal one)."""
    inner = config.get("text_config")
    return inner if "num_attention_heads" not in config and isinstance(inner, dict) else config


def workable_ranks(config: dict, limit: int = 64) -> list[int]:
    """Rank counts from 2 to ``limit`` that divide every split shape of ``config`` (heads, KV heads, MLP)."""
    values = [v for v in (config.get(k) for k in SPLIT_KEYS) if isinstance(v, int) and v > 0]
    return [n for n in range(2, limit + 1) if all(v % n == 0 for v in values)]


def check_divisible(config: dict, ranks: int, *, can_pipeline: bool = True) -> None:
    """Raise :class:`ValueError` (one line, naming rank counts that work) when ``ranks`` does not split the heads or MLP.

    Args:
        config: The model config.
        ranks: The rank count asked for.
        can_pipeline: Whether to suggest ``--pipeline`` when no rank count works. Default: ``True``.
    """
    config = shape_config(config)
    kind = config.get("model_type", "?")
    for key in SPLIT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value % ranks:
            sizes = workable_ranks(config)
            if sizes:
                fix = f"use {' or '.join(str(n) for n in sizes[:4])} ranks"
            else:
                fix = "no rank count above 1 splits its heads, KV heads and MLP alike"
                fix += "; try --pipeline" if can_pipeline else ""
            raise ValueError(f"model type {kind!r} has {key}={value}, not divisible by {ranks} ranks; {fix}")


def sharding_support(config: dict) -> tuple[bool, bool] | None:
    """Whether mlx-lm's model for ``config`` has tensor parallel (``Model.shard``) and pipeline stages.

    Read from mlx-lm's model module without building the model: pipeline
    stages need a model class with ``pipeline`` (``PipelineMixin``). ``None``
    for a model type mlx-lm does not know (the ranks' own load says what is
    wrong then).
    """
    import mlx.nn as nn

    try:
        from mlx_lm.utils import _get_classes

        model_class = _get_classes(config)[0]
        arch = sys.modules[model_class.__module__]
    except Exception:  # an unknown model type, or mlx-lm moved its helper
        return None
    modules = [c for c in vars(arch).values() if isinstance(c, type) and issubclass(c, nn.Module)]
    return hasattr(model_class, "shard"), any(hasattr(c, "pipeline") for c in modules)


def check_config(folder: Path, spec: LaunchSpec) -> None:
    """Refuse, before anything starts, a model that cannot be sharded as asked over the ranks.

    Raises:
        ClusterError: One line, with the fix.
    """
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # the ranks' own load says what is wrong with the folder
    support = sharding_support(config)
    tensor, pipeline = support if support is not None else (True, True)
    kind = config.get("model_type", "?")
    try:
        if spec.pipeline and not pipeline:
            fix = "start without --pipeline (tensor parallel)" if tensor else "mlx-lm cannot shard it at all"
            raise ValueError(f"mlx-lm cannot pipeline model type {kind!r}: {fix}")
        if not spec.pipeline and not tensor:
            fix = "try --pipeline" if pipeline else "mlx-lm cannot shard it at all"
            raise ValueError(f"mlx-lm cannot shard model type {kind!r} tensor-parallel: {fix}")
        if not spec.pipeline:
            check_divisible(config, spec.ranks, can_pipeline=pipeline)
    except ValueError as exc:
        raise ClusterError(f"cannot shard {spec.model!r}: {exc}") from None


# Where the OS picks ports for outgoing connections and port-0 binds (Linux reads it from
# /proc; elsewhere IANA's dynamic range, the default of macOS).
LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DYNAMIC_PORTS = (49152, 65535)


def ephemeral_ports() -> tuple[int, int]:
    """The first and last port this host hands out on its own (outgoing connections, binds to port 0)."""
    try:
        first, last = (int(n) for n in LOCAL_PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return DYNAMIC_PORTS
    return first, last


def _port_window(count: int) -> range:
    """The bases to draw ring ports from: below the host's ephemeral ports, else above them.

    A ring rank accepts the first connection that reaches its port, from anyone
    (mlx's ring has no handshake). Ports in the ephemeral range are where dead
    peers are still being dialled: a Jupyter server keeps reconnecting the zmq
    channels of a kernel that died under it, several times a second, to the ports
    the kernel got by binding port 0. One such port drawn for rank 0 made both
    ranks fail with "[ring] Couldn't connect (error: 111)" 15 s later (a CI run
    beside JupyterLab, whose server dialled the 4 ports of each of 2 dead kernels
    ~3 times a second for as long as it ran). Ports the OS never hands out are not
    dialled that way.
    """
    first, last = ephemeral_ports()
    if first - count > 20000:
        return range(20000, first - count)
    if last + 1 < 65536 - count:
        return range(last + 1, 65536 - count)
    return range(20000, 60000 - count)  # the whole space is ephemeral: nowhere is safer


def _free_port_run(count: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` free on this host now (the ring backend's listen ports)."""
    window = _port_window(count)
    for _ in range(50):
        base = random.choice(window)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("", port))
        except OSError:
            continue
        return base
    raise ClusterError("no free ports for the ring backend: close other clusters and try again")


def command(spec: LaunchSpec, folder: Path, *, connect: str) -> list[str]:
    """The ``mlx.launch`` command line for ``spec``."""
    cmd = [sys.executable, "-c", LAUNCH_MAIN, "--backend", spec.backend]
    if spec.hostfile is not None:
        cmd += ["--hostfile", str(Path(spec.hostfile).expanduser())]
    else:
        cmd += ["-n", str(spec.ranks)]
    # Fixed default ports collide with a second cluster (or a test run) on this host.
    cmd += ["--starting-port", str(_free_port_run(spec.ranks)), "--nccl-port", str(_free_port_run(1))]
    cmd += ["--python", spec.python or sys.executable, "--"]
    cmd += ["-m", "mlx_notebook.cluster.rank", "--connect", connect, "--model", str(folder)]
    cmd += ["--backend", spec.backend, "--kernel-pid", str(os.getpid()), "--kernel-host", socket.gethostname()]
    if spec.pipeline:
        cmd.append("--pipeline")
    return cmd


def environment(spec: LaunchSpec) -> dict[str, str]:
    """The environment of ``mlx.launch`` and its local ranks: this one, plus OpenBLAS threads shared out.

    OpenBLAS starts one thread per core in every process, so ranks sharing a
    host's cores run more threads than cores, and every collective waits for
    the slowest. Measured on a 2-core CPU (fp32 SmolLM2 MLP shapes, 128-token
    chunk, 30 layers with an ``all_sum`` each, runs alternated): 2 ranks took
    456-729 ms with one thread each and 698-1170 ms with two (1.2-1.6x in
    every pair), 3 ranks 1372-1480 ms and 2116-2162 ms. So local ranks get
    ``cores // ranks`` threads each (at least one) unless
    ``OPENBLAS_NUM_THREADS`` is set.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if spec.hostfile is None and "OPENBLAS_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OPENBLAS_NUM_THREADS"] = str(max(1, cores // spec.ranks))
    return env


class Launcher:
    """The ``mlx.launch`` process group of one cluster; its output goes to :attr:`log_path`.

    Args:
        cmd: The command line (see :func:`command`).
        env: Its environment (see :func:`environment`). Default: this process's, unbuffered.
    """

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="mlx-notebook-cluster-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log: IO[bytes] = open(self.log_path, "wb")
        env = env if env is not None else dict(os.environ, PYTHONUNBUFFERED="1")
        # stdin: a pipe nobody writes to. mlx.launch forwards its stdin to the
        # ranks and spins on an end-of-file one (/dev/null).
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    @property
    def pid(self) -> int:
        """The ``mlx.launch`` process id (also its process group id)."""
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        """Its exit status, or ``None`` while it runs."""
        return self.process.poll()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the ranks' and the launcher's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def why_ended(self) -> str:
        """One line on how the ranks ended, from ``mlx.launch``'s own report."""
        lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", self.log_tail(200)).splitlines()]
        lines = [line for line in lines if line]  # mlx.launch colours its lines; those codes are gone above
        # A rank's own one-line reason (see rank.py) says the most, then mlx.launch's report.
        for line in lines:
            if re.match(r"rank \d+: ", line):
                return line
        for line in lines:
            if "Node with rank" in line:
                return line[line.index("Node with rank") :].rstrip(".")
        last = f": {lines[-1]}" if lines else ""
        return f"mlx.launch exited with status {self.exit_code}{last}"

    def stop(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for the ranks to end, then end the whole process group."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.process.wait(2.0)
                # The launcher is gone; its ranks may still be ending.
                if not self._group_alive():
                    break
            except subprocess.TimeoutExpired:
                continue
        if self.process.poll() is None:
            self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        self._log.close()

    def kill(self) -> None:
        """End the whole process group now (SIGKILL) and wait for the launcher (a fault: nothing to save)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.stop(timeout=0.0)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
