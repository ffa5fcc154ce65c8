"""The Lab: stages cell by cell, every algorithm's dataflow, metrics, checkpoints and exact resume."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hybridflow_lab.config import ConfigError
from hybridflow_lab.dataflows import ALGORITHMS, register_algorithm
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.onednn_decode import missing_onednn
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.ui.figures import recent_steps, timeline

MODEL_SEED = 11  # conftest's model_dir builds this module's tiny model with it


def local_overrides(model_dir, run_dir, *extra):
    return ("backend=local", f"actor.model_path={model_dir}", "actor.ranks=1", "critic.ranks=1",
            "actor.engine.backend=torch", "critic.engine.backend=torch", "actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3", f"trainer.run_dir={run_dir}", "trainer.progress=false",
            "batch.rollout_batch_prompts=4", "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=8",
            "batch.micro_batch_sequences_per_rank=4", "task.eval_size=8", "rollout.max_new_tokens=5", *extra)


@dataclass
class CellByCell:
    """A GRPO iteration run one stage at a time, as notebook cells do, with what each stage returned."""

    lab: Lab
    prompts: DataBatch
    generated: DataBatch
    scored: DataBatch  # after reward, old_log_prob and ref_log_prob
    advantaged: DataBatch
    metrics: Any


@pytest.fixture(scope="module")
def cell_by_cell(model_dir, tmp_path_factory):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path_factory.mktemp("cells") / "run",
                                                          "algorithm.kl_loss_coef=0.1"))
    prompts = lab.next_prompts()
    generated = lab.generate(prompts)
    scored = lab.ref_log_prob(lab.old_log_prob(lab.reward(generated)))
    advantaged = lab.advantages(scored)
    yield CellByCell(lab, prompts, generated, scored, advantaged, lab.update_actor(advantaged))
    lab.shutdown()


CELLS = pytest.mark.xdist_group("cell_by_cell")  # one iteration for these tests


@CELLS
def test_next_prompts_draws_a_batch_of_prompts_each_with_its_group_id(cell_by_cell):
    assert len(cell_by_cell.prompts) == 4 and cell_by_cell.prompts["uid"].tolist() == [0, 1, 2, 3]


@CELLS
def test_generate_returns_the_samples_of_each_prompt_together(cell_by_cell):
    batch = cell_by_cell.generated
    assert len(batch) == 16 and batch["uid"].tolist()[:4] == [0, 0, 0, 0]


@CELLS
def test_a_stages_output_carries_the_summary_a_notebook_shows(cell_by_cell):
    batch = cell_by_cell.generated
    summary = batch.summary
    assert summary.stage == "generate" and summary.rows == 16 and summary.seconds > 0
    assert summary.tokens == int(batch["attention_mask"].sum()) and summary.bytes_moved > 0
    assert list(summary.worker_calls.values()) == [[0]] and len(summary.samples) == 3
    assert summary.headline() in batch._repr_html_()


@CELLS
def test_the_reference_of_a_policy_not_yet_updated_gives_the_policys_own_log_probs(cell_by_cell):
    batch = cell_by_cell.scored
    assert {"scores", "token_level_scores", "old_log_probs", "entropy", "ref_log_probs"} <= set(batch.keys())
    torch.testing.assert_close(batch["ref_log_probs"], batch["old_log_probs"], rtol=1e-5, atol=1e-5)


@CELLS
def test_grpo_advantages_sum_to_zero_within_each_group(cell_by_cell):
    per_group = cell_by_cell.advantaged["advantages"][:, 0].view(4, 4)
    assert torch.allclose(per_group.sum(-1), torch.zeros(4), atol=1e-4)


@CELLS
def test_update_actor_returns_its_metrics_shown_with_the_stages_summary(cell_by_cell):
    metrics = cell_by_cell.metrics
    assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/kl"} <= metrics.keys()
    assert metrics.summary.stage == "update_actor" and "update_actor (step 0)" in metrics._repr_html_()


@CELLS
def test_show_tables_the_prompts_as_the_model_read_them(cell_by_cell):
    batch = cell_by_cell.advantaged
    frame = cell_by_cell.lab.show(batch, rows=3)
    assert list(frame.columns) == ["prompt", "response", "ground_truth", "score", "advantage"] and len(frame) == 3
    assert frame["prompt"].tolist() == list(batch["prompt_text"][:3])


@CELLS
def test_every_span_of_the_stages_worker_ones_included_knows_its_stage_and_step(cell_by_cell):
    spans = cell_by_cell.lab.telemetry.spans()
    stages = {s.name for s in spans if s.phase.value == "stage"}
    assert {"next_prompts", "generate", "reward", "old_log_prob", "ref", "adv", "update_actor"} <= stages
    assert {s.step for s in spans} == {0}


@pytest.mark.parametrize(("minibatch", "needs_pass"), [(16, False), (8, True)])
def test_old_log_prob_pass_runs_only_when_a_batch_gets_several_optimizer_steps(model_dir, tmp_path, minibatch,
                                                                                needs_pass):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.kl_loss_coef=0.1",
                                                          f"batch.update_minibatch_sequences={minibatch}"))
    metrics = lab.step()
    assert lab.needs.old_log_probs is needs_pass and ("timing_s/old_log_prob" in metrics) is needs_pass
    assert {"actor/kl", "actor/entropy", "actor/pg_clipfrac"} <= metrics.keys()
    lab.shutdown()


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_a_step(model_dir, tmp_path, algorithm):
    extra = ["task.cost=digit_cost"] if algorithm == "safe_rlhf" else []
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", f"algorithm.name={algorithm}",
                                                          *extra))
    metrics = lab.step()
    for key in ("timing_s/generate", "timing_s/update_actor", "timing_s/step", "perf/throughput",
                "response_length/mean", "critic/score/mean", "critic/advantages/mean", "actor/pg_loss",
                "actor/entropy"):
        assert key in metrics, key
    if algorithm == "ppo":
        assert {"critic/vf_loss", "critic/values/mean", "timing_s/update_critic"} <= metrics.keys()
    if algorithm == "safe_rlhf":
        assert "safe/lagrange_multiplier" in metrics and "critic/cost/mean" in metrics
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 1 and logged[-1]["critic/score/mean"] == metrics["critic/score/mean"]
    lab.shutdown()


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_the_local_backend_trains_with_the_sharded_engines(model_dir, tmp_path, engine):
    overrides = [o for o in local_overrides(model_dir, tmp_path / "run") if not o.startswith("actor.engine")]
    lab = Lab("arithmetic_grpo", overrides=(*overrides, f"actor.engine.backend={engine}"))  # in this process
    try:
        batch = lab.reward(lab.generate(lab.next_prompts()))
        signs = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None]
        batch["advantages"] = signs * batch["response_mask"]  # a random policy scores 0: make the gradient non-zero
        assert lab.update_actor(batch)["actor/grad_norm"] > 0
    finally:
        lab.shutdown()


def assert_resume_takes_the_same_next_step(overrides: tuple[str, ...]) -> None:
    """A run saved at step 2 and resumed takes the step the straight run took after the save."""
    straight = Lab("arithmetic_grpo", overrides=overrides)
    straight.run(2)
    straight.save()
    expected = straight.step()
    straight.shutdown()
    resumed = Lab("arithmetic_grpo", overrides=overrides, resume=True)
    try:
        assert resumed.step_index == 2
        again = resumed.step()
    finally:
        resumed.shutdown()
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
        assert again[key] == pytest.approx(expected[key], rel=1e-6), key


def test_resume_reproduces_the_next_step_exactly(model_dir, tmp_path):
    assert_resume_takes_the_same_next_step(local_overrides(model_dir, tmp_path / "a"))
    steps = [json.loads(line)["step"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the replayed step replaced the first run's line


def test_sorting_task_takes_its_length_from_the_config(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "task.name=sorting",
                                                          "task.length=6", "rollout.max_prompt_tokens=12"))
    prompts = lab.next_prompts()
    assert all(len(text) == len("sort:") + 6 + 1 for text in prompts["prompt_text"])
    assert all(len(truth) == 6 for truth in prompts["ground_truth"])
    lab.shutdown()


def test_evaluate_reports_accuracy(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run"))
    result = lab.evaluate()
    assert set(result) == {"eval/accuracy", "eval/score", "eval/response_length"}
    assert 0.0 <= result["eval/accuracy"] <= 1.0 and 0 < result["eval/response_length"] <= 5
    assert len(lab.last_eval) == 8 and float(lab.last_eval["scores"].mean()) == pytest.approx(result["eval/score"])
    lab.shutdown()


BAD = [
    (["algorithm.name=a2c"], "algorithm.name", "'a2c' is not one of"),
    (["algorithm.loss_agg=token-sum"], "algorithm.loss_agg", "unknown loss aggregation mode"),
    (["algorithm.kl_loss_kind=k4"], "algorithm.kl_loss_kind", "k4"),
    (["algorithm.kl_coef=0.1"], "algorithm.kl_coef", "was split in two: set algorithm.kl_loss_coef"),
    (["algorithm.name=safe_rlhf"], "task.cost", "needs a cost signal"),
    (["task.name=chess"], "task.name", "unknown task 'chess'"),
    (["task.name=gsm8k"], "task.dataset_path", "needs a .jsonl or .parquet file"),
    (["task.digits=0"], "task.digits", "digits must be at least 1"),
    (["task.name=sorting", "task.length=0"], "task.length", "length must be at least 1"),
]


@pytest.mark.parametrize(("extra", "key", "message"), BAD)
def test_algorithm_and_task_settings_fail_before_start(model_dir, tmp_path, extra, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", *extra))
    assert info.value.key == key


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_with_the_hybrid_engine_and_ppo_on_two_ray_ranks(ray_cluster, model_dir, tmp_path):
    """GRPO trains with TP 2 and generates with TP 1 (the resharding shows on the timeline); PPO with ZeRO-2."""
    hybrid = ("actor.engine.backend=torch", "actor.engine.tensor_parallel=2", "rollout.tensor_parallel=1")
    for algorithm, extra in (("grpo", hybrid), ("ppo", ())):
        overrides = [o for o in local_overrides(model_dir, tmp_path / algorithm) if "ranks" not in o
                     and "backend" not in o]
        lab = Lab("arithmetic_grpo", overrides=(*overrides, f"algorithm.name={algorithm}", "actor.ranks=2",
                                                "critic.ranks=2", *extra))
        try:
            metrics = lab.run(2)[-1]
            assert lab.groups["actor"].world_size == 2 and "actor/grad_norm" in metrics
            if algorithm == "ppo":
                assert lab.groups["critic"].world_size == 2 and "critic/vf_loss" in metrics
            else:
                bars = {bar.name: bar for bar in timeline(recent_steps(lab.telemetry.spans(), 1)).data}
                reshard = bars["reshard_to_generation (transfer)"]  # (t - tg) / (tg t) of the 3.3 MB of TP weights
                assert sorted(reshard.y) == ["actor r0", "actor r1"] and set(reshard.text) == {"1.6 MB"}
        finally:
            lab.shutdown()


def test_a_dataflow_written_in_a_notebook_cell(model_dir, tmp_path):
    def old_first(lab, step):
        """Old log-probs always, then RLOO advantages and the update; a metric of its own."""
        batch = lab.reward(lab.generate(lab.next_prompts()))
        batch = lab.advantages(lab.old_log_prob(batch))
        lab.update_actor(batch)
        step.record({"custom/rows": len(batch)})
        return batch, step.metrics

    register_algorithm("my_rloo", old_first, "rloo", group_relative=True)
    try:
        lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.name=my_rloo"))
        metrics = lab.step()
        assert metrics["custom/rows"] == 16 and "timing_s/old_log_prob" in metrics and "actor/pg_loss" in metrics
        assert lab.needs.algorithm.dataflow is old_first and not lab.needs.critic
        lab.shutdown()
    finally:
        ALGORITHMS.pop("my_rloo")


def test_wandb_logs_offline_without_network(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a key must never reach the run directory
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "trainer.wandb=true"))
    lab.step()
    lab.shutdown()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    tables = list(runs[0].glob("files/media/table/samples_1_*.table.json"))  # the step's sample table
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "response", "ground_truth", "score", "advantage"]
    assert len(table["data"]) == 8 and [row[1] for row in table["data"]] == [r["prompt"] for r in lab.samples]
    leaked = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and b"x" * 40 in p.read_bytes()]
    assert not leaked


@pytest.mark.skipif(bool(missing_cpp_compiler()), reason=str(missing_cpp_compiler()))
@pytest.mark.parametrize("decoding", ["compiled", pytest.param(
    "onednn", marks=pytest.mark.skipif(bool(missing_onednn()), reason=str(missing_onednn())))])
def test_a_fast_decoding_step_generates_with_each_updates_weights_under_deepspeed(model_dir, tmp_path, decoding):
    """Each generation samples from the weights of the latest update: its log-probs are the trainer's, step after
    step (the oneDNN step packs the weights anew each time). And DeepSpeed's forward hook on the actor's module,
    which starts a timer (``time.time``, which dynamo cannot trace) from its third step on, stays out of the step."""
    changing = ("actor.engine.backend=deepspeed", "algorithm.entropy_coef=0.1")  # weights change even at zero reward
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", *changing,
                                                           f"rollout.decoding={decoding}"))
    for _ in range(3):
        metrics = lab.step()
        assert metrics["actor/rollout_mismatch_max"] < 1e-4
    assert metrics["response_length/mean"] > 0 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    lab.shutdown()
