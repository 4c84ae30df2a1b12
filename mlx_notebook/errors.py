"""Exceptions that carry the fix in their message.

Every error a user can cause is one of these, with a one-line message that says
what was wrong and how to fix it. They subclass the built-in exception a caller
would expect (``ValueError`` for bad arguments, ``LookupError`` for a model that
cannot be found) so generic ``except`` clauses keep working.
"""

from __future__ import annotations


class MLXNotebookError(Exception):
    """Base class of every error raised on purpose by mlx-notebook."""


class InvalidArgumentError(MLXNotebookError, ValueError):
    """An argument is out of range or of the wrong kind."""


class ModelNotFoundError(MLXNotebookError, LookupError):
    """A model name did not resolve to anything on this machine."""


class ModelFormatError(MLXNotebookError, ValueError):
    """A model file exists but cannot be read (corrupt, truncated, unsupported)."""
