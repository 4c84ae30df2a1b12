"""Decode pacing against the stop budget: steps in flight, groups of layers and the lead, as pure rules.

The batch's behaviour under these rules (real steps, stops, pauses) is tested
in test_decode_batch, test_decode_pieces and test_decode_lead; here each rule
is held to what a stop may wait for.
"""

from __future__ import annotations

import pytest

from mlx_notebook.budget import DECODE_PIPELINE_SHARE, STEP_EMA
from mlx_notebook.generation import decode_pacing as pacing

pytestmark = pytest.mark.unit

BUDGET = 0.01
SHARE = DECODE_PIPELINE_SHARE * BUDGET  # what everything a stop may wait for must fit


def test_the_step_time_is_the_first_step_then_a_running_average() -> None:
    assert pacing.smoothed_step(None, 0.02) == 0.02
    assert pacing.smoothed_step(0.02, 0.04) == pytest.approx((1 - STEP_EMA) * 0.02 + STEP_EMA * 0.04)


def test_two_steps_are_in_flight_only_while_both_fit_the_share() -> None:
    assert pacing.steps_in_flight(SHARE / 2, BUDGET) == 2
    assert pacing.steps_in_flight(SHARE / 2 * 1.01, BUDGET) == 1
    assert pacing.steps_in_flight(3 * BUDGET, BUDGET) == 1


@pytest.mark.parametrize("layers", [1, 9, 28, 32, 36, 80])
def test_a_step_over_the_budget_goes_in_groups_two_of_which_fit_the_share(layers: int) -> None:
    assert pacing.layers_per_group(BUDGET, BUDGET, layers) == 0  # a whole step fits: no groups
    for ratio in (1.01, 1.5, 2.5, 4.0, 10.0, 100.0):
        step = ratio * BUDGET
        group = pacing.layers_per_group(step, BUDGET, layers)
        assert 1 <= group <= layers, (ratio, group)
        if group > 1:
            # Two groups fit, but for a layer each lost to rounding a step's layers into whole groups.
            assert 2 * step * (group - 1) / layers <= SHARE, (ratio, group)
        # Not cut finer than that needs: one layer fewer a group would be more groups than two fitting ask for.
        assert group == layers or 2 * step * group / layers > SHARE / 2, (ratio, group)


def test_no_layers_found_means_whole_steps_and_no_lead() -> None:
    assert pacing.layers_per_group(3 * BUDGET, BUDGET, 0) == 0
    assert pacing.lead_layers(0.5 * BUDGET, BUDGET, 0) == 0


@pytest.mark.parametrize(("layers", "lead"), [(9, 1), (28, 3), (32, 4), (36, 4), (80, 9)])
def test_the_lead_is_a_ninth_of_the_layers_while_the_step_and_it_fit_the_share(layers: int, lead: int) -> None:
    fits = SHARE / (1 + lead / layers)
    assert pacing.lead_layers(fits * 0.99, BUDGET, layers) == lead
    assert pacing.lead_layers(fits * 1.01, BUDGET, layers) == 0
    # A step that fits with its lead is one two whole steps do not fit: the lead is for one step in flight.
    assert pacing.steps_in_flight(fits * 0.99, BUDGET) == 1


def test_a_model_of_one_layer_gets_no_lead() -> None:
    assert pacing.lead_layers(0.1 * BUDGET, BUDGET, 1) == 0


@pytest.mark.parametrize(
    ("value", "per_shape", "wanted"),
    [(None, True, True), (None, False, False), ("0", True, False), ("1", False, True), ("auto", True, True)],
)
def test_the_lead_is_wanted_where_kernels_are_built_per_shape_unless_switched(
    monkeypatch, value: str | None, per_shape: bool, wanted: bool
) -> None:
    if value is None:
        monkeypatch.delenv("MLX_NOTEBOOK_DECODE_LEAD", raising=False)
    else:
        monkeypatch.setenv("MLX_NOTEBOOK_DECODE_LEAD", value)
    assert pacing.lead_wanted(per_shape) is wanted
