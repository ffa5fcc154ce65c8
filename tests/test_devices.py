"""Device placement: a rank's device is checked at start, every tensor the workers create follows it, and
each call's memory before and after is on the timeline. (No GPU runs in CI: ``scripts/gpu_smoke.sh`` runs the
CUDA side where one is available.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.config import ConfigError, LabConfig, RoleConfig
from hybridflow_lab.controller import ResourcePool, Role, WorkerCallError, WorkerGroup
from hybridflow_lab.controller.devices import rank_device
from hybridflow_lab.dataflows import check_config
from hybridflow_lab.models import create_model_dir
from hybridflow_lab.telemetry import Phase, TelemetryStore
from tests.workers import Echo

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow_lab"
# code that runs inside a worker on the rank's device: every tensor it creates says where
WORKER_SIDE = [*(PACKAGE / d for d in ("engines", "hybrid", "workers")), PACKAGE / "models" / "tensor_parallel.py"]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm", "eye",
             "linspace", "as_tensor"}


def tensor_creations_without_device(path: Path) -> list[str]:
    """``torch.<factory>(...)`` calls in ``path`` that do not pass ``device=`` (``*_like`` calls follow their input)."""
    tree = ast.parse(path.read_text())
    # module constructors build parameters on the ambient device (``with torch.device("meta")``, then moved)
    constructors = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                    for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if (id(node) not in constructors and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} torch.{node.func.attr}")
    return found


def test_worker_side_code_creates_no_tensor_without_a_device():
    files = [f for root in WORKER_SIDE for f in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    assert len(files) > 20
    offenders = [hit for f in files for hit in tensor_creations_without_device(f)]
    assert offenders == [], "tensors created on the default (CPU) device inside workers:\n" + "\n".join(offenders)


@pytest.mark.parametrize("device", ["cuda:99", "gpu", "mps"])
def test_a_device_a_rank_cannot_use_fails_the_start_naming_it(device):
    with pytest.raises(WorkerCallError) as info:
        WorkerGroup(Role(Echo), ResourcePool(1), backend="local", device=device, name="wrong-device")
    assert info.value.method == "__init__" and repr(device) in info.value.error


def test_cpu_ranks_get_the_cpu():
    assert rank_device("cpu", "ray") == "cpu" and rank_device("cpu", "local") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_a_config_asking_for_gpus_on_a_machine_without_them_fails_before_start(tmp_path):
    model = str(create_model_dir(tmp_path / "tiny", "tiny", "qwen2"))
    for device, fix in (("cuda", "use device=cpu"), ("tpu", "is not one of ('auto', 'cpu', 'cuda')")):
        with pytest.raises(ConfigError) as info:
            check_config(LabConfig(device=device, actor=RoleConfig(model_path=model, ranks=2)))
        assert info.value.key == "device" and fix in str(info.value)


def test_every_call_records_the_memory_before_and_after_it():
    store = TelemetryStore()
    group = WorkerGroup(Role(Echo), ResourcePool(1), backend="local", telemetry=store, name="memory-fields")
    try:
        group.scale(DataBatch({"x": torch.arange(4.0)}))
    finally:
        group.shutdown()
    (span,) = [s for s in store.spans() if s.name == "scale" and s.phase == Phase.EXECUTE]
    assert span.attrs["memory_kind"] == "rss"
    assert span.attrs["memory_before_mib"] > 50 and span.attrs["memory_after_mib"] > 50  # a torch process
