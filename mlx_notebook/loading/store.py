"""The models loaded on one worker, and how one is loaded with a stop at every piece.

Loading builds the model with lazy weights, then evaluates its parameters in
budget-sized batches (:mod:`.budgeted`) while the tokenizer loads on a helper
thread (:mod:`.tokenizer`), with a checkpoint of the generation's
:class:`~mlx_notebook.control.Pace` between every two pieces. A stopped load
keeps nothing.

Everything here runs on the worker thread (MLX streams belong to threads).
This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from ..control import Cancelled, Pace, unpaced
from ..errors import ModelFormatError
from . import gguf, weight_blocks
from .budgeted import ProgressCallback, dequantize_to_float32, evaluate_parameters, parameters_of
from .helper_thread import HelperJob, import_mlx_lm
from .names import ModelSource, SourceKind, cache_dir, resolve
from .policy import read_in_blocks, tokenizer_in_child, use_cpu_fast_path
from .tokenizer import load_tokenizer as load_tokenizer_in_child


class StreamingDetokenizer(Protocol):
    """mlx-lm's streaming detokenizer, as the engine uses it."""

    last_segment: str

    def reset(self) -> None: ...

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...


# (done, total, step): bytes so far in a step of the load ("reading", "dequantizing",
# "converting"); each step counts from 0 to its own total, so one bar per step.
# A callback of (done, total) only is still called, without the step.
LoadProgress = Callable[..., None]


