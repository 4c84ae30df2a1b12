"""A least-squares line through recent measurements (the planners' cost models).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from collections.abc import Sequence


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of the least-squares line through ``points``.

    Returns:
        ``None`` when the x values do not vary (no line to fit).
    """
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return mean_y - slope * mean_x, slope
