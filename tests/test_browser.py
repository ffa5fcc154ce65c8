"""Browser tests: the served panel dashboard and the notebook widgets in JupyterLab, in a real chromium."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import urllib.request

import nbformat
import pytest

from hybridflow_lab.models import create_model_dir
from hybridflow_lab.trainer.lab import Lab
from tests.browser import browser_page, free_port, keep_screenshot, needs_chromium, server
from tests.test_lab import local_overrides

pytestmark = [pytest.mark.browser, pytest.mark.slow, needs_chromium]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_model_dir(tmp_path_factory.mktemp("browser") / "m", "tiny", "qwen2", seed=11))


def steps_shown(page) -> int:
    """The step count in the served dashboard's status line."""
    text = page.get_by_text(re.compile(r"\d+ steps, \d+ spans")).first.inner_text(timeout=20_000)
    return int(re.search(r"(\d+) steps", text).group(1))


def test_served_dashboard_renders_a_finished_run_and_follows_a_running_one(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = local_overrides(model_dir, run_dir, "algorithm.name=ppo")
    lab = Lab("arithmetic_grpo", overrides=overrides)
    lab.run(2)
    lab.shutdown()
    port = free_port()
    command = [sys.executable, "-m", "hybridflow_lab.cli", "dashboard", "--run", str(run_dir), "--port", str(port),
               "--period-ms", "300"]
    with server(command, f"http://127.0.0.1:{port}/", tmp_path / "dashboard.log"), browser_page("served") as page:
        page.goto(f"http://127.0.0.1:{port}/")
        page.get_by_text("per-worker timeline").wait_for(timeout=30_000)
        assert steps_shown(page) == 2
        for row in ("controller", "actor r0", "critic r0"):  # Gantt rows (plotly axis labels are SVG text)
            page.get_by_text(row, exact=True).first.wait_for()
        assert page.locator(".barlayer .point").count() > 10  # one bar per span
        for title in ("stage seconds per step", "training curves", "KL to reference"):
            page.get_by_text(title).first.wait_for()
        page.get_by_text(lab.samples[-1]["response"], exact=True).first.wait_for()  # the sample browser
        keep_screenshot(page, "served-dashboard")

        train = subprocess.Popen([sys.executable, "-m", "hybridflow_lab.cli", "train", "--config", "arithmetic_grpo",
                                  *overrides, "trainer.steps=8"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        seen = set()
        deadline = time.monotonic() + 180
        while 8 not in seen and time.monotonic() < deadline:
            seen.add(steps_shown(page))
            time.sleep(0.1)
        assert train.wait(timeout=120) == 0, train.stderr.read().decode()[-2000:]
        assert 8 in seen and seen & set(range(1, 8)), f"the page showed step counts {sorted(seen)}"


NOTEBOOK = [
    """
    from hybridflow_lab.trainer.lab import Lab
    from hybridflow_lab.ui import dashboard, placement_board
    lab = Lab("arithmetic_grpo", overrides=OVERRIDES)
    board = placement_board(lab, devices=4)
    board
    """,
    """
    view = dashboard(lab, interval_s=0.3)
    view
    """,
]


def kernel_client(base_url: str, root):
    """A client of the notebook's kernel, found through the server's sessions."""
    from jupyter_client import BlockingKernelClient
    from jupyter_core.paths import jupyter_runtime_dir

    with urllib.request.urlopen(f"{base_url}/api/sessions") as response:
        sessions = json.load(response)
    kernel_id = sessions[0]["kernel"]["id"]
    client = BlockingKernelClient()
    client.load_connection_file(f"{jupyter_runtime_dir()}/kernel-{kernel_id}.json")
    client.start_channels()
    return client


def run_in_kernel(client, code: str, timeout_s: float = 120) -> str:
    """Execute ``code`` in the kernel; returns its stdout (raises on an error)."""
    output: list[str] = []

    def hook(message):
        if message["msg_type"] == "stream":
            output.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            output.append("\n".join(message["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout_s, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(output)
    return "".join(output)


def test_jupyterlab_board_changes_the_kernels_lab_and_the_dashboard_shows_its_spans(model_dir, tmp_path):
    overrides = [o for o in local_overrides(model_dir, tmp_path / "run") if o != "backend=local"]  # Ray, 1 rank
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(f"OVERRIDES = {overrides!r}")]
    notebook.cells += [nbformat.v4.new_code_cell(textwrap.dedent(code).strip()) for code in NOTEBOOK]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / "board.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)  # no "get notified about news?" toast over the page
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
               "--ServerApp.token=", "--ServerApp.password=", f"--ServerApp.root_dir={tmp_path}",
               "--LabApp.expose_app_in_browser=True", "--allow-root",
               f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path}"]
    with server(command, f"{base}/lab", tmp_path / "jupyter.log"), browser_page("jupyterlab", height=1600) as page:
        page.goto(f"{base}/lab/tree/board.ipynb")
        page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=60_000)
        page.locator(".jp-Notebook").wait_for(timeout=60_000)
        kernel_idle = "window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'"
        page.wait_for_function(kernel_idle, timeout=60_000)
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        board = page.locator(".widget-toggle-buttons").filter(has_text="pool main slots")
        board.wait_for(timeout=120_000)
        page.get_by_text("valid: 1 of 4 slots").wait_for(timeout=30_000)
        page.get_by_text("per-worker timeline").wait_for(timeout=60_000)
        keep_screenshot(page, "jupyterlab-placement-board")

        board.get_by_role("button", name="2", exact=True).click()  # two actor ranks
        page.get_by_text("valid: 2 of 4 slots").wait_for(timeout=30_000)
        page.get_by_role("button", name="Apply").click()
        page.get_by_text("applied and restarted the worker groups").wait_for(timeout=120_000)

        client = kernel_client(base, tmp_path)
        try:
            state = run_in_kernel(client, "print(lab.config.actor.ranks, lab.actor.world_size)")
            assert state.split() == ["2", "2"]
            run_in_kernel(client, "metrics = lab.step()")
        finally:
            client.stop_channels()
        for row in ("controller", "actor r0", "actor r1"):  # the new layout's ranks in the live timeline
            page.get_by_text(row, exact=True).first.wait_for(timeout=60_000)
        page.get_by_text("stage seconds per step").first.scroll_into_view_if_needed()
        keep_screenshot(page, "jupyterlab-dashboard")
        page.evaluate("window.jupyterapp.commands.execute('kernelmenu:shutdown')")
