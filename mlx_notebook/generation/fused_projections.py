"""Sibling projections of one input as one product: attention's q/k/v, the MLP's gate/up.

A decode step of an 8B model on MLX's CUDA backend is bound by host time per
kernel call (cuBLASLt's descriptors and heuristic on every call for 2+ rows,
the launch for one row: ``skinny_matmul``'s docstring has the figures). A
llama layer makes seven products; q/k/v read one input and so do gate/up, so
with their weights' rows concatenated a layer makes four, and a 32-layer step
96 fewer calls. The parts are column slices of the one product (views, no
copy); each dot product is the one the separate layers computed.

Done in place at the worker's first idle moment after a load, on CUDA
(:func:`wanted`; ``generation.warm_up.install_kernels``), by swapping each
sibling for a :class:`Part` of one shared product; the model's own forward
is untouched.
The first part called with an input computes the product for all of them;
the others called with the *same* input (by identity) on the same thread
take their slice. Each thread keeps its own latest product, so the prefill
thread running the model beside the decode worker never evicts the worker's;
a part called with another input computes the product itself, so an
unexpected order of calls costs work, never a wrong result.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from ..loading.policy import env_switch
from .chunks import builds_kernels_per_shape

log = logging.getLogger(__name__)

# Sibling linear layers that read one input, by the attribute names mlx-lm's models use.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Model types whose forward calls each group above on one input, in order (read in mlx-lm's
# models/llama.py, qwen2.py, qwen3.py, mistral.py): elsewhere a group's members may read
# different inputs, and each would pay the whole product.
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class _Product:
    """The one product of a group: computed once per input, handed out as column slices."""

    def __init__(self, linear: nn.Module, widths: list[int]) -> None:
        self.linear = linear
        self.splits = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
        self.last = len(widths) - 1
        # Per thread, (input, parts) of its latest call (``latest``).
        self._local = threading.local()

    def part(self, i: int, x: mx.array) -> mx.array:
        latest: tuple[mx.array, list[mx.array]] | None = getattr(self._local, "latest", None)
        if latest is None or latest[0] is not x:
            latest = (x, list(mx.split(self.linear(x), self.splits, axis=-1)))
            self._local.latest = latest
        if i == self.last:
            # Let go of the input and the parts: a forward's arrays are not kept past it.
            self._local.latest = None
        return latest[1][i]


class Part(nn.Module):
    """One sibling of a fused group: its slice of the group's product.

    The group's first part holds the fused layer (``fused``) so the model's
    parameters hold each weight once; the rest reach it through the shared
    :class:`_Product`, a plain object the module tree does not walk.
    """

    def __init__(self, product: _Product, index: int, width: int) -> None:
        super().__init__()
        if index == 0:
            self.fused = product.linear
        self._product = product
        self._index = index
        self.width = width

    def __call__(self, x: mx.array) -> mx.array:
        return self._product.part(self._index, x)


def _arrays(layer: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in layer.items() if isinstance(v, mx.array)}


def _joinable(layers: list[nn.Module]) -> bool:
    """Whether ``layers`` are alike linear layers (plain, or quantized the same way) of one input width."""
    first = layers[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not kind for m in layers):
        return False
    keys = set(_arrays(first))
    if any(set(_arrays(m)) != keys for m in layers):
        return False
    if any(
        m["weight"].shape[1:] != first["weight"].shape[1:] or m["weight"].dtype != first["weight"].dtype for m in layers
    ):
        return False
    if kind is nn.QuantizedLinear:
        same = ("group_size", "bits", "mode")
        return all(getattr(m, a, None) == getattr(first, a, None) for m in layers for a in same)
    return True


def _like(layer: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A layer of ``layer``'s class and plain attributes (bits, group size, mode) holding ``arrays``."""
    kind = type(layer)
    new = kind.__new__(kind)
    nn.Module.__init__(new)
    for name, value in vars(layer).items():
        setattr(new, name, value)
    for name, value in arrays.items():
        new[name] = value
    return new


def _join(layers: list[nn.Module]) -> nn.Module:
    """One layer whose output is ``layers``' outputs side by side (their arrays' rows concatenated)."""
    return _like(layers[0], {k: mx.concatenate([m[k] for m in layers], axis=0) for k in _arrays(layers[0])})


def _split(fused: nn.Module, widths: list[int]) -> list[nn.Module]:
    """``fused``'s rows as separate layers of ``widths`` outputs (slices of its arrays: views, no copy)."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [_like(fused, {k: v[a : a + w] for k, v in _arrays(fused).items()}) for a, w in zip(starts, widths)]


def wanted() -> bool:
    """Whether a loaded model's projections are fused: on MLX's CUDA backend unless ``MLX_NOTEBOOK_FUSED_PROJECTIONS=0``.

    Measured where decode steps are bound by host time per call (H100, 8B
    shapes, budget 0.01, session 35; ``benchmarks/results/h100_*_session35.*``):
    plain mlx-lm 8-row steps 8.6 against 13.9 ms, one row 6.8 against 7.4
    (Llama-3-8B, one process, alternated); the library's 8 rows 837 and 759
    tok/s against 580 and 615 (Llama-3-8B), 643 against 593 (Qwen3-8B). On the
    CPU it did not pay (a 4-row step of the default model 91.2 ms against
    85.1, session 27). ``1`` makes this true on any backend, but the worker
    asks only at its CUDA idle moment (``warm_up.install_kernels``); the
    tests force that moment on the CPU.
    """
    switch = env_switch("MLX_NOTEBOOK_FUSED_PROJECTIONS")
    return switch == "on" or (switch == "auto" and builds_kernels_per_shape())


def fuse(model: nn.Module, model_type: str | None) -> int:
    """Replace ``model``'s sibling projections with :class:`Part` s of one product each; the groups fused.

    A no-op for model types not in :data:`MODEL_TYPES`. Each group's new
    weight is evaluated before the next group is built, so at most one
    group's weights are held twice.
    """
    if model_type not in MODEL_TYPES:
        return 0
    fused = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            found = [module.get(n) for n in names]
            layers = [m for m in found if isinstance(m, nn.Module)]
            if len(layers) != len(names) or not _joinable(layers):
                continue
            joined = _join(layers)
            mx.eval(joined.parameters())
            widths = [m["weight"].shape[0] for m in layers]
            product = _Product(joined, widths)
            for i, (name, width) in enumerate(zip(names, widths)):
                module[name] = Part(product, i, width)
            fused += 1
    log.debug("fused %d groups of projections", fused)
    return fused


def _fused_groups(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...], list[Part]]]:
    groups: list[tuple[nn.Module, tuple[str, ...], list[Part]]] = []
    for _, module in model.named_modules():
        for names in SIBLINGS:
            parts = [module.get(n) for n in names]
            if all(isinstance(p, Part) for p in parts):
                groups.append((module, names, cast(list[Part], parts)))
    return groups


@contextmanager
def unfused(model: nn.Module) -> Iterator[None]:
    """While inside, ``model``'s fused groups are separate layers again (views of the fused weights).

    For a benchmark's mlx-lm side, which measures mlx-lm's own model.
    """
    groups = _fused_groups(model)
    for module, names, parts in groups:
        for name, layer in zip(names, _split(parts[0].fused, [p.width for p in parts])):
            module[name] = layer
    try:
        yield
    finally:
        for module, names, parts in groups:
            for name, part in zip(names, parts):
                module[name] = part


__all__ = ["MODEL_TYPES", "SIBLINGS", "Part", "fuse", "unfused", "wanted"]
