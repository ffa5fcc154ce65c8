"""The GPU smoke check's code, run on the CPU so that it works the day a GPU is there."""

from __future__ import annotations

import json

import pytest

from hybridflow_lab.smoke.__main__ import run

pytestmark = pytest.mark.slow


@pytest.mark.ray
def test_the_smoke_checks_pass_on_the_cpu(ray_cluster):
    # the compiled paths it would check are tests/test_lab.py's and tests/test_compiled_layers.py's
    summary = run("cpu", ["placement", "engines"], engines=(("torch", 0),))
    json.dumps(summary)  # one JSON summary
    placement, engines = summary["checks"]["placement"], summary["checks"]["engines"]
    assert placement["ok"], placement
    assert [r["rank"] for r in placement["ranks"]] == [0, 1]
    assert placement["all_reduce"]["tp"] == {"device": 3.0, "cpu": 3.0, "expected": 3.0}
    assert engines["ok"], engines
    assert engines["torch"]["state_devices"] == {"parameters": ["cpu"], "optimizer_state": ["cpu"]}
    assert engines["torch"]["losses"] == pytest.approx(engines["cpu_losses"], rel=1e-5)
    assert engines["torch-bf16"]["losses"] != engines["cpu_losses"]  # bf16 is honoured, within tolerance
    assert summary["ok"] and summary["versions"]["torch"].startswith("2.13")
