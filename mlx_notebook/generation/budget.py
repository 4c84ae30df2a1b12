"""How the stop budget is shared out: the one place its fractions are named.

A piece of work is sized to the budget (``Pace.budget_s``, default 0.1 s), the
longest a stop or pause may wait. What a piece may take is a share of it,
because something else always stands between a request and the parked worker:
the next prefill chunk runs a little slower than the last (attention grows
with the position), a decode step queued behind the one being read, the other
rows' steps run between a joining prompt's pieces.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

# A prefill chunk is sized to this share of the budget: per-token cost grows with
# the prompt position (attention), so the next chunk runs a bit slower than the last.
PREFILL_SHARE = 0.7
# Decode keeps a second step queued only while two steps fit this share of the
# budget: a stop that lands while the worker waits for one token also waits for
# the step queued behind it.
DECODE_PIPELINE_SHARE = 0.8
# While a prompt is prefilled beside decoding rows, their next step runs at a
# checkpoint once this share of the budget has passed since their last one: their
# gap between two tokens stays near the budget, and the prefill keeps the rest.
OTHERS_STEP_SHARE = 0.5
# Weight of the newest decode step in the running step-time average.
STEP_EMA = 0.2
