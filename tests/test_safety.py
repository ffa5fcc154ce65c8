"""Safety: servers listen on loopback unless exposed on purpose, loads never run pickled code, secrets stay out of
run directories."""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from hybridflow_lab.controller.cluster import dashboard_host
from hybridflow_lab.exposure import ExposureRefused, checked_bind_address
from hybridflow_lab.models import convert_to_safetensors, create_model_dir, load_causal_lm
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.redact import REDACTED, redact
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.run_log import MetricsLog
from tests.browser import free_port, server
from tests.test_lab import local_overrides

FAKE_WANDB_KEY = "fakewandbkey" + "0123456789abcdef" * 2  # 44 characters, shaped like a real key


# ------------------------------------------------------------------ servers
def dashboard_command(run_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hybridflow_lab.cli", "dashboard", "--run", str(run_dir), "--port", str(port),
            *extra]


def listening_ips(pid: int, port: int) -> set[str]:
    """The local addresses on which process ``pid`` listens on ``port``."""
    return {conn.laddr.ip for conn in psutil.Process(pid).net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port}


def test_the_served_dashboard_listens_on_loopback_only_by_default(tmp_path):
    port = free_port()
    log = tmp_path / "dashboard.log"
    with server(dashboard_command(tmp_path, port), f"http://127.0.0.1:{port}/", log) as process:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert listening_ips(process.pid, port) == {"127.0.0.1"}
    assert "listens on" not in log.read_text()  # no exposure warning


def test_the_dashboard_refuses_a_non_loopback_address_without_expose(tmp_path):
    port = free_port()
    done = subprocess.run(dashboard_command(tmp_path, port, "--address", "0.0.0.0"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert done.stderr.startswith("hybridflow-lab dashboard: error: the run dashboard would listen on 0.0.0.0")
    assert "add --expose" in done.stderr and "Traceback" not in done.stderr


def test_expose_serves_on_the_given_address_with_a_warning(tmp_path):
    port = free_port()
    log = tmp_path / "dashboard.log"
    command = dashboard_command(tmp_path, port, "--address", "0.0.0.0", "--expose")
    with server(command, f"http://127.0.0.1:{port}/", log) as process:
        assert listening_ips(process.pid, port) == {"0.0.0.0"}
    assert "the run dashboard listens on 0.0.0.0: anyone who can reach this address can use it" in log.read_text()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_addresses_need_no_opt_in(address, caplog):
    assert checked_bind_address(address, False, "a server", "--expose") == address
    assert not caplog.records


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "10.1.2.3", "my-host.example"])
def test_other_addresses_need_the_opt_in_and_are_logged(address, caplog):
    with pytest.raises(ExposureRefused, match=rf"a server would listen on {address}, .* add --expose"):
        checked_bind_address(address, False, "a server", "--expose")
    with caplog.at_level(logging.WARNING):
        assert checked_bind_address(address, True, "a server", "--expose") == address
    assert [r.getMessage() for r in caplog.records] == [
        f"a server listens on {address}: anyone who can reach this address can use it, without a login"]


@pytest.mark.ray
def test_a_local_ray_keeps_token_authentication_on(ray_cluster):
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert get_authentication_mode() == AuthenticationMode.TOKEN


BREAKPOINT_IN_A_WORKER = """
import json, os, socket, time
import ray
from ray._private.ray_constants import KV_NAMESPACE_PDB
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list
from hybridflow_lab.controller import init_cluster

init_cluster(num_cpus=1)

@ray.remote
def stop_here():
    breakpoint()
    return os.environ["RAY_DEBUG"]

stopped = stop_here.remote()
deadline = time.monotonic() + 90
while not (keys := _internal_kv_list("RAY_PDB_", namespace=KV_NAMESPACE_PDB)) and time.monotonic() < deadline:
    time.sleep(0.2)
host, port = json.loads(_internal_kv_get(keys[0], namespace=KV_NAMESPACE_PDB))["pdb_address"].rsplit(":", 1)
with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as pdb:
    pdb.sendall(b"continue\\n")
    print(json.dumps({"host": host, "debugger": ray.get(stopped, timeout=60)}))
"""


