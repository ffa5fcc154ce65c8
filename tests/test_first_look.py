"""What a newcomer does first: ``make lab``, the URL it printed opened in a browser, tutorial 1's first cells run
(the README's cell), and the live dashboard rendering the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybridflow_lab.lab_server import answers
from tests.browser import browser_page, free_port, keep_screenshot, needs_chromium, slow_widget_modules

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = "01_rlhf_dataflow_and_single_controller.ipynb"
URL = re.compile(r"http://127\.0\.0\.1:(\d+)/lab/tree/tutorials\?token=(\w+)")

pytestmark = [pytest.mark.browser, pytest.mark.ray, pytest.mark.slow, needs_chromium,
              pytest.mark.skipif(not (ROOT / ".venv" / ".lab").exists(), reason="make lab's .venv is not built here")]


def printed_url(make: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The URL ``make lab`` printed to ``log``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and make.poll() is None:
        found = URL.search(log.read_text())
        if found:
            return found.group(0)
        time.sleep(0.2)
    raise AssertionError("make lab printed no URL:\n" + log.read_text()[-3000:])


# its own wait for the run (a loaded machine's), not the suite's 300 s per test
@pytest.mark.timeout(600)
def test_make_lab_serves_the_tutorials_behind_a_token_and_tutorial_1_shows_the_live_dashboard(tmp_path):
    settings = tmp_path / "settings" / "@jupyterlab"
    for plugin, values in {"apputils-extension/notification": {"fetchNews": "false"},  # no toast over the page
                           "docmanager-extension/plugin": {"autosave": False}}.items():  # the tutorial stays clean
        (settings / plugin).parent.mkdir(parents=True, exist_ok=True)
        (settings / f"{plugin}.jupyterlab-settings").write_text(json.dumps(values))
    tutorial = ROOT / "tutorials" / TUTORIAL
    committed = tutorial.read_bytes()
    port = free_port()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    log = tmp_path / "make-lab.log"
    with log.open("w") as output:  # a file, not a pipe: JupyterLab's log must never block on a full pipe
        make = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_PORT={port}"], cwd=ROOT, env=env,
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = printed_url(make, log, timeout_s=120)
        printed_port, token = URL.search(url).groups()
        assert printed_port == str(port) and len(token) >= 32
        assert answers(url.split("/lab/")[0] + "/api/status") == 403
        with browser_page("first-look", height=1400) as page:
            slow_widget_modules(page, seconds=3)  # as on a loaded machine: the figures must still fill in
            page.goto(url)
            page.get_by_text(TUTORIAL).click(timeout=60_000)
            page.keyboard.press("Enter")  # opens it, and starts its kernel
            page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).first.wait_for(timeout=60_000)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            for _ in range(4):  # the title, the parameters, "A first look", the README's cell
                page.keyboard.press("Shift+Enter")
            page.get_by_text(re.compile(r"step 10 · \d+ spans · 10 steps of metrics")).wait_for(timeout=360_000)
            page.get_by_text("per-worker timeline", exact=True).wait_for(timeout=60_000)
            for row in ("controller", "actor r0", "actor r1"):  # the run's two Ray ranks in the timeline
                page.get_by_text(row, exact=True).first.wait_for()
            page.get_by_text("training curves").first.scroll_into_view_if_needed()
            keep_screenshot(page, "jupyterlab-first-look")
            page.keyboard.press("Shift+Enter")  # lab.shutdown(), the third code cell to run
            page.locator(".jp-InputPrompt", has_text="[3]:").wait_for(timeout=120_000)
    finally:
        os.killpg(make.pid, signal.SIGTERM)  # make, the launcher and JupyterLab, which stops its kernel
        make.wait(timeout=60)
    assert tutorial.read_bytes() == committed
