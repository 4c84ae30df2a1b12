"""Loading: model names, the store of loaded models, and loading in budget-sized pieces.

Modules: :mod:`.names` (what a name points to), :mod:`.store` (loaded models,
the load itself), :mod:`.budgeted` (weights evaluated in batches that fit the
stop budget), :mod:`.weight_blocks` (large weights in row blocks),
:mod:`.policy` (per-device switches), :mod:`.helper_thread`, :mod:`.gguf`
(GGUF files), :mod:`.blas` (OpenBLAS for MLX's CPU backend; imported before
MLX, so this package's face imports nothing).
"""
