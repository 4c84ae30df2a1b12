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


def nonnegative_fit(
    rows: Sequence[Sequence[float]], ys: Sequence[float], allowed: Sequence[bool] | None = None
) -> list[float] | None:
    """Coefficients >= 0 minimizing the squared residuals of ``rows @ c ~ ys``, or ``None`` if none fits.

    Small problems only (a few columns): every subset of the allowed columns
    is solved by least squares, and the best one whose coefficients are all
    >= 0 wins (columns left out are 0).
    """
    k = len(rows[0])
    allowed = allowed if allowed is not None else [True] * k
    best: tuple[float, list[float]] | None = None
    columns = [j for j in range(k) if allowed[j]]
    for mask in range(1, 1 << len(columns)):
        subset = [columns[i] for i in range(len(columns)) if mask >> i & 1]
        coef = _least_squares([[r[j] for j in subset] for r in rows], ys)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0] * k
        for j, c in zip(subset, coef):
            full[j] = c
        residual = sum((sum(a * b for a, b in zip(r, full)) - y) ** 2 for r, y in zip(rows, ys))
        if best is None or residual < best[0] * (1 - 1e-9):
            best = (residual, full)
    return best[1] if best is not None else None


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Ordinary least squares by the normal equations (Gaussian elimination); ``None`` when singular."""
    k = len(rows[0])
    if len(rows) < k:
        return None
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in range(k)
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        scale = max(abs(a[i][i]) for i in range(k)) or 1.0
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]
