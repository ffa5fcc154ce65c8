"""``bench e2e --peer``: the peer runs only between our blocks of steps, and a failing peer says why."""

import sys

import pytest

from hybridflow_lab.bench.peer import peer_command, peer_figures, started_peer

# Speaks trl_grpo.py's protocol: pauses before its first step and after each block, then prints its report. Each
# block appends "peer" to a log file, so the log shows when the peer ran.
PEER = """
import json, sys
log, blocks = sys.argv[1], int(sys.argv[2])
def pause(done):
    print("a line that is not JSON", flush=True)
    print(json.dumps({"paused": done}), flush=True)
    sys.stdin.readline()
pause(0)
for block in range(blocks):
    with open(log, "a") as f:
        f.write("peer\\n")
    if block < blocks - 1:
        pause(block + 1)
print(json.dumps({"bench": "trl_grpo", "tokens_per_s_median": 1.0}))
"""


def test_the_peer_runs_only_between_our_blocks_and_reports_after_its_last(tmp_path):
    log = tmp_path / "log"
    log.touch()
    with started_peer([sys.executable, "-c", PEER, str(log), "3"]) as peer:
        assert log.read_text() == ""  # set up and paused: it waits for us
        reports = []
        for _ in range(3):
            with log.open("a") as f:
                f.write("ours\n")
            reports.append(peer.next_block())
    assert log.read_text().split() == ["ours", "peer"] * 3
    assert reports[:2] == [None, None] and reports[2] == {"bench": "trl_grpo", "tokens_per_s_median": 1.0}


def test_the_peer_runs_its_remaining_blocks_to_its_report(tmp_path):
    log = tmp_path / "log"
    with started_peer([sys.executable, "-c", PEER, str(log), "3"]) as peer:
        assert peer.next_block() is None
        assert peer.run_to_end() == {"bench": "trl_grpo", "tokens_per_s_median": 1.0}
    assert log.read_text().split() == ["peer"] * 3


def test_peer_figures_are_the_medians_over_the_steps_asked_for():
    report = {"step_s": [1.0, 2.0, 4.0, 0.5, 0.5], "step_tokens": [100, 100, 100, 100, 200]}
    assert peer_figures(report, slice(0, 3)) == (50.0, 2.0)  # 100, 50, 25 tokens/s
    assert peer_figures(report, slice(-2, None)) == (300.0, 0.5)  # 200 and 400 tokens/s


def test_a_failing_peer_names_its_exit_code_and_shows_its_stderr():
    crash = "import sys; sys.stderr.write('no module named trl'); sys.exit(3)"
    with (pytest.raises(RuntimeError, match=r"the TRL peer failed \(exit 3.*\n.*no module named trl"),
          started_peer([sys.executable, "-c", crash])):
        pass


def test_a_peer_that_never_pauses_is_refused():
    report = 'import json; print(json.dumps({"bench": "trl_grpo"}))'
    with pytest.raises(RuntimeError, match="finished without pausing"), started_peer([sys.executable, "-c", report]):
        pass


def test_the_peer_command_pauses_after_each_block_and_passes_the_natural_lengths(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    command = peer_command(str(tmp_path), "natural", steps=8, warmup=2, block=2, forced_lengths=(2, 3),
                           torch_compile=True)
    assert command[0] == str(tmp_path / "bin" / "python") and command[1].endswith("benchmarks/trl_grpo.py")
    assert command[-1] == "--torch-compile"
    options = dict(zip(command[2:-1:2], command[3:-1:2], strict=True))
    assert options == {"--workload": "natural", "--steps": "8", "--warmup": "2", "--pause-every": "2",
                       "--forced-lengths": "2,3"}
    assert "--torch-compile" not in peer_command(str(tmp_path), "standard", steps=8, warmup=2, block=2)
