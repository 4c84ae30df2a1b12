"""The cluster's user-facing error (one line, with the fix).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

from ..errors import MLXNotebookError


class ClusterError(MLXNotebookError, RuntimeError):
    """A cluster could not start, or ended or hung under a generation."""
