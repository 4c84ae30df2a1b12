"""Fixtures for the browser tests: one JupyterLab server and one Chromium per session.

The tests drive JupyterLab the way a person does (clicks on the file browser,
cells, the toolbar's Run button, the menus and the widget's buttons) and
assert on what the page shows: the widget's text, its buttons' labels and
``disabled`` state, the progress bar's outcome class and the stats line.

* :func:`lab_server` starts ``jupyter lab`` on 127.0.0.1 with a random free
  port and a token, in a temporary root folder, with a configuration of its
  own (no news or update checks, no announcements, no build prompts, no
  extension manager), and stops it at the end (terminate, wait, kill).
* :func:`browser` launches Debian's Chromium through Playwright (no download:
  ``executable_path``); ``$MLX_NOTEBOOK_CHROMIUM`` names another binary.
* :func:`lab` gives each test a fresh page and opens notebooks in it
  (:meth:`Lab.open`); at the end it shuts down the kernels the test started.

The tests skip only when Playwright or Chromium is missing. Set
``MLX_NOTEBOOK_REQUIRE_BROWSER=1`` (in CI) to make that a failure instead.
``MLX_NOTEBOOK_BROWSER_DEBUG=1`` prints each test's page and console errors.

Screenshots go to ``$MLX_NOTEBOOK_SCREENSHOTS`` when set (``docs/screenshots``
to refresh the documentation's images), else to pytest's temporary folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .lab_driver import REPO, Lab

CHROMIUM = os.environ.get("MLX_NOTEBOOK_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1200, "height": 900}
SERVER_START_S = 90.0

# JupyterLab's page config: no announcements ("receive official Jupyter news?")
# and no "build recommended" prompts.
PAGE_CONFIG = {
    "disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True},
    "buildAvailable": False,
    "buildCheck": False,
}

# JupyterLab settings of the test server. Notebook windowing off: every cell is
# in the page from the start (by default cells out of view are attached lazily).
USER_SETTINGS = {
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}


# -- skipping -------------------------------------------------------------------------


def missing_browser_tools() -> list[str]:
    """What is missing to run the browser tests (empty when all is there)."""
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("Playwright for Python (pip install playwright)")
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    return missing


def _require_browser_tools() -> None:
    missing = missing_browser_tools()
    if not missing:
        return
    reason = "browser tests need " + " and ".join(missing)
    if os.environ.get("MLX_NOTEBOOK_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " (MLX_NOTEBOOK_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


# -- the server -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LabServer:
    """A running JupyterLab: its URL, token, root folder and process."""

    url: str
    token: str
    root: Path
    process: subprocess.Popen
    log_path: Path
    kernel_name: str = "python3"
    kernel_display_name: str = "Python 3 (ipykernel)"

    def api(self, method: str, path: str, body: dict | None = None) -> Any:
        """Call the server's REST API (setup and teardown only, never for the scenario)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _server_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")  # the kernel imports this checkout
    env["HF_HUB_OFFLINE"] = "1"
    env["JUPYTER_CONFIG_DIR"] = str(home / "config")  # no user config leaks in
    env["JUPYTER_RUNTIME_DIR"] = str(home / "runtime")
    env["IPYTHONDIR"] = str(home / "ipython")  # no user startup files in the kernel
    env.pop("JUPYTER_TOKEN", None)
    return env


def start_lab(home: Path, cache_dir: str, extra_env: dict[str, str] | None = None) -> LabServer:
    """Start JupyterLab in ``home`` and wait until ``/api/status`` answers."""
    root = home / "root"
    for sub in ("root", "config/labconfig", "runtime", "ipython", "workspaces", "settings"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    (home / "config" / "labconfig" / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    for plugin, values in USER_SETTINGS.items():
        package, name = plugin.split(":")
        target = home / "settings" / package / f"{name}.jupyterlab-settings"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values))
    token = uuid.uuid4().hex
    port = free_port()
    env = _server_env(home)
    env["MLX_NOTEBOOK_CACHE"] = cache_dir
    env.update(extra_env or {})
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        f"--LabApp.user_settings_dir={home / 'settings'}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI runners often run as root
    log_path = home / "server.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        cmd, cwd=str(home), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    server = LabServer(f"http://127.0.0.1:{port}", token, root, process, log_path)
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {process.returncode}:\n{server.log_tail()}")
        try:
            server.api("GET", "/api/status")
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        else:
            specs = server.api("GET", "/api/kernelspecs")
            name = "python3" if "python3" in specs["kernelspecs"] else specs["default"]
            server.kernel_name = name
            server.kernel_display_name = specs["kernelspecs"][name]["spec"]["display_name"]
            return server
        if time.monotonic() > deadline:
            stop_lab(server)
            raise RuntimeError(f"jupyter lab did not answer within {SERVER_START_S} s:\n{server.log_tail()}")
        time.sleep(0.25)


def stop_lab(server: LabServer) -> None:
    """Terminate the server (it shuts its kernels down), then kill if it hangs."""
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """One JupyterLab for the whole session (skips when the browser tools are missing)."""
    _require_browser_tools()
    # tests/conftest.py sets MLX_NOTEBOOK_CACHE for the session when the caller did not.
    cache = os.environ.get("MLX_NOTEBOOK_CACHE") or str(tmp_path_factory.mktemp("mlxnb-cache"))
    server = start_lab(tmp_path_factory.mktemp("lab"), cache)
    try:
        yield server
    finally:
        stop_lab(server)


# -- the browser ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser(lab_server: LabServer) -> Iterator[Any]:
    """One headless Chromium for the whole session."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: ``$MLX_NOTEBOOK_SCREENSHOTS`` or a temporary folder."""
    env = os.environ.get("MLX_NOTEBOOK_SCREENSHOTS")
    path = Path(env) if env else tmp_path_factory.mktemp("screenshots")
    if not path.is_absolute():
        path = REPO / path
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def lab(lab_server: LabServer, browser: Any, request: pytest.FixtureRequest) -> Iterator[Lab]:
    """A fresh page (own browser context and workspace) for one test."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(30_000)
    page = context.new_page()
    workspace = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:60] + "-" + uuid.uuid4().hex[:6]
    lab = Lab(lab_server, page, workspace)
    page.on("console", lab._on_console)
    page.on("pageerror", lambda exc: lab.page_errors.append(str(exc)))
    try:
        yield lab
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            shot = Path(str(request.config._tmp_path_factory.getbasetemp())) / f"failed-{workspace}.png"
            try:
                page.screenshot(path=str(shot))
                print(f"\nscreenshot of the failed page: {shot}")
                print(f"page errors: {lab.page_errors}\nconsole errors: {lab.console_errors}")
                print(f"server log tail:\n{lab_server.log_tail(3000)}")
            except Exception:
                pass
        if os.environ.get("MLX_NOTEBOOK_BROWSER_DEBUG"):
            print(f"\n{request.node.name}: page errors {lab.page_errors}, console errors {lab.console_errors}")
        context.close()
        lab.shutdown_kernels()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    # Lets the lab fixture see whether the test failed (for a screenshot).
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
