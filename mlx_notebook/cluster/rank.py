"""The rank server: ``python -m mlx_notebook.cluster.rank``, one per rank, started by ``mlx.launch``.

Every rank loads its shard of the model with mlx-lm's ``sharded_load``
(tensor parallel through ``model.shard(group)``, or pipeline with
``--pipeline``), then meets the others in one small collective per idle
tick. Rank 0 connects to the kernel's socket (:mod:`.protocol`), turns each
request into a :class:`~.protocol.Job` (prompt tokenized, seed fixed) and
shares it with the other ranks through the collectives; all ranks then run it
with :func:`.steps.run_job`, agreeing at every checkpoint.

No rank outlives the kernel: a lifeline thread ends the process when the
kernel's process is gone (ranks on the kernel's host), when its parent (the
``mlx.launch`` process) is gone, or, on rank 0, when the kernel has not
pinged for :data:`HEARTBEAT_TIMEOUT_S`; a rank that ends that way exits
non-zero, so ``mlx.launch`` ends the other ranks too.

Example (what :func:`mlx_notebook.cluster.start` runs)::

    mlx.launch -n 2 --backend ring -- python -m mlx_notebook.cluster.rank \\
        --connect tcp://127.0.0.1:5555 --model /path/to/model --backend ring

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from ..control import Cancelled, CancelToken
from ..errors import MLXNotebookError
from ..generation.prompt import prepare_prompt
from ..generation.reasoning import opens_thinking, think_tags
from ..generation.states import State
from ..generation.stats import GenerationStats
from ..loading.names import ModelSource, SourceKind
from ..loading.store import LoadedModel
from .agreement import AgreedPace, broadcast_bytes, exchange
from .launch import check_divisible
from .protocol import (
    IDLE_TICK_S,
    MAX_AHEAD,
    ClusterStats,
    Control,
    FailedStart,
    Finish,
    Generate,
    Job,
    Message,
    Op,
    Ping,
    Pong,
    Progress,
    Ready,
    Reasoning,
    Seen,
    Shutdown,
    StateChanged,
    Stats,
    Tokens,
    pack,
    request_from_fields,
    unpack,
)

# Rank 0 ends the cluster when the kernel has been silent this long (it pings
# every PING_S): the kernel froze or its machine went away.
HEARTBEAT_TIMEOUT_S = 20.0
# Exit status of a rank that ends because the kernel or the launcher is gone.
ORPHAN_EXIT = 3
# Exit status of a rank that could not load the model.
LOAD_EXIT = 2
# Exit status of a rank whose collective failed (another rank is gone).
LOST_EXIT = 4
# Exit status of a rank 0 that does not run on the kernel's host.
WRONG_HOST_EXIT = 5
# Set to "1" (benchmarks): generations ignore EOS, so every run decodes max_tokens.
IGNORE_EOS_ENV = "MLX_NOTEBOOK_CLUSTER_IGNORE_EOS"
# Stats travel with every this many tokens (and with every state change).
STATS_EVERY = 16


def check_shardable(model: Any, config: dict[str, Any], size: int, *, pipeline: bool) -> None:
    """Raise :class:`ValueError` (one line, with the fix) when mlx-lm cannot shard this model over ``size`` ranks."""
    kind = config.get("model_type", type(model).__name__)
    if pipeline:
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"mlx-lm cannot pipeline model type {kind!r}: start without --pipeline (tensor parallel)")
        return
    if not hasattr(model, "shard"):
        raise ValueError(f"mlx-lm cannot shard model type {kind!r} tensor-parallel: try --pipeline")
    check_divisible(config, size)


def load_shard(folder: Path, group: Any, *, pipeline: bool) -> LoadedModel:
    """This rank's shard of the model in ``folder``, after the checks.

    Pipeline stages come from mlx-lm's ``sharded_load``. Tensor parallel
    does what it does (lazy load, ``model.shard``, evaluate, one barrier)
    with one step more: on the CPU a quantized model is dequantized to
    float32 before it is sharded, by the local worker's own policy
    (:func:`~mlx_notebook.loading.policy.use_cpu_fast_path`), so the ranks run
    the weights a single process runs (and OpenBLAS prefill).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model, load_tokenizer, sharded_load

    from ..loading.policy import use_cpu_fast_path

    start = time.perf_counter()
    model, config = load_model(folder, lazy=True, strict=False)
    check_shardable(model, config, group.size(), pipeline=pipeline)
    if pipeline:
        if not (folder / "model.safetensors.index.json").is_file():
            raise ValueError(
                "--pipeline needs a model.safetensors.index.json in the model folder (mlx-lm's sharded_load)"
            )
        model, tokenizer = sharded_load(str(folder), pipeline_group=group)
    else:
        if use_cpu_fast_path(model):
            dequantize_model(model)  # lazy: each rank evaluates its own slices below
        model.shard(group)
        mx.eval(model.parameters())
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))  # every rank loaded
        # As the local loader: a model folder's own Python code never runs unasked.
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    model.eval()
    nbytes = sum(int(v.nbytes) for _, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    loaded = LoadedModel(
        ModelSource(str(folder), SourceKind.MLX, folder),
        model,
        tokenizer,
        config,
        nbytes,
        time.perf_counter() - start,
        folder=folder,
    )
    # Pipeline stages hold different layers: layer-group pieces would put a
    # different number of checkpoints on each rank.
    loaded.layer_pieces = not pipeline
    return loaded


class Inbox:
    """Rank 0's side of the kernel's socket: requests queue here, controls reach the running job's token."""

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)  # a send that finds the queue full drops the event
        self.socket.connect(address)
        self.requests: deque[Generate] = deque()
        self.current: tuple[int, CancelToken] | None = None
        # Queued generations paused from the kernel: they start paused (as on the local worker).
        self.paused_queued: set[int] = set()
        # Tokens of each generation the kernel has read (its ``seen`` acknowledgements).
        self.seen: dict[int, int] = {}
        self.shutdown = False
        self.last_heard = time.monotonic()
        # The kernel's silence counts only once the model is loaded (it may take minutes).
        self.serving = False

    def send(self, message: Message) -> None:
        """Send one event to the kernel (dropped when the kernel is gone: the lifeline ends this rank then)."""
        try:
            self.socket.send(pack(message), self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass

    def poll(self, timeout_s: float) -> None:
        """Read what the kernel sent, waiting up to ``timeout_s`` for the first message."""
        timeout = int(timeout_s * 1000)
        while self.socket.poll(timeout, self._zmq.POLLIN):
            self._handle(unpack(self.socket.recv()))
            timeout = 0

    def _handle(self, msg: Message) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, Ping):
            self.send(Pong())
        elif isinstance(msg, Seen):
            if self.current is not None and self.current[0] == msg.id:  # late ones keep nothing alive
                self.seen[msg.id] = msg.n
        elif isinstance(msg, Generate):
            self.requests.append(msg)
        elif isinstance(msg, Shutdown):
            self.shutdown = True
            if self.current is not None:
                self.current[1].cancel()
        elif isinstance(msg, Control):
            self._control(msg.id, msg.action)

    def _control(self, gen_id: int, action: str) -> None:
        if self.current is not None and self.current[0] == gen_id:
            token = self.current[1]
            {"stop": token.cancel, "pause": token.pause, "resume": token.resume}[action]()
        elif action == "stop":
            self.paused_queued.discard(gen_id)
            for queued in list(self.requests):
                if queued.id == gen_id:
                    self.requests.remove(queued)
                    self.send(Finish(gen_id, State.STOPPED.value))
        elif action == "pause" and any(queued.id == gen_id for queued in self.requests):
            self.paused_queued.add(gen_id)  # (a pause of one that already ended has nothing to act on)
        elif action == "resume":
            self.paused_queued.discard(gen_id)

    def keep_pace_with_kernel(self, gen_id: int, sent: int) -> None:
        """Hold rank 0 (and so every rank, in the next collective) while the kernel lags.

        Returns once the kernel has read all but :data:`MAX_AHEAD` of the
        ``sent`` tokens, or a stop, pause or shutdown arrived: a Pause then
        acts on (about) the token the user saw, not on one far ahead of it.
        Pings are answered meanwhile, so the kernel's watchdog stays quiet.
        """
        while sent - self.seen.get(gen_id, 0) > MAX_AHEAD and not self.shutdown:
            current = self.current
            if current is None or current[1].cancelled or current[1].pause_requested:
                return
            self.poll(IDLE_TICK_S)

    def finished(self, gen_id: int) -> None:
        """``gen_id`` ended: forget what is kept for it."""
        self.current = None
        self.seen.pop(gen_id, None)
        self.paused_queued.discard(gen_id)

    def start(self, gen_id: int, token: CancelToken) -> None:
        """``gen_id`` runs now under ``token``: controls go to it (paused already if it was paused while queued)."""
        self.current = (gen_id, token)
        if gen_id in self.paused_queued:
            self.paused_queued.discard(gen_id)
            token.pause()  # takes effect at the first agreed checkpoint, on every rank


