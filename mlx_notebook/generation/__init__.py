"""The generation core: requests, the engine, prefill pieces, batched decode, the worker and its handles.

Modules: :mod:`.request` (what to generate, validated once), :mod:`.states`,
:mod:`.stats`, :mod:`.prompt` (chat template, tokens), :mod:`.sampling` (the
row's sampler and logits processors), :mod:`.reasoning` (a reasoning model's
channels and thinking budget), :mod:`.chunks` (prefill chunk sizes),
:mod:`.pieces` (chunk or layer-group pieces), :mod:`.fit`, :mod:`.engine`
(prefill), :mod:`.session` (the worker's loop for one model),
:mod:`.decode_batch` (rows decoding together), :mod:`.batch_cache`,
:mod:`.prefix_cache` (past KV caches), :mod:`.wired`, :mod:`.handle` (the
user's ``Generation``), :mod:`.worker` (the thread that owns all MLX work).
"""
