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


def check_divisible(config: dict, ranks: int) -> None:
    """Raise :class:`ValueError` when tensor parallelism cannot split this config's heads or MLP over ``ranks``."""
    kind = config.get("model_type", "?")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, int) and value % ranks:
            raise ValueError(f"model type {kind!r} has {key}={value}, not divisible by {ranks} ranks; use fewer ranks")


def check_config(folder: Path, spec: LaunchSpec) -> None:
    """Refuse, before anything starts, a tensor-parallel model whose shapes do not split over the ranks.

    Raises:
        ClusterError: One line, with the fix.
    """
    if spec.pipeline:
        return
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # the ranks' own load says what is wrong with the folder
    try:
        check_divisible(
            config.get("text_config", config) if "num_attention_heads" not in config else config, spec.ranks
        )
    except ValueError as exc:
        raise ClusterError(f"cannot shard {spec.model!r}: {exc}") from None


def _free_port_run(count: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` free on this host now (the ring backend's listen ports)."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - count)
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


class Launcher:
    """The ``mlx.launch`` process group of one cluster; its output goes to :attr:`log_path`.

    Args:
        cmd: The command line (see :func:`command`).
    """

    def __init__(self, cmd: list[str]) -> None:
        fd, name = tempfile.mkstemp(prefix="mlx-notebook-cluster-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log: IO[bytes] = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
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

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
