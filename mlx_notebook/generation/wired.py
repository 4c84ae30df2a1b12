"""Metal's wired-memory limit during a generation, as mlx-lm's ``stream_generate`` sets it.

On Apple GPUs mlx-lm raises the wired limit (memory the OS may not page out)
to the device's recommended working set while it generates, so a big model
is not paged; it synchronizes its stream before restoring the limit, since
the limit must not change under running work. The engine does the same on
the worker's stream. Elsewhere (CPU, CUDA) the device reports no recommended
working set and nothing happens.

Written from mlx-lm's ``wired_limit`` (mlx_lm/generate.py); the Metal calls
are faked in the tests: nothing here was run on Apple hardware.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_reduce

log = logging.getLogger(__name__)


def _recommended_working_set() -> int | None:
    metal = getattr(mx, "metal", None)
    if metal is None or not metal.is_available():
        return None
    size = mx.device_info().get("max_recommended_working_set_size")
    return int(size) if size else None


@contextmanager
def wired_limit(model: nn.Module, stream: mx.Stream) -> Iterator[None]:
    """Raise the wired limit to the recommended working set inside the block (Metal only).

    Args:
        model: The model generating (its size is checked against the limit).
        stream: The stream synchronized before the old limit is restored.
    """
    recommended = _recommended_working_set()
    if recommended is None:
        yield
        return
    old = mx.set_wired_limit(recommended)
    model_bytes = tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, model, 0)
    if model_bytes > 0.9 * recommended:
        log.warning(
            "the model needs %d MB, close to the recommended working set of %d MB: generation may be slow "
            "(see https://github.com/ml-explore/mlx-lm#large-models)",
            model_bytes >> 20,
            recommended >> 20,
        )
    try:
        yield
    finally:
        # The limit must not change under running work (a stop or an error leaves some).
        mx.synchronize(stream)
        mx.set_wired_limit(old)
