"""The benchmarks' command line: each bench's quick configuration runs end to end and prints a consistent report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridflow_lab.bench.e2e import NATURAL_LENGTHS, compile_settings
from tests.test_cli import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.ray
def test_init_model_and_quick_rollout_and_train_benches(tmp_path):
    made = json.loads(run_cli("init-model", str(tmp_path / "m"), "--size", "tiny", "--arch", "llama"))
    assert made["parameters"] > 0 and (tmp_path / "m" / "model.safetensors").is_file()
    rollout = json.loads(run_cli("bench", "rollout", "--quick"))
    assert set(rollout) >= {"model", "prompts", "new_tokens", "engines", "hf_over_torch_seconds"}
    assert rollout["engines"]["torch"]["tok_s"] > 0 and rollout["engines"]["hf"]["tok_s"] > 0
    assert rollout["engines"]["torch_compiled"]["tok_s"] > 0 and rollout["hf_over_torch_compiled_seconds"] > 0
    assert "--quick" in rollout["engines"]["vllm"]["skipped"]  # tests/test_vllm.py measures vLLM's row
    positions = rollout["prompts"] * rollout["new_tokens"]
    assert rollout["engines"]["torch_onednn"]["tok_s"] > 0 and rollout["hf_over_torch_onednn_seconds"] > 0
    for name in ("torch", "hf", "torch_compiled", "torch_onednn"):  # each one's seconds over its linear layers
        seconds = positions / rollout["engines"][name]["tok_s"]
        assert rollout[f"{name}_over_linear_floor"] == pytest.approx(seconds / rollout["linear_floor_s"], rel=0.05)
    train = json.loads(run_cli("bench", "train", "--quick"))
    assert [(r["engine"], r["zero_stage"]) for r in train["results"]] == [("deepspeed", 3)]
    assert all(r["tokens_per_s"] > 0 for r in train["results"])


@pytest.mark.ray
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


@pytest.mark.ray
def test_bench_algorithms_runs_each_algorithm_from_the_same_warm_start():
    report = json.loads(run_cli("bench", "algorithms", "--quick"))
    assert report["steps"] == 2 and set(report["runs"]) == {"gspo"}
    assert report["sft_final_loss"] <= 0.35 and 0.0 <= report["accuracy_before_rl"] <= 1.0
    for name, run in report["runs"].items():
        assert len(run["score_per_step"]) == 2 and run["accuracy_every_50_steps"] == {}
        assert run["gain_points"] == pytest.approx(100 * (run["accuracy_after_rl"] - report["accuracy_before_rl"]),
                                                   abs=0.051), name
    assert report["runs"]["gspo"]["overrides"] == ["algorithm.policy_loss=gspo"]


# Stands in for benchmarks/trl_grpo.py in a --peer virtualenv: keeps its pausing protocol and reports measured step
# i as taking i + 1 seconds, so the report shows which of TRL's steps each figure was taken over.
FAKE_TRL = """
import argparse, json, sys
parser = argparse.ArgumentParser()
for option in ("--workload", "--steps", "--warmup", "--pause-every", "--forced-lengths", "--model"):
    parser.add_argument(option)
parser.add_argument("--torch-compile", action="store_true")
args = parser.parse_args(sys.argv[2:])
steps, warmup, every = int(args.steps), int(args.warmup), int(args.pause_every)
for step in range(warmup + steps):
    if step == 0 or (step >= warmup + every and (step - warmup) % every == 0):
        print(json.dumps({"paused": step}), flush=True)
        sys.stdin.readline()
print(json.dumps({"bench": "trl_grpo", "step_s": [i + 1.0 for i in range(steps)], "step_tokens": [5120] * steps,
                  "torch_compile": args.torch_compile, "model": args.model}))
