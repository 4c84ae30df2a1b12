"""The small least-squares fits the chunk planner and the piece sizer use (no model, no MLX)."""

from __future__ import annotations

import pytest

from mlx_notebook.generation.fit import linear_fit, nonnegative_fit


def test_linear_fit_recovers_a_line_and_refuses_a_single_x() -> None:
    assert linear_fit([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
    assert linear_fit([(2, 1.0), (2, 3.0)]) is None


def test_nonnegative_fit_recovers_exact_coefficients() -> None:
    true = [0.5, 2.0, 0.25]
    rows = [[1.0, n, n * m] for n, m in [(1, 1), (2, 5), (4, 2), (8, 9), (3, 7)]]
    ys = [sum(a * b for a, b in zip(r, true)) for r in rows]
    assert nonnegative_fit(rows, ys) == pytest.approx(true)


def test_nonnegative_fit_sets_a_column_that_would_go_negative_to_zero() -> None:
    # y = 3 n - 1: least squares would give a negative intercept; the fit keeps it at 0.
    rows = [[1.0, float(n)] for n in (1, 2, 3, 4)]
    ys = [3.0 * n - 1 for n in (1, 2, 3, 4)]
    fixed, slope = nonnegative_fit(rows, ys)
    assert fixed == 0.0
    assert slope == pytest.approx(sum(n * y for n, y in zip((1, 2, 3, 4), ys)) / sum(n * n for n in (1, 2, 3, 4)))


def test_nonnegative_fit_leaves_out_columns_not_allowed_and_fails_when_nothing_fits() -> None:
    rows = [[1.0, float(n)] for n in (1, 2, 3)]
    assert nonnegative_fit(rows, [2.0, 4.0, 6.0], [False, True]) == pytest.approx([0.0, 2.0])
    # Every allowed subset needs a negative coefficient.
    assert nonnegative_fit([[1.0], [2.0]], [-1.0, -2.0]) is None
