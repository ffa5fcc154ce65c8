"""The command line: train and eval from a preset, the demos, and what trace and dashboard say of a bad run
directory (the benches: tests/test_bench_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args: str, with_stderr: bool = False) -> str:
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr if with_stderr else done.stdout


def test_train_then_eval_from_a_preset(tmp_path):
    model = tmp_path / "m"
    run_cli("init-model", str(model))
    overrides = [f"actor.model_path={model}", f"trainer.run_dir={tmp_path / 'run'}", "backend=local", "actor.ranks=1",
                 "actor.engine.backend=torch", "trainer.steps=2", "trainer.progress=false", "task.eval_size=8"]
    trained = json.loads(run_cli("train", "--config", "arithmetic_grpo", *overrides).splitlines()[-1])
    assert trained["step"] == 2 and (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()
    evaluated = json.loads(run_cli("eval", "--config", "arithmetic_grpo", *overrides).splitlines()[-1])
    assert evaluated["eval/accuracy"] == trained["eval/accuracy"] and evaluated["step"] == 2


@pytest.mark.ray
def test_controller_demo_runs_the_dataflow_and_prints_spans():
    out = run_cli("demo", "controller")
    assert "hello" in out and "reward" in out
    assert "generate" in out and "transfer" in out and "execute" in out


@pytest.mark.ray
def test_the_calculator_demo_learns_to_call_the_tool_and_reports_accuracy_before_after_and_the_curve(tmp_path):
    """The agentic demo end to end (multi-turn rollouts on 2 Ray ranks, DeepSpeed), shortened: a warm start of 200
    steps (it calls the tool in 30% of its exchanges; tutorial 13's, from the warm-start cache) and 20 GRPO steps
    make the policy call the tool and raise held-out accuracy by far more than 20 points (the demo's own +60 to +75
    on seeds 0-2 after 60 steps: docs/agents.md)."""
    rl_steps = 20  # the curve's first point
    out = run_cli("demo", "--task", "calculator", "--run-dir", str(tmp_path), "--sft-steps", "200", "--rl-steps",
                  str(rl_steps), "--seed", "0", with_stderr=True)
    summary = json.loads(out[out.index("\n{") : out.index("\n}") + 2])
    assert summary["seed"] == 0 and summary["gain_points"] >= 20
    assert summary["tool_use_after_rl"] > summary["tool_use_before_rl"] + 0.2
    assert summary["gain_points"] == pytest.approx(100 * (summary["accuracy_after_rl"] - summary["accuracy_before_rl"]),
                                                   abs=0.051)
    assert list(summary["accuracy_every_20_steps"]) == [str(step) for step in range(20, rl_steps + 1, 20)]
    assert len((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()) == rl_steps
    assert (tmp_path / "grpo" / "checkpoints" / f"step_{rl_steps:06d}").is_dir()
    # what a new user reads: one progress bar, the curve, the JSON, where to look next; no warnings
    assert "warning" not in out.lower() and "deprecated" not in out, out
    assert f"[demo] step    0  {summary['accuracy_before_rl']:.3f}" in out
    assert f"make dashboard RUN={tmp_path / 'grpo'}" in out


def test_dashboard_command_names_a_missing_run_directory(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "dashboard", "--run", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"hybridflow-lab dashboard: error: no run directory {tmp_path / 'nope'}")


def test_trace_writes_a_runs_spans_as_a_chrome_trace(tmp_path):
    from hybridflow_lab.telemetry import JsonlSink, Phase, Span, TelemetryStore

    store = TelemetryStore()
    sink = JsonlSink(tmp_path / "spans.jsonl").attach(store)
    store.record([Span("generate", Phase.STAGE, 10.0, 10.5, step=0, attrs={"pool": "pool main"}),
                  Span("generate_sequences", Phase.EXECUTE, 10.1, 10.4, group="lab.actor", rank=1, step=0,
                       bytes_moved=64),
                  Span("generate_sequences", Phase.CALL, 10.0, 10.45, group="lab.actor", step=0)])
    sink.close()
    out = run_cli("trace", "--run", str(tmp_path), "-o", str(tmp_path / "trace.json"))
    assert "8 events in" in out and "ui.perfetto.dev" in out
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(processes.values()) == ["actor", "controller"]
    assert sorted(threads.values()) == ["calls", "rank 1", "stages"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["ts"], e["dur"]) for e in spans] == [
        ("generate", "stage", 0.0, 500000.0), ("generate_sequences", "call", 0.0, 450000.0),
        ("generate_sequences", "execute", 100000.0, 300000.0)]
    execute = spans[2]
    assert processes[execute["pid"]] == "actor" and threads[execute["tid"]] == "rank 1"
    assert execute["args"] == {"step": 0, "bytes": 64}
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "trace", "--run", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and f"no {tmp_path / 'nope' / 'spans.jsonl'}" in done.stderr
