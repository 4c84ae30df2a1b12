"""The notebook side: magics, widgets, display routing, kernel hooks and ``{name}`` interpolation.

Modules: :mod:`.magics` (``%%mlxgen``, the ``MLXGen`` config), :mod:`.option_flags`
(one flag per request option), :mod:`.job_magics` (``%mlxgen_stop``, ``_jobs``,
``_models``), :mod:`.chat_magic` (``%%mlxchat``), :mod:`.cluster_magic`
(``%mlxgen_cluster``), :mod:`.widget` (the views), :mod:`.routing` (where display
messages go), :mod:`.text_form` (status line, plain text), :mod:`.thinking_pane`
(a reasoning model's Thinking pane), :mod:`.markdown_blocks` / :mod:`.markdown_view`,
:mod:`.logprobs_view`, :mod:`.map_inputs` / :mod:`.map_widget` (``--map``),
:mod:`.disconnected`, :mod:`.kernel_hooks`, :mod:`.extension` (``%load_ext``),
:mod:`.interpolate`.

Only this package imports IPython, ipykernel or ipywidgets.
"""
