"""How decode steps are paced against the stop budget: steps in flight, groups of layers, the lead.

A stop that lands while the worker waits for a token waits for everything
queued on the device by then. So what is queued is chosen from the measured
step time and the tightest budget of the rows: two whole steps while they fit
``budget.DECODE_PIPELINE_SHARE`` of it (mlx-lm's pipelining), else one; a step
longer than the budget in groups of layers, two of which fit that share; and,
with one step in flight, the first layers of the next step queued before the
token is read (the *lead*) where the step and they fit it.

Pure functions of those numbers, so the batch (:class:`.DecodeBatch`), the
solo loop the benchmarks keep and the tests decide alike.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import math

from ..budget import DECODE_PIPELINE_SHARE, STEP_EMA
from ..loading.policy import env_switch

# The share of a step's layers queued before the token ahead of it is read (see
# lead_layers): 4 of Qwen3-8B's 36 matched two steps in flight, 1-2 fell short.
LEAD_LAYERS_SHARE = 1 / 9


def smoothed_step(previous_s: float | None, seconds: float) -> float:
    """The running step time after a step of ``seconds`` (the first step's own time)."""
    return seconds if previous_s is None else (1 - STEP_EMA) * previous_s + STEP_EMA * seconds


def steps_in_flight(step_s: float, budget_s: float) -> int:
    """Whole steps kept queued: 2 while two fit the pipeline's share of the budget, else 1."""
    return 2 if 2 * step_s <= DECODE_PIPELINE_SHARE * budget_s else 1


def layers_per_group(step_s: float, budget_s: float, layers: int) -> int:
    """Layers per piece of a step with one in flight: 0 (whole steps) while one step fits the budget.

    A stop waits for the piece being evaluated and the one queued behind
    it: two pieces must fit the share of the budget that two whole steps
    must fit to be kept in flight. Within the budget a stop waits for one
    whole step, and pieces would only cost throughput (H200, 32k context,
    bf16: a ~8 ms step at budget 0.01 decoded at 91 tok/s in pieces, ~117
    whole).
    """
    if step_s <= budget_s or layers <= 0:
        return 0
    pieces = min(layers, math.ceil(2 * step_s / (DECODE_PIPELINE_SHARE * budget_s)))
    return math.ceil(layers / pieces)


def lead_wanted(builds_per_shape: bool) -> bool:
    """Whether a lone row's next step may lead: on where kernels are built per shape (CUDA), as measured.

    Measured in the library on an H100, Qwen3-8B at 32k, 16 runs alternated:
    decode at 0.913x plain mlx-lm (mean; median 0.910, worst 0.834) with the
    lead against 0.890x (0.909, 0.791) without, stops at 32k p99 8.7 ms
    (``benchmarks/results/h100_stretch_lead_ab_session36.log``). On the CPU
    the step rarely fits (the default model's 91 ms step would need under
    73 ms at the default budget) and it is unmeasured, so off there.
    ``MLX_NOTEBOOK_DECODE_LEAD=1`` turns it on anywhere, ``0`` off.
    """
    switch = env_switch("MLX_NOTEBOOK_DECODE_LEAD")
    return switch == "on" or (switch == "auto" and builds_per_shape)


def lead_layers(step_s: float, budget_s: float, layers: int) -> int:
    """Layers of the next whole step to queue before a lone row's token is read; 0: none.

    With one step in flight the device idles from the end of a step until
    the host has woken, read its token and queued the next. Queuing the
    next step's first layers behind it first closes that gap: on an H100,
    Qwen3-8B at 32k, the first 4 of 36 layers decoded at 1.00x two whole
    steps in flight, the step alone at 0.94x
    (``benchmarks/results/h100_decode_pre_read_session35.log``). A stop
    then waits for the step and the lead, so both must fit the share of
    the budget two whole steps must fit to be kept in flight.
    """
    if layers <= 0:
        return 0
    lead = max(1, round(layers * LEAD_LAYERS_SHARE))
    if lead >= layers or step_s * (1 + lead / layers) > DECODE_PIPELINE_SHARE * budget_s:
        return 0
    return lead


__all__ = [
    "LEAD_LAYERS_SHARE",
    "layers_per_group",
    "lead_layers",
    "lead_wanted",
    "smoothed_step",
    "steps_in_flight",
]
