"""The command line: the demo and the dispatch benchmark run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_demo_runs_the_dataflow_and_prints_spans():
    out = run_cli("demo")
    assert "hello" in out and "reward" in out
    assert "generate" in out and "transfer" in out and "execute" in out


def test_bench_dispatch_prints_comparable_json(tmp_path):
    target = tmp_path / "dispatch.json"
    report = json.loads(run_cli("bench", "dispatch", "--quick", "--out", str(target)))
    assert json.loads(target.read_text()) == report
    rows = report["results"]
    assert {r["mode"] for r in rows} == {"ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "MESH"}
    assert {(r["workers"], r["payload_bytes"]) for r in rows} == {(1, 0), (1, 1 << 20), (2, 0), (2, 1 << 20)}
    for row in rows:
        assert set(row) >= {"mode", "workers", "payload_bytes", "ours_ms_p50", "ray_ms_p50", "ratio"}
        assert row["ours_ms_p50"] > 0 and row["ray_ms_p50"] > 0
        assert row["ratio"] == pytest.approx(row["ours_ms_p50"] / row["ray_ms_p50"], rel=0.01)
