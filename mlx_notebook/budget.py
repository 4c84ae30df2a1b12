"""How the stop budget is shared out: the one place its fractions are named.

A piece of work is sized to the budget (``Pace.budget_s``, default 0.1 s), the
longest a stop or pause may wait. What a piece may take is a share of it,
because something else always stands between a request and the parked worker:
the next prefill chunk runs a little slower than the last (attention grows
with the position), a decode step queued behind the one being read, the other
rows' steps run between a joining prompt's pieces, the disk.

The shares of loading, generation and saving are all here: layers below
``generation`` (``loading``) import this module, as they import :mod:`.control`.

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
# checkpoint once this share of the budget has passed since their last one (at least:
# see the next two): their gap between two tokens stays near the budget, and the
# prefill keeps the rest.
OTHERS_STEP_SHARE = 0.5
# Where their steps are long, the prompt's turn grows to what their gap's bound (a budget
# and two steps) leaves after the time from a boundary to their token, less this share of
# the budget (generation/prompt_turn.py) ...
TURN_MARGIN_SHARE = 0.5
# ... with that time taken as the longest of the last steps (prompt_turn.OVERHEAD_WINDOW)
# plus this share of a step: a step after a piece ran 1.0-1.3x one before the join (2-core
# CPU, Qwen3-0.6B shape, session 45).
TURN_STEP_SLACK = 0.25
# Weight of the newest decode step in the running step-time average.
STEP_EMA = 0.2
# A batch of weights evaluated at load (and a block of a GGUF file converted) is
# sized to this share: the next one may hold larger tensors or slower quants.
LOAD_PIECE_SHARE = 0.7
# A piece of a KV file written or read is sized to this share: the next one may
# meet a slower disk or page-cache eviction, and the checkpoint comes after it.
SAVE_PIECE_SHARE = 0.3
# A stopped save waits this share of the budget for its temporary file to be deleted.
SAVE_CLEANUP_SHARE = 0.3
