"""The generation core: requests, the engine, prefill pieces, the worker and its handles.

Modules: :mod:`.request` (what to generate, validated once), :mod:`.states`,
:mod:`.stats`, :mod:`.engine` (one generation, phase by phase),
:mod:`.chunks` (prefill chunk sizes), :mod:`.pieces` (chunk or layer-group
pieces), :mod:`.fit`, :mod:`.handle` (the user's ``Generation``),
:mod:`.worker` (the thread that owns all MLX work).
"""
