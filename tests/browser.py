"""Real-browser helpers: Debian's chromium through Playwright, local servers, screenshots.

A failing browser test leaves a full-page screenshot in ``test-artifacts/``; with
``HYBRIDFLOW_SCREENSHOTS=<dir>`` the tests also save their screenshots there on success.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Flags that let chromium run as root in a container without a GPU or network services.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                    reason="chromium is not installed: run `make browser`")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_http(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200 (or fail with the server's exit status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


@contextmanager
def server(command: Sequence[str], url: str, log: Path, timeout_s: float = 60.0,
           env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run a server process until the block ends; its output goes to ``log``."""
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            try:
                wait_for_http(url, timeout_s, process)
            except (RuntimeError, TimeoutError) as error:
                raise RuntimeError(f"{error}; its log ends with:\n{log.read_text()[-3000:]}") from None
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


@contextmanager
def browser_page(name: str, width: int = 1300, height: int = 1000) -> Iterator[object]:
    """A chromium page; on an exception its screenshot is saved as ``test-artifacts/<name>-failure.png``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        try:
            yield page
        except BaseException:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{name}-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


# How anywidget loads a widget's code: a JavaScript blob imported as a module (plotly's FigureWidget sends 5 MB of
# it with each figure). Prefixed with a wait, each such module loads as slowly as on a loaded machine.
SLOW_WIDGET_MODULES = """(() => {
  const createObjectURL = URL.createObjectURL.bind(URL);
  URL.createObjectURL = (blob) => createObjectURL(blob instanceof Blob && blob.type.includes("javascript")
    ? new Blob([`await new Promise((done) => setTimeout(done, ${SECONDS} * 1000));\\n`, blob], {type: blob.type})
    : blob);
})();"""


def slow_widget_modules(page: object, seconds: float) -> None:
    """Make every widget module ``page`` loads from a blob wait ``seconds`` before it runs."""
    page.add_init_script(SLOW_WIDGET_MODULES.replace("${SECONDS}", str(seconds)))


def keep_screenshot(page: object, name: str) -> None:
    """Save a screenshot for the docs when ``HYBRIDFLOW_SCREENSHOTS`` names a directory."""
    target = os.environ.get("HYBRIDFLOW_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / f"{name}.png"), full_page=True)
