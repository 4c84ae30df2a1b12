"""Python work that touches no MLX state (an import, a tokenizer) on a helper thread.

The worker thread waits for it with a checkpoint every half budget, so a
stop never waits for the work itself; it only waits for the GIL, which is why
work that holds the GIL long in one native call must be split up first (see
:mod:`.tokenizer`).

This module never imports IPython or ipywidgets.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..control import Pace


class HelperJob:
    """Runs ``fn(*args)`` on a daemon thread named ``name``; :meth:`result` waits with checkpoints."""

    def __init__(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._result = fn(*args)
        except Exception as exc:  # re-raised on the worker thread by result()
            self._error = exc

    def result(self, pace: Pace) -> Any:
        """Wait for the result with a checkpoint every half budget; re-raise its exception.

        Raises:
            Cancelled: A stop was requested while waiting (the job runs on, unseen).
            Exception: What the job raised.
        """
        while self._thread.is_alive():
            self._thread.join(pace.budget_s / 2)
            pace.checkpoint()
        if self._error is not None:
            raise self._error
        return self._result


def import_mlx_lm(pace: Pace) -> None:
    """Import ``mlx_lm.utils`` (seconds on a small CPU: it imports transformers) off the worker thread."""
    if "mlx_lm.utils" in sys.modules:
        return
    # A stopped import goes on while the interpreter exits, and
    # concurrent.futures.thread refuses to be first imported then ("can't
    # register atexit after shutdown", printed by huggingface_hub's lazy
    # import): import it here, first.
    importlib.import_module("concurrent.futures.thread")
    HelperJob("mlx-notebook-import", importlib.import_module, "mlx_lm.utils").result(pace)