class _RankSink:
    """The engine's sink on a rank: rank 0 tells the kernel, the others keep quiet."""

    def __init__(self, inbox: Inbox | None, gen_id: int, group: Any, backend: str) -> None:
        self.inbox = inbox
        self.id = gen_id
        self.cluster_stats = ClusterStats(ranks=group.size(), backend=backend)
        self.stats: GenerationStats = self.cluster_stats  # the engine's Sink protocol
        self.pace: AgreedPace | None = None
        self.state = State.QUEUED
        self._tokens = 0  # tokens events sent
        self._sent = 0  # token ids sent

    def _send(self, message: Message) -> None:
        if self.inbox is not None:
            self.inbox.send(message)

    def send_stats(self) -> None:
        if self.pace is not None:
            self.cluster_stats.agreements = self.pace.collectives
            self.cluster_stats.agreement_s = self.pace.collective_s
        self._send(Stats(self.id, {k: _plain(v) for k, v in asdict(self.stats).items()}))

    def set_state(self, state: State) -> None:
        if state == self.state:
            return
        self.state = state
        self.send_stats()
        self._send(StateChanged(self.id, state.value))

    def progress(self, phase: str, done: int, total: int) -> None:
        self._send(Progress(self.id, phase, done, total))

    def set_prompt(self, tokenizer: Any, prompt: list[int]) -> None:
        """Tell the kernel (which has no tokenizer) the model's reasoning tags and whether the prompt opened a block."""
        tags = think_tags(tokenizer)
        if tags is not None:
            opened = opens_thinking(tags, prompt)
            self._send(Reasoning(self.id, tags.start, tags.end, list(tags.start_ids), list(tags.end_ids), opened))

    def emit(self, token_ids: list[int], text: str) -> None:
        # The kernel counts the tokens itself; stats (rates, step times) follow now and then.
        self._send(Tokens(self.id, token_ids, text))
        self._tokens += 1
        self._sent += len(token_ids)
        if self._tokens % STATS_EVERY == 1:
            self.send_stats()
        if self.inbox is not None:
            self.inbox.keep_pace_with_kernel(self.id, self._sent)

    def finish(self, state: State, error: str | None = None, *, lost: bool = False) -> None:
        self.send_stats()
        self._send(Finish(self.id, state.value, error, lost))


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


