"""The generation core: requests, prefill, batched decode, the worker and its handles.

Modules: :mod:`.request` (what to generate, validated once), :mod:`.states`,
:mod:`.stats`, :mod:`.budget` (the stop budget's shares, named once),
:mod:`.prompt`, :mod:`.sampling`, :mod:`.chunks` (prefill chunk sizes),
:mod:`.fit`, :mod:`.pieces` (chunk or layer-group pieces), :mod:`.prefill`
(the one prefill loop), :mod:`.decode_batch` (the rows decoding together),
:mod:`.batch_cache`, :mod:`.prefix_cache`, :mod:`.session` (a model's
generations while they run), :mod:`.handle` (the user's ``Generation``),
:mod:`.worker` (the thread that owns all MLX work), :mod:`.wired`.
"""