def _step(progress: LoadProgress | None, step: str) -> ProgressCallback | None:
    if progress is None:
        return None
    try:
        inspect.signature(progress).bind(0, 0, step)
    except (TypeError, ValueError):
        return progress
    return lambda done, total: progress(done, total, step)


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (mlx-lm's ``TokenizerWrapper`` has it all)."""

    eos_token_ids: Iterable[int]
    has_chat_template: bool

    @property
    def detokenizer(self) -> StreamingDetokenizer: ...

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass
class LoadedModel:
    """A model in memory, ready to generate.

    Args:
        source: What was loaded.
        model: The mlx-lm model.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (or anything with its interface).
        config: The model's config dict.
        nbytes: Bytes of parameters.
        load_s: Seconds the load took.
        prefill_history: The prefill chunk planner's last chunks, ``(n,
          start, seconds)``, so the next prompt starts with right-sized chunks
          (``generation.chunks.ChunkPlanner`` fits its cost to them). Default: empty.
        prefill_shapes_seen: ``(start, size)`` of the prefill chunks run so
          far on the worker thread (devices that build kernels per shape).
          Default: empty.
        side_shapes_seen: The same for the prefill thread of prompts that
          join a decoding batch (``generation.prefill_thread``): MLX keeps
          the built kernels per thread. Default: empty.
        layer_pieces: Cut prefill chunks between groups of layers where the
          model's layout allows; ``False`` runs whole chunks (benchmarks
          compare both). Default: ``True``.
        folder: The model folder it was loaded from (the converted one for a
          GGUF file), to reload the tokenizer from. Default: ``None``.
        prompt_cache: KV caches of its past generations, for prompt-prefix
          reuse (a ``PromptCache``, made by the worker). Dropped with the
          model. Default: ``None``.
        fingerprint: Its weights' fingerprint, once a save or resume needed it. Default: ``None``.
        step_s: Seconds of its last solo decode step, which sizes the layer
          groups of a lone token's forward (a prompt fully in the prefix
          cache). Default: ``None`` (not measured yet).
        warmed: Whether the worker ran its first forward while idle (see
          ``generation.warm_up``). Default: ``False``.
        ladder_warmed: Whether the worker ran its prefill ladder to the end
          while idle (``generation.warm_up``). Default: ``False``.
        kernels_installed: Whether the worker compiled and installed its own
          kernels while idle (``generation.warm_up.install_kernels``). Default: ``False``.
    """

    source: ModelSource
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    nbytes: int
    load_s: float
    prefill_history: tuple[tuple[int, int, float], ...] = ()
    prefill_shapes_seen: set[tuple[int, int]] = field(default_factory=set)
    side_shapes_seen: set[tuple[int, int]] = field(default_factory=set)
    layer_pieces: bool = True
    folder: Path | None = None
    prompt_cache: Any = None
    fingerprint: str | None = None
    step_s: float | None = None
    warmed: bool = False
    ladder_warmed: bool = False
    kernels_installed: bool = False


class ModelStore:
    """The models loaded on one worker, keyed by resolved path.

    Args:
        cache: Folder for converted GGUF models. Default: :func:`cache_dir`.
    """

    def __init__(self, cache: Path | None = None) -> None:
        self.cache = Path(cache) if cache is not None else cache_dir()
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    def resolve(self, name: str | None) -> ModelSource:
        """Like :func:`.names.resolve`, but also knows models added with :meth:`register`."""
        if isinstance(name, str):
            with self._lock:
                for loaded in self._models.values():
                    if loaded.source.kind is SourceKind.MEMORY and loaded.source.name == name:
                        return loaded.source
        return resolve(name)

    def register(
        self, name: str, model: nn.Module, tokenizer: Tokenizer, config: dict[str, Any] | None = None
    ) -> LoadedModel:
        """Add a model built in memory (benchmarks, tests) under ``name``.

        Call it on the worker thread (``worker.call``) so that the model's
        arrays are evaluated on the worker's stream.
        """
        model.eval()
        nbytes = sum(p.nbytes for _, p in parameters_of(model))
        source = ModelSource(name, SourceKind.MEMORY, Path(f"<memory:{name}>"))
        loaded = LoadedModel(source, model, tokenizer, dict(config or {}), nbytes, 0.0)
        with self._lock:
            self._models[source.key] = loaded
        return loaded

    def loaded(self) -> list[LoadedModel]:
        """The models in memory now (safe from any thread)."""
        with self._lock:
            return list(self._models.values())

    def get(self, name: str | None, pace: Pace | None = None, *, progress: LoadProgress | None = None) -> LoadedModel:
        """Return the loaded model for ``name``, loading it if needed.

        Args:
            name: A model name (see :func:`.names.resolve`).
            pace: Checkpoint and budget of the load. Default: one nobody stops.
            progress: Called with ``(bytes_done, bytes_total, step)``. Default: ``None``.

        Raises:
            ModelNotFoundError, ModelFormatError: The name or file is bad.
            Cancelled: A stop was requested; nothing is kept.
        """
        source = self.resolve(name)
        with self._lock:
            found = self._models.get(source.key)
        if found is not None:
            if not getattr(found.tokenizer, "alive", True) and found.folder is not None:
                # Its tokenizer process was killed from outside (a signal to its
                # group, the OOM killer): load it again, not the whole model.
                found.tokenizer = self._tokenizer(source, found.folder, found.config, pace or unpaced())
            return found
        loaded = self._load(source, pace or unpaced(), progress)
        with self._lock:
            self._models[source.key] = loaded
        return loaded

    def unload(self, name: str | None) -> bool:
        """Forget a loaded model; return whether one was loaded."""
        key = self.resolve(name).key
        with self._lock:
            removed = self._models.pop(key, None)
        if removed is not None:
            mx.clear_cache()
        return removed is not None

    def _load(self, source: ModelSource, pace: Pace, progress: LoadProgress | None) -> LoadedModel:
        start = time.perf_counter()
        folder = source.path
        if source.kind is SourceKind.GGUF:
            # Checks the header before MLX parses the file, converts once per
            # file hash, and reuses the folder after that.
            # K-quant files convert block by block, a checkpoint after each.
            folder = gguf.cached_conversion(
                source.path, self.cache, pace=pace, progress=_step(progress, "converting GGUF")
            )
            pace.checkpoint()
        # The first import takes seconds on a small CPU: off this thread.
        import_mlx_lm(pace)
        from mlx_lm.utils import load_model

        try:
            model, config = load_model(folder, lazy=True)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            raise _cannot_load(source, exc) from exc
        # The tokenizer loads on a helper thread while the weights are
        # evaluated, so it never stands between a stop and its effect.
        pending = _PendingTokenizer(folder, config)
        stored = weight_blocks.index_folder(folder) if read_in_blocks(config) else None
        try:
            nbytes = evaluate_parameters(model, pace, progress=_step(progress, "reading"), stored=stored)
        except BaseException:
            pending.abandon()
            raise
        tokenizer = pending.result(source, pace)
        if use_cpu_fast_path(model):
            dequantize_to_float32(model, pace, progress=_step(progress, "dequantizing"))
            # Quantized layers of other kinds (none in the supported families) and
            # the norms: lazy here, evaluated in batches just below.
            from mlx_lm.utils import dequantize_model

            dequantize_model(model)
            model.set_dtype(mx.float32)
            nbytes = evaluate_parameters(model, pace, progress=_step(progress, "converting"))
        model.eval()
        return LoadedModel(
            source=source,
            model=model,
            tokenizer=tokenizer,
            config=config,
            nbytes=nbytes,
            load_s=time.perf_counter() - start,
            folder=folder,
        )

    def _tokenizer(self, source: ModelSource, folder: Path, config: dict[str, Any], pace: Pace) -> Tokenizer:
        return _PendingTokenizer(folder, config).result(source, pace)


def _cannot_load(source: ModelSource, exc: BaseException) -> ModelFormatError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelFormatError(
        f"{source.name}: cannot load model ({first}); give an mlx-lm model folder or a llama GGUF file"
    )


class _PendingTokenizer:
    """A tokenizer loading on a helper thread; big ones are built in a child process (:mod:`.tokenizer`)."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        self._abandoned = threading.Event()
        self._job = HelperJob(
            "mlx-notebook-tokenizer", _load_tokenizer, folder, config.get("eos_token_id"), self._abandoned
        )

    def result(self, source: ModelSource, pace: Pace) -> Tokenizer:
        """Wait with checkpoints; a stop abandons it (a child process is ended, not left to finish)."""
        try:
            tokenizer: Tokenizer = self._job.result(pace)
            return tokenizer
        except Cancelled:
            self.abandon()
            raise
        except Exception as exc:
            raise _cannot_load(source, exc) from exc

    def abandon(self) -> None:
        self._abandoned.set()


def _load_tokenizer(folder: Path, eos_token_ids: Any, abandoned: threading.Event) -> Tokenizer:
    """mlx-lm's tokenizer for ``folder``; big ones live in a child process (:mod:`.tokenizer`)."""
    tokenizer: Tokenizer
    if tokenizer_in_child(folder):

        def wait() -> None:
            if abandoned.is_set():
                raise Cancelled()

        tokenizer = load_tokenizer_in_child(folder, eos_token_ids, wait=wait)
        return tokenizer
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(folder, eos_token_ids=eos_token_ids)
    return tokenizer