class RankLost(Exception):
    """A collective failed: another rank is gone, and this group can run nothing more."""


def _lost_a_rank(message: str) -> bool:
    # The backends' own words when a peer's connection drops (mlx 0.32: "[ring] connection to a peer was lost").
    return message.startswith(("[ring]", "[nccl]", "[jaccl]", "[mpi]")) or "peer" in message.lower()


def make_job(loaded: LoadedModel, msg: Generate) -> Job:
    """The :class:`Job` for one :class:`Generate`: the prompt tokenized here, the seed fixed here.

    The kernel validated the request (:meth:`Cluster.submit`); it is not checked again.

    Raises:
        MLXNotebookError: The prompt does not fit this model (its chat template, its context).
    """
    request = request_from_fields(msg.request)
    prompt = prepare_prompt(loaded, request)
    seed = request.seed if request.seed is not None else random.randrange(2**31)
    return Job(msg.id, replace(request, prompt=prompt, seed=seed))


def run_one(loaded: LoadedModel, job: Job, group: Any, inbox: Inbox | None, backend: str) -> None:
    """Run ``job`` on this rank; rank 0 reports to the kernel."""
    from .steps import run_job

    token = CancelToken()
    sink = _RankSink(inbox, job.id, group, backend)
    before = [State.PREFILLING]

    def on_pause() -> None:
        mx.synchronize()
        before[0] = sink.state
        sink.set_state(State.PAUSED)

    def on_resume() -> None:
        sink.set_state(before[0])

    pace = AgreedPace(
        token,
        job.request.stop_budget,
        on_pause=on_pause,
        on_resume=on_resume,
        group=group,
        poll=inbox.poll if inbox is not None else None,
        on_tick=(lambda: inbox.send(Pong())) if inbox is not None else None,
    )
    sink.pace = pace
    if inbox is not None:
        inbox.start(job.id, token)
    try:
        sink.set_prompt(loaded.tokenizer, job.prompt)  # the kernel splits reasoning with what this says
        run_job(loaded, job, pace=pace, sink=sink)
        mx.synchronize()
        sink.finish(State.DONE)
    except Cancelled:
        mx.synchronize()
        sink.finish(State.STOPPED)
    except Exception as exc:  # an MLX error on every rank alike (a bad prompt, memory): fail this one only
        text = str(exc).strip().splitlines()
        line = text[0] if text else type(exc).__name__
        if _lost_a_rank(line):
            # The group is broken: nothing more can run on it (mlx.launch ends the rest).
            sink.finish(State.FAILED, f"a rank was lost ({line}); restart the cluster", lost=True)
            raise RankLost(line) from None
        mx.synchronize()
        sink.finish(State.FAILED, line)
    finally:
        if inbox is not None:
            inbox.finished(job.id)
        mx.clear_cache()


