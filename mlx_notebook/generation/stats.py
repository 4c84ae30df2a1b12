"""What one generation measured, and why it ended.

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..text_enum import TextEnum


class FinishReason(TextEnum):
    """Why a generation ended (a ``str`` enum: compares equal to its value)."""

    EOS = "stop"  # the model's end-of-sequence token (mlx-lm's name: "stop")
    LENGTH = "length"
    STOP_STRING = "stop_string"  # the text reached one of the request's stop strings
    GRAMMAR = "grammar"  # a constrained answer's value closed (schema, choices, regex)
    STOPPED = "stopped"
    FAILED = "failed"


class PrefillPieces(TextEnum):
    """How prefill work was cut into pieces."""

    CHUNKS = "chunks"  # one piece per prompt chunk
    LAYERS = "layers"  # groups of layers of a chunk, a checkpoint between groups


@dataclass
class GenerationStats:
    """Measurements of one generation.

    Args:
        prompt_tokens: Tokens in the prepared prompt.
        cached_tokens: Prompt tokens taken from the prompt cache (not prefilled).
        generated_tokens: Tokens generated so far (EOS not counted).
        ttft_s: Seconds from the start of the job (load included) to the first token.
        prompt_tps: Prompt tokens per second of prefill.
        generation_tps: Generated tokens per second after the first.
        peak_memory_gb: MLX peak memory during the job.
        stop_latency_s: Seconds from the stop request to the parked worker.
        load_s: Seconds spent loading the model (0 when it was loaded).
        prefill_pieces: How prefill was cut (:class:`PrefillPieces`).
        prefill_chunks: Number of prefill chunks run.
        decode_step_s: Recent seconds per decode step (``None`` before two tokens).
        decode_in_flight: Decode steps kept queued on the device: 2 (the next
          step is submitted before the current token is read, as mlx-lm does)
          or 1, when two steps would not fit the stop budget.
        budget_below_step: One decode step alone takes longer than the stop
          budget: its steps then go in groups of layers.
        decode_pieces: Groups of layers the last decode step was evaluated in
          (1: whole steps); a stop waits for at most two of them.
        decode_lead_layers: Layers of the next decode step queued before the
          current token is read, with one step in flight (0: none; see
          ``MLX_NOTEBOOK_DECODE_LEAD``): a stop waits for one step and these.
        batch_size: Most generations decoded together with it (itself included).
        ranks: Processes the model was sharded over (1: this process alone).
        backend: The MLX distributed backend of those ranks (``ring``, ``nccl``...);
          ``""`` on one process.
        finish_reason: Why it ended (:class:`FinishReason`), ``None`` while it runs.
        reasoning_tokens: Generated tokens inside the reasoning block (its tags not counted).
        reasoning_s: Seconds from the first reasoning token to the end of the
          reasoning (to now while it goes on); ``None`` without reasoning.
        kv_bytes: Bytes of its KV cache (keys, values; scales and biases when
          quantized), updated every 32 tokens and at the end.
        kv: Its KV settings in a few words (``"kv 8-bit"``...), ``""`` for the model's own cache.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    prompt_tps: float | None = None
    generation_tps: float | None = None
    peak_memory_gb: float | None = None
    stop_latency_s: float | None = None
    load_s: float = 0.0
    prefill_pieces: PrefillPieces = PrefillPieces.CHUNKS
    prefill_chunks: int = 0
    decode_step_s: float | None = None
    decode_in_flight: int = 2
    budget_below_step: bool = False
    decode_pieces: int = 1
    decode_lead_layers: int = 0
    batch_size: int = 1
    ranks: int = 1
    backend: str = ""
    finish_reason: FinishReason | None = None
    reasoning_tokens: int = 0
    reasoning_s: float | None = None
    kv_bytes: int = 0
    kv: str = ""
