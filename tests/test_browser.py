"""Browser tests: the served panel dashboard and the notebook widgets in JupyterLab, in a real chromium."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import nbformat
import pytest

from hybridflow_lab.trainer.lab import Lab
from tests.browser import browser_page, free_port, keep_screenshot, needs_chromium, server, slow_widget_modules
from tests.test_lab import local_overrides

pytestmark = [pytest.mark.browser, pytest.mark.slow, needs_chromium]


MODEL_SEED = 11  # conftest's model_dir builds this module's tiny model with it


def steps_shown(page) -> int:
    """The step count in the served dashboard's status line."""
    # text_content is what the pattern matched; inner_text once came back without the count (a flaky read)
    text = page.get_by_text(re.compile(r"\d+ steps, \d+ spans")).first.text_content(timeout=20_000)
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
        for stage in ("generate", "values", "update_critic"):  # the last step's dataflow graph
            page.locator(f"g.hybridflow-node[data-stage='{stage}']").wait_for()
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


@contextmanager
def jupyterlab_running(tmp_path, name: str, overrides: list[str], cells: list[str]) -> Iterator[tuple[object, str]]:
    """JupyterLab on loopback with a notebook of ``cells`` (after ``OVERRIDES = overrides``), opened in chromium
    with every cell run; yields the page and the server's base URL, and shuts the kernel down after."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(f"OVERRIDES = {overrides!r}")]
    notebook.cells += [nbformat.v4.new_code_cell(textwrap.dedent(code).strip()) for code in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / f"{name}.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)  # no "get notified about news?" toast over the page
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
               "--ServerApp.token=", "--ServerApp.password=", f"--ServerApp.root_dir={tmp_path}",
               "--LabApp.expose_app_in_browser=True", "--allow-root",
               f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path}"]
    with server(command, f"{base}/lab", tmp_path / "jupyter.log"), browser_page(name, height=1600) as page:
        slow_widget_modules(page, seconds=3)  # as on a loaded machine: every figure must still show its data
        page.goto(f"{base}/lab/tree/{name}.ipynb")
        page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=60_000)
        page.locator(".jp-Notebook").wait_for(timeout=60_000)
        kernel_idle = "window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'"
        page.wait_for_function(kernel_idle, timeout=60_000)
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")  # not awaited
        yield page, base
        page.evaluate("window.jupyterapp.commands.execute('kernelmenu:shutdown')")


@pytest.mark.ray
def test_jupyterlab_board_changes_the_kernels_lab_and_the_dashboard_shows_its_spans(model_dir, tmp_path):
    overrides = [o for o in local_overrides(model_dir, tmp_path / "run") if o != "backend=local"]  # Ray, 1 rank
    with jupyterlab_running(tmp_path, "board", overrides, NOTEBOOK) as (page, base):
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


GRAPH_NOTEBOOK = [
    """
    import time
    from hybridflow_lab.trainer.lab import Lab
    from hybridflow_lab.ui import compare, dashboard
    lab = Lab("arithmetic_grpo", overrides=OVERRIDES)
    scorer = lab.task.reward
    lab.step()
    view = dashboard(lab, interval_s=0.2)
    view
    """,
    """
    def slow_reward(prompt, response, truth):  # the reward stage lasts until the test has watched it
        deadline = time.monotonic() + 120
        while not RELEASE.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return float(len(response) % 3) / 2

    lab.task.reward = slow_reward
    metrics = lab.step()
    """,
    """
    compare(lab.replay(2, "reward"), lab.replay(2, "reward", "algorithm.name=rloo"),
            lab.replay(2, "reward", "algorithm.policy_loss=gspo", name="gspo"))
    """,
]


def test_jupyterlab_dataflow_graph_follows_the_running_stage_shows_a_chosen_one_and_a_replay_renders(model_dir,
                                                                                                        tmp_path):
    overrides = local_overrides(model_dir, tmp_path / "run", "trainer.capture=reward")
    release = tmp_path / "release"
    cells = [f"from pathlib import Path\nRELEASE = Path({str(release)!r})", *GRAPH_NOTEBOOK]
    with jupyterlab_running(tmp_path, "graph", list(overrides), cells) as (page, _):
        graph = page.locator("svg.hybridflow-graph")
        graph.wait_for(timeout=120_000)
        for stage in ("next_prompts", "generate", "reward", "old_log_prob", "adv", "update_actor"):
            graph.locator(f"g.hybridflow-node[data-stage='{stage}']").wait_for(timeout=30_000)
        running = graph.locator("g.hybridflow-node[data-status='running']")
        running.wait_for(timeout=120_000)  # the slow reward stage, live
        assert running.get_attribute("data-stage") == "reward"
        assert graph.locator("g.hybridflow-node[data-stage='update_actor'][data-status='waiting']").count() == 1
        keep_screenshot(page, "jupyterlab-dataflow-graph")
        release.touch()
        page.get_by_text("mean |advantage|").wait_for(timeout=180_000)  # the replay comparison's table
        for name in ("grpo", "algorithm.name=rloo", "gspo"):
            page.locator("th", has_text=name).first.wait_for()
        assert page.locator(".js-plotly-plot .heatmaplayer").count() >= 1
        page.locator("g.hybridflow-node[data-status='running']").wait_for(state="detached", timeout=30_000)
        page.locator(".widget-dropdown").filter(has_text="stage").locator("select").select_option("update_actor")
        page.get_by_text("actor.update_actor on ranks [0]").wait_for(timeout=30_000)
        page.locator("g.hybridflow-node[data-stage='update_actor'] rect[stroke='#d62728']").wait_for()
        page.get_by_text("mean |advantage|").scroll_into_view_if_needed()
        keep_screenshot(page, "jupyterlab-replay-compare")

        page.evaluate("() => { window.jupyterapp.commands.execute('apputils:change-theme', "
                      "{theme: 'JupyterLab Dark'}); }")
        page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
        page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30_000)
        colours = page.evaluate("""() => {
            const text = document.querySelector('.hybridflow-themed .js-plotly-plot .xtick text');
            const paper = document.querySelector('.hybridflow-themed .js-plotly-plot .main-svg');
            const probe = document.createElement('span');
            probe.style.color = 'var(--jp-ui-font-color1)';
            document.body.appendChild(probe);
            return {text: getComputedStyle(text).fill, theme: getComputedStyle(probe).color,
                    paper: getComputedStyle(paper).backgroundColor};
        }""")
        assert colours["text"] == colours["theme"] and colours["paper"] == "rgba(0, 0, 0, 0)", colours
        keep_screenshot(page, "jupyterlab-dark-theme")


def test_served_dashboard_compares_two_runs(model_dir, tmp_path):
    for name, lr in (("small-lr", "1e-4"), ("large-lr", "1e-3")):
        lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / name, f"actor.optim.lr={lr}"))
        lab.run(3)
        lab.shutdown()
    port = free_port()
    command = [sys.executable, "-m", "hybridflow_lab.cli", "dashboard", "--run", str(tmp_path / "small-lr"),
               "--run", str(tmp_path / "large-lr"), "--port", str(port)]
    with server(command, f"http://127.0.0.1:{port}/", tmp_path / "dashboard.log"), browser_page("compare") as page:
        page.goto(f"http://127.0.0.1:{port}/")
        page.get_by_text("runs compared").wait_for(timeout=30_000)
        page.get_by_text("actor.optim.lr").first.wait_for(timeout=30_000)
        for legend in ("small-lr: critic/score/mean (mean of 10)", "large-lr: critic/score/mean (mean of 10)"):
            page.get_by_text(legend, exact=True).first.wait_for(timeout=30_000)
        page.get_by_text("median seconds per step, stage by stage").wait_for()
        keep_screenshot(page, "served-run-comparison")
