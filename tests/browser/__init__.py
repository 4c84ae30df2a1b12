"""Browser end-to-end tests: JupyterLab + Chromium driving ``%%mlxgen`` (see conftest.py)."""