"""


def test_e2e_bf16_workload_compiles_its_layers_and_decodes_with_the_compiled_step():
    decode, report = compile_settings("deepspeed", None, bf16=True)
    assert decode == ("rollout.decoding=compiled", "actor.engine.torch_compile=true")
    assert report == {"decode_step": "compiled (the oneDNN step runs float32 only)", "layers": "compiled"}


def test_e2e_on_the_transformers_path_runs_eagerly_and_says_why():
    assert compile_settings("deepspeed", None, bf16=False, impl="transformers") == ((), {
        "decode_step": "eager: the transformers path runs the family's own code",
        "layers": "eager: the transformers path runs the family's own code"})


@pytest.mark.ray
def test_bench_e2e_counts_the_real_tokens_of_the_natural_workload_and_reports_the_peer_alternating_then_alone(
        tmp_path):
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{FAKE_TRL}' \"$@\"\n")
    python.chmod(0o755)
    report = json.loads(run_cli("bench", "e2e", "--quick", "--workload", "natural", "--engine", "torch",
                                "--peer", str(tmp_path)))
    assert report["workload"] == "natural" and report["engine"] == "torch" and report["precision"] == "float32"
    assert (report["decode_step"], report["layers"]) == ("onednn", "compiled")
    assert report["tokens_counted"] == "real prompt + response tokens"
    prompt_tokens = report["tokens_per_step"] / 64 - sum(NATURAL_LENGTHS) / len(NATURAL_LENGTHS)
    assert 4 <= prompt_tokens <= 8  # 'a+b=' with a, b < 1000, no padding counted
    forward = 2 * (3_936_512 * report["tokens_per_step"] + 100 * 256 * 64 * 45.125)  # layers, and the 100-token head
    assert report["step_gflop"] == pytest.approx(5 * forward / 1e9, abs=0.1)  # at each response token
    assert set(report["stage_flop_fraction"]) == {"generate", "ref", "update_actor"}
    for stage, fraction in report["stage_flop_fraction"].items():  # a stage's FLOPs over its seconds and the rate
        stage_gflop = forward / 1e9 * {"generate": 1, "ref": 1, "update_actor": 3}[stage]
        expected = stage_gflop / report["stage_s_median"][stage] / report["matmul_gflops"]
        assert fraction == pytest.approx(expected, rel=0.02, abs=2e-3)
    assert report["peer"]["torch_compile"]  # TRL's trainer compiles where ours do
    assert report["peer"]["model"].endswith("model-qwen2") and report["arch"] == "qwen2"  # the same model
    # TRL's measured steps: one after our block, then one alone, after our step alone and our Lab's shutdown
    assert report["peer"]["step_s"] == [1.0, 2.0]
    assert (report["peer_step_s"], report["peer_alone_step_s"]) == (1.0, 2.0)
    assert report["ratio_vs_peer"] == pytest.approx(report["tokens_per_s_median"] / 5120, abs=1e-3)
    assert report["alone_tok_s"] > 0 and report["alone_step_s"] > 0
    assert report["ratio_vs_peer_alone"] == pytest.approx(report["alone_tok_s"] / 2560, abs=1e-3)


def test_bench_e2e_names_a_missing_peer_environment_and_refuses_a_workload_outside_e2e(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "bench", "e2e", "--quick", "--peer",
                              str(tmp_path / "no-venv")], capture_output=True, text=True, timeout=600)
    assert missing.returncode != 0 and "make trl-env" in missing.stderr
    wrong = subprocess.run([sys.executable, "-m", "hybridflow_lab.cli", "bench", "rollout", "--workload", "natural"],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "--workload is for the e2e bench only" in wrong.stderr


def test_bench_dashboard_compares_steps_with_and_without_a_live_dashboard():
    report = json.loads(run_cli("bench", "dashboard", "--quick"))
    assert report["steps_each"] == 1 and report["redraws"] >= 1 and report["redraw_s_total"] > 0
    assert report["overhead_fraction"] == pytest.approx(
        report["step_s_median_with"] / report["step_s_median_without"] - 1, abs=2e-3)


@pytest.mark.ray
def test_bench_reshard_reports_bytes_equal_to_table_2():
    report = json.loads(run_cli("bench", "reshard", "--quick"))  # two stages of TP 1 (t1 p2) -> one TP-1 model
    rows = report["results"]
    assert [(row["t"], row["p"], row["tg"], row["strategy"]) for row in rows] == \
        [(1, 2, 1, strategy) for strategy in ("hybridflow", "hybridflow_v", "ds_chat")]
    for row in rows:
        assert row["bytes_per_rank"] == row["formula_bytes_per_rank"] > 0, row  # the mean over the ranks
        assert row["bytes_per_rank_max"] >= row["bytes_per_rank"], row
        # each rank receives the other stage's norms: half of them on average
        assert row["replicated_bytes_per_rank"] == report["replicated_param_bytes"] / 2, row
        if row["strategy"] == "hybridflow":  # tg = 1: the full model, nothing twice
            assert row["redundant_param_bytes"] == 0 and row["peak_param_bytes_per_rank"] == report["model_param_bytes"]
        else:
            assert row["redundant_param_bytes"] > 0, row
    goal, = report["goal"]
    assert (goal["t"], goal["p"], goal["tg"], goal["bytes_equal_formula"], goal["hybridflow_redundant_param_bytes"]) \
        == (1, 2, 1, True, 0)


@pytest.mark.ray
def test_bench_placement_calibrates_then_compares_predicted_and_measured_steps():
    report = json.loads(run_cli("bench", "placement", "--quick"))
    profile = report["profile"]
    assert profile["name"] == "cpu-calibrated" and profile["cores"] == os.cpu_count()
    assert profile["flops"] > 1e8 and profile["train_efficiency"] > 0 and profile["collective_latency_s"] > 0
    assert [(row["setting"], row["t"], row["p"]) for row in report["results"]] == [("d1", 1, 1), ("p2 d1", 1, 2)]
    for row in report["results"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1, abs=2e-3)
        assert set(row["predicted_stage_s"]) == set(row["measured_stage_s"]) == {"generation", "preparation",
                                                                                 "training"}
    # rankings: test_placement_search
    assert sorted(report["ranking_predicted"]) == sorted(report["ranking_measured"]) == ["d1", "p2 d1"]
    calibration, pipeline = report["results"]
    assert calibration["calibration"] and not pipeline["calibration"]
    assert report["max_abs_error_held_out"] == abs(pipeline["error"])  # the pipeline is predicted, not fitted
    assert len(calibration["measured_rounds_s"]) == report["rounds"] == 1
    # the profile comes from d1's own steps, so the simulator must give back d1's step
    assert abs(calibration["error"]) < 0.1
    split, = report["ppo_layouts"]  # PPO with the critic on a pool of its own, sequential and overlapped
    assert split["layout"] == "split" and split["placement"] == "main: 1, critic: 1"
    assert split["speedup"] == pytest.approx(split["sequential_s"] / split["overlapped_s"], abs=2e-3)
    assert split["predicted_s"] < split["predicted_sequential_s"]  # overlapped sets take the slower one's time
    assert report["overlap_goal_met"] == (split["speedup"] >= report["overlap_goal"])


@pytest.mark.ray
def test_bench_async_compares_generation_ahead_with_the_synchronous_loop_and_draws_staleness_curves():
    report = json.loads(run_cli("bench", "async", "--quick"))
    assert report["sync_tok_s"] > 0 and report["async_tok_s"] > 0
    assert report["ratio"] == pytest.approx(report["async_tok_s"] / report["sync_tok_s"], abs=2e-3)
    assert report["staleness"] == {"sync": [0.0], "async": [1.0]}  # the measured step trained one version behind
    runs = report["curves"]["runs"]
    assert set(runs) == {"1"} and runs["1"]["staleness_mean"] == 0.5  # steps 0 and 1 trained 0 and 1 versions behind
    assert all(list(run["accuracy"]) == ["0", "1", "2"] for run in runs.values())  # before RL, after each step


@pytest.mark.ray
def test_bench_soak_reports_memory_and_telemetry_after_checkpointed_steps():
    report = json.loads(run_cli("bench", "soak", "--quick"))
    assert report["steps"] >= 1 and report["checkpoints_kept"]  # it checkpointed every step, keeping 2
    assert len(report["checkpoints_kept"]) <= 2
    assert report["controller_rss_mb_start"] > 0 and report["controller_rss_mb_end"] > 0
    assert len(report["worker_rss_mb_end"]) == len(report["rss_mb_after_release"]["workers"]) == report["ranks"] == 1
    assert report["rss_mb_after_release"]["workers"][0] <= report["worker_rss_mb_end"][0]
    assert len(report["python_objects"]["start"]) == len(report["python_objects"]["end"]) == 2  # controller, rank
    assert report["telemetry_bytes"] > 0 and report["telemetry_spans_in_memory"] > 0
    assert set(report) >= {"minutes", "steps", "controller_rss_mb_start", "controller_rss_mb_end",
                           "worker_rss_mb_growth_per_100_steps", "telemetry_bytes"}