@pytest.mark.ray
def test_a_breakpoint_in_a_ray_worker_listens_on_loopback_and_continues_when_told():
    """Ray's default debugger (``RAY_DEBUG=1``) would listen on the node's address with no authentication; the
    project's Ray workers open Ray's pdb on 127.0.0.1 instead, which ``ray debug`` (here: a socket) attaches to.
    In a Ray of its own, started the way a Lab starts one, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_DEBUG"}
    done = subprocess.run([sys.executable, "-c", BREAKPOINT_IN_A_WORKER], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"host": "localhost", "debugger": "legacy"}


def test_init_cluster_refuses_an_unexposed_ray_dashboard_host_before_starting_ray():
    # in a fresh process: this test session's Ray may already be running, which makes init_cluster a no-op
    code = ("from hybridflow_lab.controller import init_cluster\n"
            "init_cluster(num_cpus=1, include_dashboard=True, dashboard_host='0.0.0.0')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ExposureRefused: the Ray dashboard would listen on 0.0.0.0" in done.stderr
    assert "add expose_dashboard=True" in done.stderr and "Started a local Ray" not in done.stderr


def test_the_ray_dashboard_is_exposed_only_with_the_opt_in_and_token_authentication(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert dashboard_host("127.0.0.1") == "127.0.0.1"
    assert dashboard_host("0.0.0.0", expose=True) == "0.0.0.0"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert dashboard_host("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ExposureRefused, match=r"expose the Ray dashboard on 0\.0\.0\.0 while RAY_AUTH_MODE=disabled"):
        dashboard_host("0.0.0.0", expose=True)


# ------------------------------------------------------------------ loading
class WritesMarker:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",)


def test_the_payload_runs_when_unpickled(tmp_path):
    """The malicious object of the tests below is real: plain unpickling runs it."""
    pickle.loads(pickle.dumps(WritesMarker(tmp_path / "marker")))
    assert (tmp_path / "marker").read_text() == "ran"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch on the plain pickle, before refusing it
@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_loading_a_malicious_batch_is_refused_without_running_it(tmp_path, writer):
    path, marker = tmp_path / "batch.pt", tmp_path / "marker"
    record = {"format": "hybridflow_lab.DataBatch/1", "tensors": {}, "meta": WritesMarker(marker)}
    if writer == "torch.save":
        torch.save(record, path)
    else:
        path.write_bytes(pickle.dumps(record))
    with pytest.raises(ValueError, match="is not a saved DataBatch: it holds Python objects that could run code"):
        DataBatch.load(path)
    assert not marker.exists()


def pickle_only_model_dir(tmp_path: Path, sharded: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model directory whose weights are only pickles (one ``pytorch_model.bin`` or two indexed shards), and
    those weights."""
    path = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=3)
    state = load_causal_lm(path).state_dict()
    (path / "model.safetensors").unlink()
    if not sharded:
        torch.save(state, path / "pytorch_model.bin")
        return path, state
    names = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[:5], "pytorch_model-00002-of-00002.bin": names[5:]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path, state


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_pickle_only_model_directory_loads_only_after_an_explicit_conversion(tmp_path, sharded):
    path, state = pickle_only_model_dir(tmp_path, sharded)
    with pytest.raises(FileNotFoundError, match=r"has only pickle weights \(pytorch_model.*\.bin\), which can "
                                                r"run code.*hybridflow_lab\.models\.convert_to_safetensors"):
        load_causal_lm(path)
    assert convert_to_safetensors(path) == path / "model.safetensors"
    loaded = load_causal_lm(path).state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_converting_malicious_pickle_weights_is_refused_without_running_them(tmp_path):
    path, state = pickle_only_model_dir(tmp_path)
    torch.save({**state, "payload": WritesMarker(tmp_path / "marker")}, path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        convert_to_safetensors(path)
    assert not (tmp_path / "marker").exists() and not (path / "model.safetensors").exists()


# ------------------------------------------------------------------ secrets
def files_containing(root: Path, secret: str) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file() and secret.encode() in
            p.read_bytes()]


def test_redact_scrubs_secret_keys_url_passwords_and_known_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password netrcpassword42\n")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    monkeypatch.setenv("SHORT_TOKEN", "1")  # too short to hunt for in text
    config = {"trainer": {"run_dir": f"runs/{FAKE_WANDB_KEY}", "max_new_tokens": 32},
              "hub": {"hf_token": "hf_abc", "api-key": "k", "password": ""},
              "sources": ["https://me:hunter2hunter2@host/data.jsonl", "uses netrcpassword42", "count: 1"]}
    assert redact(config) == {
        "trainer": {"run_dir": f"runs/{REDACTED}", "max_new_tokens": 32},
        "hub": {"hf_token": REDACTED, "api-key": REDACTED, "password": ""},
        "sources": [f"https://me:{REDACTED}@host/data.jsonl", f"uses {REDACTED}", "count: 1"]}


def test_the_config_logged_to_wandb_is_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = {"task": {"dataset_path": f"/data/{FAKE_WANDB_KEY}/gsm8k.jsonl", "name": "canary-task-name"},
              "hub_token": "hf_secretsecret"}
    log = MetricsLog(tmp_path / "run", "safety-test", config)
    log.log(1, {"loss": 0.5})
    log.close()
    assert files_containing(tmp_path / "run", "canary-task-name")  # the config did reach wandb's files
    assert files_containing(tmp_path / "run", FAKE_WANDB_KEY) == []
    assert files_containing(tmp_path / "run", "hf_secretsecret") == []


def test_a_wandb_run_writes_the_api_key_nowhere(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=5)
    run_dir = tmp_path / "run"
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model, run_dir, "trainer.wandb=true"))
    try:
        metrics = lab.run(1)
        lab.save()
        shown = [repr(lab), repr(metrics), lab.show().to_html()]  # what a notebook's outputs would hold
    finally:
        lab.shutdown()
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))  # wandb wrote inside the run directory
    assert (run_dir / "spans.jsonl").is_file() and (run_dir / "checkpoints" / "latest").is_file()
    assert files_containing(run_dir, FAKE_WANDB_KEY) == []
    assert not any(FAKE_WANDB_KEY in text for text in shown)
