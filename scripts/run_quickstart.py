#!/usr/bin/env python3
"""Run ``notebooks/quickstart.ipynb`` headless and print what each ``%%mlxgen`` cell generated.

The notebook runs in a real ``python3`` kernel through nbclient, the way
papermill or ``jupyter nbconvert --execute`` would. nbclient renders no
widgets, so what it stores is the ``text/plain`` part of each generation's
display, which mlx-notebook updates with the final text (see
``mlx_notebook/widget.py``); this script reads it back from the notebook.

Usage::

    python scripts/run_quickstart.py                  # the default model
    python scripts/run_quickstart.py --model PATH     # any other model
    python scripts/run_quickstart.py --save out.ipynb # keep the executed notebook
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
METADATA_KEY = "mlx_notebook"  # as in mlx_notebook/widget.py (not imported: no MLX needed here)


def generations(nb: Any) -> list[dict[str, Any]]:
    """Each ``%%mlxgen`` or ``%%mlxchat`` cell's generation: cell index, id, state and text."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.lstrip().startswith(("%%mlxgen", "%%mlxchat")):
            continue
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get(METADATA_KEY)
            if output.get("output_type") != "display_data" or not meta:
                continue
            plain = output.get("data", {}).get("text/plain", "")
            found.append({"cell": index, "id": meta["id"], "state": meta["state"], "text": plain[: meta["chars"]]})
    return found


def run(
    notebook: Path = NOTEBOOK,
    *,
    model: str | None = None,
    timeout: int = 900,
    save: Path | None = None,
) -> Any:
    """Execute ``notebook`` in a fresh kernel and return the executed notebook.

    Args:
        notebook: The notebook. Default: the quickstart.
        model: Passed to the kernel as ``--MLXGen.model``. Default: ``None``
          (the notebook's own choice, the default model).
        timeout: Seconds one cell may run. Default: ``900``.
        save: Where to write the executed notebook. Default: ``None``.

    Raises:
        nbclient.exceptions.CellExecutionError: A cell failed.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout,
        startup_timeout=120,
        resources={"metadata": {"path": str(notebook.parent)}},
        extra_arguments=[f"--MLXGen.model={model}"] if model else [],
    )
    # The kernel inherits this environment: make this checkout importable
    # even when the package is not installed.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + saved if saved else "")
    try:
        client.execute()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    if save is not None:
        nbformat.write(nb, save)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=NOTEBOOK, help="default: notebooks/quickstart.ipynb")
    parser.add_argument("--model", default=None, help="model for every %%%%mlxgen cell (default: the notebook's)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one cell may run (default 900)")
    parser.add_argument("--save", type=Path, default=None, help="write the executed notebook here")
    args = parser.parse_args(argv)

    from nbclient.exceptions import CellExecutionError

    start = time.monotonic()
    try:
        nb = run(args.notebook, model=args.model, timeout=args.timeout, save=args.save)
    except CellExecutionError as exc:
        print(f"a cell failed:\n{exc}", file=sys.stderr)
        return 1
    found = generations(nb)
    for gen in found:
        print(f"--- cell {gen['cell']}: generation #{gen['id']} ({gen['state']})")
        print(gen["text"] if gen["text"] else "(no text)")
    print(f"--- {len(found)} generations in {time.monotonic() - start:.0f} s")
    empty = [g for g in found if not g["text"]]
    return 1 if not found or empty else 0


if __name__ == "__main__":
    sys.exit(main())