def serve(loaded: LoadedModel, group: Any, inbox: Inbox | None, backend: str) -> None:
    """The ranks' shared loop: one header collective per tick, a job when rank 0 has one."""
    while True:
        op, payload = Op.NOOP, b""
        if inbox is not None:
            inbox.poll(IDLE_TICK_S)
            if inbox.shutdown:
                op = Op.SHUTDOWN
            elif inbox.requests:
                msg = inbox.requests.popleft()
                try:
                    payload = make_job(loaded, msg).encode()
                    op = Op.JOB
                except MLXNotebookError as exc:
                    inbox.send(Finish(msg.id, State.FAILED.value, str(exc)))
        (agreed,) = exchange(group, [op])
        if agreed == Op.SHUTDOWN:
            return
        if agreed == Op.JOB:
            job = Job.decode(broadcast_bytes(group, payload))
            run_one(loaded, job, group, inbox, backend)


def _start_lifeline(kernel_pid: int | None, inbox: Inbox | None) -> None:
    """End this process when the kernel, the launcher or (rank 0) the kernel's pings are gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.2)
            gone = os.getppid() != parent
            if kernel_pid is not None:
                try:
                    os.kill(kernel_pid, 0)
                except ProcessLookupError:
                    gone = True
                except PermissionError:
                    pass
            if inbox is not None and inbox.serving and time.monotonic() - inbox.last_heard > HEARTBEAT_TIMEOUT_S:
                gone = True
            if gone:
                os._exit(ORPHAN_EXIT)

    threading.Thread(target=watch, name="mlx-notebook-lifeline", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Parse the launcher's arguments, load this rank's shard, serve until shut down."""
    parser = argparse.ArgumentParser(prog="python -m mlx_notebook.cluster.rank", description=__doc__.split("\n")[0])
    parser.add_argument("--connect", required=True, help="the kernel's socket, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--model", required=True, help="local MLX model folder (the same path on every host)")
    parser.add_argument("--backend", default="any", help="MLX distributed backend (ring, mpi, jaccl, nccl)")
    parser.add_argument("--pipeline", action="store_true", help="pipeline stages instead of tensor parallel")
    parser.add_argument("--kernel-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--kernel-host", default=None, help="the kernel's hostname (the pid is watched there only)")
    args = parser.parse_args(argv)
    same_host = args.kernel_host is None or args.kernel_host == socket.gethostname()

    group = mx.distributed.init(backend=args.backend, strict=args.backend != "any")
    leader = group.rank() == 0
    if leader and not same_host:
        # The kernel's socket listens on its own host only.
        print(
            f"rank 0: runs on {socket.gethostname()} but the kernel on {args.kernel_host}: "
            "make the kernel's machine the first host of the hostfile",
            file=sys.stderr,
        )
        return WRONG_HOST_EXIT
    inbox = Inbox(args.connect) if leader else None
    _start_lifeline(args.kernel_pid if same_host else None, inbox)
    try:
        loaded = load_shard(Path(args.model), group, pipeline=args.pipeline)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        line = text[0] if text else type(exc).__name__
        if inbox is not None:
            inbox.send(FailedStart(line))
            inbox.socket.close(linger=1000)
        print(f"rank {group.rank()}: cannot load {args.model}: {line}", file=sys.stderr)
        traceback.print_exc()
        return LOAD_EXIT
    if os.environ.get(IGNORE_EOS_ENV) == "1":
        loaded.tokenizer.eos_token_ids = []  # benchmarks: every run decodes max_tokens
    if inbox is not None:
        inbox.last_heard = time.monotonic()
        inbox.serving = True
        inbox.send(Ready(group.size(), args.backend, args.model, loaded.load_s, loaded.nbytes))
    try:
        serve(loaded, group, inbox, args.backend)
    except RankLost as exc:
        print(f"rank {group.rank()}: {exc}", file=sys.stderr)
        return LOST_EXIT
    finally:
        if inbox is not None:
            inbox.socket.close(linger=1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
