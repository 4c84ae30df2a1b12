"""Wrapping a model module's attention function, once per purpose, composable.

mlx-lm's model modules call ``scaled_dot_product_attention`` (imported from
``mlx_lm.models.base``) from each attention layer. Where MLX's backend needs
another route for some calls (a padded batch on CUDA, a quantized cache on
CUDA), the module's name is rebound to a wrapper that takes those calls and
hands every other call to what was there before. Each wrapper is tagged
with its purpose, and the tags of the function it wraps are carried over,
so installing twice is a no-op and two purposes stack in either order.

A purpose is written as a *route* (:func:`route`): a function of the call's
arguments that returns the attention where it takes the call, or ``None``
to hand it on; the wrapper around it, with mlx-lm's parameter list, is
written once, here.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

NAME = "scaled_dot_product_attention"
_TAGS = "_mlx_notebook_attention_tags"
_WRAPS = "_mlx_notebook_attention_wraps"

Attention = Callable[..., Any]
# (queries, keys, values, cache, scale, mask, sinks) -> the output, or None: not this route's call.
Route = Callable[[Any, Any, Any, Any, float, Any, Any], Any]


def module_of(model: Any) -> Any:
    """The module that defines ``model``'s class (where its attention layers look the function up)."""
    return sys.modules.get(type(model).__module__)


def wrap(model: Any, tag: str, make: Callable[[Attention], Attention]) -> bool:
    """Rebind ``model``'s module's attention to ``make(current)`` unless ``tag`` is already on it.

    Returns whether the module has the function at all (a model with its own
    attention code cannot be routed this way).
    """
    module = module_of(model)
    current = getattr(module, NAME, None)
    if module is None or current is None:
        return False
    tags: frozenset[str] = getattr(current, _TAGS, frozenset())
    if tag not in tags:
        wrapped = make(current)
        setattr(wrapped, _TAGS, tags | {tag})
        setattr(wrapped, _WRAPS, current)
        setattr(module, NAME, wrapped)
    return True


def route(model: Any, tag: str, take: Route) -> bool:
    """:func:`wrap` ``model``'s attention so that the calls ``take`` answers go its way, the rest on.

    ``take`` gets mlx-lm's arguments positionally (queries, keys, values,
    cache, scale, mask, sinks) and returns an array, or ``None`` for the
    function it wraps.
    """

    def make(original: Attention) -> Attention:
        # mlx-lm's scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None).
        def attention(
            queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None
        ) -> Any:
            out = take(queries, keys, values, cache, scale, mask, sinks)
            if out is None:
                return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
            return out

        return attention

    return wrap(model, tag, make)


def unwrap(model: Any, original: Attention) -> None:
    """Put ``original`` back as the module's function (tests that force a route on the CPU)."""
    setattr(module_of(model), NAME, original)


@contextmanager
def unpatched(model: Any) -> Iterator[None]:
    """While inside, ``model``'s module calls the function mlx-lm defined, under every wrapper.

    The wrappers are module-wide: a benchmark that runs mlx-lm's own
    ``stream_generate`` on the same model would otherwise measure our routes
    (the quantized one takes any cache with ``bits``, mlx-lm's included).
    """
    module = module_of(model)
    current = getattr(module, NAME, None)
    bare = current
    while bare is not None and hasattr(bare, _WRAPS):
        bare = getattr(bare, _WRAPS)
    setattr(module, NAME, bare)
    try:
        yield
    finally:
        setattr(module, NAME, current)


__all__ = ["Route", "module_of", "route", "unpatched", "unwrap", "wrap"]
