"""Helpers shared by the tests, the benchmarks and the scripts (not shipped in the wheel).

Run from the repository root: ``pytest`` adds it to ``sys.path`` (``pythonpath``
in ``pyproject.toml``); benchmarks and scripts run as modules
(``python -m benchmarks.bench``), which puts the root on the path.
"""
