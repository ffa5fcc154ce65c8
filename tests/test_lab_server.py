"""``hybridflow-lab jupyter`` (``make lab``): a busy port is skipped, and a server without its token is refused
(tests/test_first_look.py opens the served tutorials in a browser)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from hybridflow_lab.lab_server import LOOPBACK, first_free_port
from tests.browser import free_port


def test_a_port_something_listens_on_is_skipped():
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert first_free_port(port) > port


def test_a_jupyter_config_that_turns_the_token_off_stops_the_server_with_the_reason(tmp_path):
    (tmp_path / "jupyter_server_config.json").write_text(json.dumps({"IdentityProvider": {"token": ""}}))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    done = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "jupyter", "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "JupyterLab answered without its token" in done.stderr and "token=" not in done.stdout
