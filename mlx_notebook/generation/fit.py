"""A least-squares line through recent measurements (the planners' cost models).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import statistics
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


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """The coefficients ``c`` that minimise ``sum((row . c - y) ** 2)`` (the normal equations).

    Returns:
        ``None`` when the columns are (nearly) dependent: the data cannot tell them apart.
    """
    k = len(rows[0])
    # Columns scaled to unit size first: they differ by orders of magnitude
    # (1, tokens, tokens x position), which would swamp the dependence test.
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[sum(r[i] * r[j] / (scale[i] * scale[j]) for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y / scale[i] for r, y in zip(rows, ys)) for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        piv = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) < 1e-9 * len(rows):
            return None
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for i in range(col + 1, k):
            f = a[i][col] / a[col][col]
            a[i] = [x - f * y for x, y in zip(a[i], a[col])]
            b[i] -= f * b[col]
    c = [0.0] * k
    for i in reversed(range(k)):
        c[i] = (b[i] - sum(a[i][j] * c[j] for j in range(i + 1, k))) / a[i][i]
    return [x / s for x, s in zip(c, scale)]


def median_line(points: Sequence[tuple[float, float]], spread: float) -> tuple[float, float] | None:
    """``(intercept, slope)`` of the Theil-Sen line: the median slope between pairs of points.

    Only pairs whose x values differ by ``spread`` times or more count (a
    slope between near neighbours is mostly noise). Up to about 30% of the
    points may lie anywhere (preemptions) without moving the line much.

    Returns:
        ``None`` when no pair is that far apart.
    """
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if max(x1, x2) >= spread * min(x1, x2)
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in points), slope
