"""TRL's ``GRPOTrainer`` as ``bench e2e``'s peer: ``benchmarks/trl_grpo.py`` in its own virtualenv, run in blocks
of steps that alternate with ours, so that a slow minute on this machine hits both sides alike.

The script pauses before its first step, after its warmup and after every block of measured steps
(``--pause-every``); ``PeerRun.next_block`` lets it run to its next pause, and returns its report after the last.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

PEER_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trl_grpo.py"


def peer_command(venv: str, workload: str, steps: int, warmup: int, block: int,
                 forced_lengths: Sequence[int] = (), torch_compile: bool = False) -> list[str]:
    """The command that runs ``benchmarks/trl_grpo.py`` on ``workload`` from the virtualenv ``venv``, pausing after
    its warmup and every ``block`` measured steps; ``torch_compile``: with the trainer's ``torch_compile``."""
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"hybridflow-lab bench e2e: error: --peer {venv} has no bin/python; `make trl-env` "
                         "creates .venv-trl with TRL")
    if not PEER_SCRIPT.is_file():
        raise SystemExit(f"hybridflow-lab bench e2e: error: no {PEER_SCRIPT}; --peer runs from a source checkout")
    command = [str(python), str(PEER_SCRIPT), "--workload", workload, "--steps", str(steps), "--warmup", str(warmup),
               "--pause-every", str(block)]
    return command + (["--forced-lengths", ",".join(map(str, forced_lengths))] if forced_lengths else []) + \
        (["--torch-compile"] if torch_compile else [])


@contextlib.contextmanager
def started_peer(command: list[str]) -> Iterator[PeerRun]:
    """The peer ``command`` started, set up and paused before its first step; stopped on exit if still running."""
    with tempfile.TemporaryFile("w+") as stderr, subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True) as process:
        try:
            peer = PeerRun(command, process, stderr)
            if peer.until_pause_or_report() is not None:
                raise RuntimeError(f"the TRL peer finished without pausing ({' '.join(command)})")
            yield peer
        finally:
            if process.poll() is None:
                process.kill()


class PeerRun:
    """A running peer, between two blocks of its steps."""

    def __init__(self, command: list[str], process: subprocess.Popen[str], stderr: IO[str]) -> None:
        self.command, self._process, self._stderr = command, process, stderr

    def next_block(self) -> dict[str, Any] | None:
        """Let the peer run to its next pause; after its last block, its JSON report."""
        assert self._process.stdin is not None
        self._process.stdin.write("\n")
        self._process.stdin.flush()
        return self.until_pause_or_report()

    def run_to_end(self) -> dict[str, Any]:
        """Let the peer run all its remaining blocks; its JSON report."""
        while (report := self.next_block()) is None:
            pass
        return report

    def until_pause_or_report(self) -> dict[str, Any] | None:
        """Read the peer's output to its next pause (None) or its final report; its stderr if it fails."""
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = _json_object(line)
            if message and "paused" in message:
                return None
            if message and message.get("bench") == "trl_grpo":
                self._process.wait()
                return message
        self._process.wait()
        self._stderr.seek(0)
        raise RuntimeError(f"the TRL peer failed (exit {self._process.returncode}; {' '.join(self.command)}):\n"
                           f"{self._stderr.read()[-3000:]}")


def peer_figures(report: dict[str, Any], steps: slice) -> tuple[float, float]:
    """The peer's median tokens/s and median step seconds over the measured ``steps`` of its ``report``."""
    times, tokens = report["step_s"][steps], report["step_tokens"][steps]
    rates = [n / t for n, t in zip(tokens, times, strict=True)]
    return round(statistics.median(rates), 1), round(statistics.median(times), 3)


def _json_object(line: str) -> dict[str, Any] | None:
    try:
        message = json.loads(line)
    except json.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None
