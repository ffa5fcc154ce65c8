"""``hybridflow-lab jupyter`` (``make lab``): JupyterLab on loopback, opened on the tutorials, behind a token.

The server's root is the repository, so the tutorials' links and figures (``../docs/...``) resolve; the URL printed
opens the ``tutorials/`` folder. The server is refused if it answers without the token (a Jupyter config that
disables it), and no browser is opened.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"


def first_free_port(start: int, tries: int = 50) -> int:
    """The first port from ``start`` that nothing listens on at 127.0.0.1."""
    for port in range(start, start + tries):
        with socket.socket() as probe:
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise SystemExit(f"ports {start}-{start + tries - 1} are all in use on {LOOPBACK}: pass another --port")


def answers(url: str) -> int | None:
    """The HTTP status ``url`` answers with, or None while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def wait_until_serving(base: str, token: str, server: subprocess.Popen, timeout_s: float) -> None:
    """Wait for the server's API; stop it if it serves without the token."""
    deadline = time.monotonic() + timeout_s
    while answers(f"{base}/api/status?token={token}") != 200:
        if server.poll() is not None:
            raise SystemExit(f"JupyterLab exited with status {server.returncode} before it served {base}")
        if time.monotonic() > deadline:
            server.terminate()
            raise SystemExit(f"JupyterLab did not answer at {base} within {timeout_s:.0f} s")
        time.sleep(0.3)
    if answers(f"{base}/api/status") == 200:
        server.terminate()
        raise SystemExit("JupyterLab answered without its token: a Jupyter config (jupyter --paths) sets "
                         "IdentityProvider.token or a password; remove it, `make lab` serves only with a token")


def serve(root: Path, port: int, timeout_s: float = 120.0) -> int:
    """Run JupyterLab on ``root`` until it stops; returns its exit status."""
    tutorials = root / "tutorials"
    if not tutorials.is_dir():
        raise SystemExit(f"no tutorials/ under {root}: run `make lab` from the repository's root, or pass --root")
    port = first_free_port(port)
    token = secrets.token_hex(24)
    base = f"http://{LOOPBACK}:{port}"
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.ip={LOOPBACK}",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}"]
    if os.geteuid() == 0:  # a container's only user; JupyterLab refuses root unless told
        command.append("--allow-root")
    # the token goes in the environment, which only this user can read, not on the command line
    server = subprocess.Popen(command, env={**os.environ, "JUPYTER_TOKEN": token})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the server on the way out
    try:
        wait_until_serving(base, token, server, timeout_s)
        print(f"\nJupyterLab serves {root} on {LOOPBACK} only. Open the tutorials (start with 01):\n\n"
              f"    {base}/lab/tree/tutorials?token={token}\n\nCtrl-C stops it.\n", flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)
