"""The notebook UI: placement plans and board, the live dashboard, figures, run-file following, stage summaries."""

from __future__ import annotations

import re
import time

import pytest
import torch

from hybridflow_lab.config import ConfigError
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.placement import Placement, Suggestion
from hybridflow_lab.telemetry import Phase, Span
from hybridflow_lab.trainer.lab import Lab
from hybridflow_lab.trainer.run_log import MetricsLog
from hybridflow_lab.ui import compare_runs, dashboard, figures, placement_board
from hybridflow_lab.ui.run_files import JsonlTail, RunFiles
from tests.test_lab import local_overrides

MODEL_SEED = 11  # conftest's model_dir builds this module's tiny model with it


def ppo_config(model_dir, *extra):
    """The demo preset as PPO on Ray: update minibatch 64, micro-batch 32 per rank -> 1 or 2 ranks per role."""
    return resolve_config("arithmetic_grpo", (f"actor.model_path={model_dir}", "algorithm.name=ppo", "critic.ranks=2",
                                              "critic.engine.backend=torch", "actor.engine.backend=torch", *extra))


def control(board, description):
    """The board's widget with this description (a user's view of the board)."""
    return next(c for c in board.controls.children if getattr(c, "description", "") == description)


def test_a_plan_round_trips_through_config_overrides(model_dir):
    config = ppo_config(model_dir)
    plan = Placement.from_config(config)
    assert plan.pools == {"main": 2} and plan.assignment == {"actor": "main", "critic": "main"}
    assert plan.device_map() == [("main", ["actor", "critic"])] * 2
    split = plan.with_changes(pools={"main": 2, "critic": 1}, assignment={"actor": "main", "critic": "critic"})
    placed = split.apply(config)
    assert (placed.critic.pool, placed.critic.ranks, placed.actor.ranks) == ("critic", 1, 2)
    assert Placement.from_config(placed) == split
    assert split.devices_needed() == 3 and split.device_map()[2] == ("critic", ["critic"])


def test_only_valid_sizes_are_offered_and_invalid_plans_say_why(model_dir):
    config = ppo_config(model_dir)
    plan = Placement.from_config(config)
    # 64 sequences per optimizer step in micro-batches of 32 per rank: 1 or 2 ranks work, 3..8 do not
    assert plan.pool_size_choices(config, 8, "main") == [1, 2]
    assert plan.tensor_parallel_choices(config, 8) == [1]  # the built-in engine generates with TP 1
    too_many = plan.with_changes(pools={"main": 4})
    assert "micro_batch_sequences_per_rank" in too_many.problem(config, 8)
    assert "need 2 device slots" in plan.problem(config, 1)
    assert plan.problem(config, 2) is None
    with pytest.raises(ConfigError) as info:
        too_many.apply(config)
    assert info.value.key == "batch.micro_batch_sequences_per_rank"


def test_the_board_offers_valid_choices_and_applies_to_a_lab_before_start(model_dir, tmp_path):
    lab = Lab(ppo_config(model_dir, f"trainer.run_dir={tmp_path}"), start=False)
    board = placement_board(lab, devices=4)
    assert "model: qwen2 on the project decoder" in board.header.value  # the path print(lab) names
    sizes = control(board, "pool main slots")
    assert list(sizes.options) == [1, 2] and sizes.value == 2 and "valid: 2 of 4 slots" in board.status.value
    critic_row = board.controls.children[1]
    critic_row.children[1].value = "critic"  # the critic's pool menu: give it its own devices
    assert board.plan.assignment["critic"] == "critic" and "slot 3" in board.grid.value
    critic_sizes = control(board, "pool critic slots")
    critic_sizes.value = 1
    assert "valid: 3 of 4 slots" in board.status.value
    board.apply_button.click()
    assert (lab.config.critic.pool, lab.config.critic.ranks, lab.config.actor.ranks) == ("critic", 1, 2)
    assert board.applied[-1] == board.plan.overrides() and not lab.groups  # not started: nothing to restart
    board.set_plan(board.plan.with_changes(pools={"main": 2, "critic": 3}))
    assert board.apply_button.disabled and "cannot run" in board.status.value
    plan = Placement.from_config(lab.config).with_changes(pools={"main": 1, "critic": 1})
    board.show_suggestions([Suggestion("one slot each", plan, 1.5)])
    board.suggestions.children[0].click()
    assert board.plan == plan and board.suggestions.children[0].description == "1. one slot each (~1.50 s)"
    assert {trace.y[0] for trace in board.timing.figure.data} == {"predicted"}  # no step measured yet


def test_the_board_sets_the_predicted_stages_beside_the_last_measured_step(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run"))
    board = placement_board(lab, devices=1)
    lab.step()
    measured = {t.name: t for t in board.timing.figure.data if t.y[0] == "last step (measured)"}
    history = lab.history[-1]
    assert measured["generation (measured)"].x[0] == history["timing_s/generate"]
    assert measured["training (measured)"].x[0] == history["timing_s/update_actor"]
    ends = sum(t.x[0] for t in measured.values())
    assert ends == pytest.approx(history["timing_s/step"])  # the rest of the step is the controller's
    board.close()
    lab.shutdown()


def test_curves_draw_a_moving_average_mark_evaluations_and_say_why_a_panel_is_empty():
    history = [{"step": i + 1, "critic/score/mean": float(i % 2), "train/accuracy": 0.5} for i in range(12)]
    history[5]["eval/accuracy"] = 0.7
    figure = figures.curves(history)
    average = next(t for t in figure.data if t.name == "critic/score/mean (mean of 10)")
    assert list(average.y[:3]) == [0.0, 0.5, pytest.approx(1 / 3)]
    assert average.y[-1] == pytest.approx(sum(i % 2 for i in range(2, 12)) / 10)
    evaluations = next(t for t in figure.data if t.name == "eval/accuracy")
    assert evaluations.mode == "markers" and list(evaluations.x) == [6]
    notes = [a.text for a in figure.layout.annotations]
    assert "no critic in this algorithm" in notes and any(n.startswith("no KL term in this run") for n in notes)
    assert "no scores logged" not in notes and "no response lengths logged" in notes
    assert "no step has run yet" in [a.text for a in figures.curves([]).layout.annotations]


def test_runs_compared_list_their_config_differences_curves_and_stage_seconds(model_dir, tmp_path):
    for name, lr in (("a", "1e-3"), ("b", "5e-4")):
        lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / name, f"actor.optim.lr={lr}"))
        lab.run(2)
        lab.shutdown()
    comparison = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert list(comparison.differences.index) == ["actor.optim.lr"]
    assert comparison.differences.loc["actor.optim.lr"].tolist() == [1e-3, 5e-4]
    names = {trace.name for trace in comparison.curves.data}
    assert {"a: critic/score/mean", "b: critic/score/mean", "b: critic/score/mean (mean of 10)"} <= names
    bars = {trace.name: trace for trace in comparison.stage_times.data}
    assert set(bars) == {"a", "b"} and "update_actor" in bars["a"].x
    assert not comparison.refresh()  # nothing new since
    from hybridflow_lab.ui.served import compare_app

    app = compare_app([tmp_path / "a", tmp_path / "b"])
    frame = next(p for p in app.objects if type(p).__name__ == "DataFrame")
    assert list(frame.object.columns) == ["a", "b"]
    with pytest.raises(ValueError, match="two or more"):
        compare_runs([tmp_path / "a"])


def test_the_dashboard_follows_a_running_lab(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.name=ppo"))
    view = dashboard(lab, interval_s=0.05, steps_shown=1)
    assert [a.text for a in view.timeline.figure.layout.annotations] == [
        "no spans yet: a stage called in a cell, or lab.step(), records them"]  # not empty axes
    lab.run(2)
    deadline = time.monotonic() + 10
    while view._drawn_steps < 2 and time.monotonic() < deadline:  # the redraw thread catches up
        time.sleep(0.05)
    with view._lock:  # and finishes the redraw it is in
        pass
    rows = {row for trace in view.timeline.figure.data for row in trace.y}
    assert rows == {"controller", "actor r0", "critic r0"}
    assert not view.timeline.figure.layout.annotations and view.timeline.figure.layout.xaxis.visible is not False
    steps_drawn = {s.step for s in figures.recent_steps(view._spans, 1)}
    assert steps_drawn == {1}  # the last step only
    stacked = {trace.name: trace.y for trace in view.stage_times.figure.data}
    assert stacked["update_critic"] == tuple(m["timing_s/update_critic"] for m in lab.history)
    scores = next(t for t in view.curves.figure.data if t.name == "critic/score/mean")
    assert list(scores.x) == [1, 2] and list(scores.y) == [m["critic/score/mean"] for m in lab.history]
    assert view.sample_step.options == (2, 1) and view.sample_step.value == 2
    assert lab.samples[-1]["prompt"] in view.samples.value
    view.sample_step.value = 1  # browsing an older step
    assert next(r for r in lab.samples if r["step"] == 1)["response"] in view.samples.value
    assert view.refreshes >= 2 and view.refresh_seconds > 0
    assert "data-stage='update_critic'" in view.graph.value and "step 2" in view.graph.value
    view.graph_stage.value = "values"  # selecting a stage shows what it did
    assert "critic.compute_values on ranks [0]" in view.graph_detail.value
    assert "<td>values</td>" in view.graph_detail.value and "stroke='#d62728'" in view.graph.value
    replaced = dashboard(lab)  # a second dashboard replaces (and stops) the first
    refreshes = view.refreshes
    lab.step()
    time.sleep(0.3)
    assert view.refreshes == refreshes and replaced.refreshes >= 1
    replaced.close()
    lab.shutdown()


def span(name, phase, start, end, step, group="", rank=-1, moved=0):
    return Span(name, phase, start, end, group=group, rank=rank, step=step, bytes_moved=moved)


def test_the_timeline_marks_transfers_with_their_bytes_and_keeps_the_newest_run():
    spans = [span("generate", Phase.STAGE, 0, 1, 0),
             span("generate_sequences", Phase.EXECUTE, 0.1, 0.9, 0, "l.actor", 1),
             span("reshard", Phase.TRANSFER, 1.0, 1.2, 0, "l.actor", 1, moved=3 << 20),
             span("dispatch", Phase.DISPATCH, 0, 0.1, 0)]
    figure = figures.timeline(figures.recent_steps(spans, 3))
    by_name = {trace.name: trace for trace in figure.data}
    assert set(by_name) == {"generate", "generate_sequences", "reshard (transfer)"}  # dispatch is not drawn
    assert by_name["reshard (transfer)"].text == ("3.0 MB",) and by_name["generate_sequences"].y == ("actor r1",)
    assert by_name["generate_sequences"].base == (pytest.approx(0.1),)
    rerun = [span("generate", Phase.STAGE, 100 + s, 101 + s, s) for s in range(3)]  # a new run reuses step numbers
    assert [s.t_start for s in figures.recent_steps(spans + rerun, 2)] == [101, 102]


def test_the_timeline_of_a_step_keeps_it_whole_when_the_next_steps_responses_are_generated_during_it():
    spans = [span("generate", Phase.STAGE, 0.0, 0.5, 1),  # step 1's responses, generated while step 0 trains
             span("update_actor", Phase.STAGE, 0.2, 0.8, 0),
             span("sync_weights", Phase.STAGE, 0.85, 1.03, 0),  # step 0's update reaching the rollout group ...
             span("ref", Phase.STAGE, 1.0, 1.1, 1),
             span("load_policy", Phase.EXECUTE, 1.01, 1.03, 0, "l.rollout", 0),  # ... while step 1 starts
             span("generate", Phase.STAGE, 1.05, 1.5, 2),  # step 2's responses, generated while step 1 trains
             span("update_actor", Phase.STAGE, 1.2, 1.9, 1)]
    assert [s.t_start for s in figures.recent_steps(spans, 1)] == [1.0, 1.01, 1.05, 1.2]
    assert [s.t_start for s in figures.recent_steps(spans, 2)] == [0.0, 0.2, 0.85, 1.0, 1.01, 1.05, 1.2]


def test_following_run_files_skips_torn_lines_and_restarts_when_a_run_rewrites_them(tmp_path):
    log = MetricsLog(tmp_path)
    tail = JsonlTail(log.path)
    assert tail.read() == ([], False)  # no file yet
    log.log(1, {"score": 0.5})
    with log.path.open("a") as handle:
        handle.write('{"step": 2, "sco')  # a writer caught mid-line
    assert tail.read() == ([{"step": 1, "score": 0.5}], False)
    with log.path.open("a") as handle:
        handle.write('re": 0.7}\n')
    assert tail.read() == ([{"step": 2, "score": 0.7}], False)
    log.truncate_after(0)  # a fresh run in the same directory, which then writes a longer first line
    log.log(1, {"score": 0.25, "accuracy": 0.125, "kl": 0.0})
    assert tail.read() == ([{"step": 1, "score": 0.25, "accuracy": 0.125, "kl": 0.0}], True)


def test_run_files_and_the_served_app_read_what_a_lab_writes(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run"))
    lab.run(2)
    lab.shutdown()
    run = RunFiles(tmp_path / "run")
    assert run.poll() and not run.poll()
    assert [m["step"] for m in run.metrics] == [1, 2] and len(run.samples) == 16
    assert {s.name for s in run.spans} >= {"generate", "update_actor", "generate_sequences"}
    fresh = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run"))  # a new run, same dir
    fresh.step()
    fresh.shutdown()
    assert run.poll() and [m["step"] for m in run.metrics] == [1] and {r["step"] for r in run.samples} == {1}

    from hybridflow_lab.ui.served import dashboard_app

    app = dashboard_app(tmp_path / "run")
    panes = {type(p).__name__: p for p in app.objects}
    timeline, stage_times, curves = [p.object for p in app.objects if type(p).__name__ == "Plotly"]
    assert {trace.name for trace in timeline.data} >= {"generate", "generate_sequences"}
    assert stage_times.data[0].x == (1,) and "critic/score/mean" in {t.name for t in curves.data}
    assert "HTML" in panes and fresh.samples[0]["prompt"] in panes["HTML"].object


def test_lab_reconfigure_rejects_a_bad_layout_and_keeps_the_config(model_dir, tmp_path):
    lab = Lab(ppo_config(model_dir, f"trainer.run_dir={tmp_path}"), start=False)
    with pytest.raises(ConfigError, match=r"critic\.pool"):
        lab.reconfigure("critic.ranks=1")
    assert lab.config.critic.ranks == 2


def test_lab_reconfigure_checks_the_task_under_the_new_settings_and_keeps_an_unchanged_task(model_dir, tmp_path):
    lab = Lab(ppo_config(model_dir, f"trainer.run_dir={tmp_path}"), start=False)
    lab.task.source.next_batch(3)
    drawn = lab.task.source.state_dict()
    with pytest.raises(ConfigError, match=r"rollout\.max_prompt_tokens"):
        lab.reconfigure("rollout.max_prompt_tokens=2")  # shorter than the task's prompts
    assert lab.config.rollout.max_prompt_tokens > 2
    lab.task.reward = len  # replaced in the notebook
    lab.reconfigure("actor.optim.lr=2e-4", "algorithm.overlong_buffer=4")
    assert lab.config.actor.optim.lr == 2e-4 and lab.task.source.state_dict() == drawn and lab.task.reward is len
    assert lab.task.shaping(torch.tensor([lab.config.rollout.max_new_tokens]))[0] < 0  # the overlong penalty applies
    lab.reconfigure("task.digits=3")
    assert lab.task.source.state_dict() != drawn
    assert max(len(operand) for example in lab.task.source.next_batch(16)
               for operand in re.findall(r"\d+", example.prompt)) == 3  # 3-digit operands now


def test_the_board_shows_trained_roles_and_moves_the_reference_with_the_actor(model_dir, tmp_path):
    lab = Lab(ppo_config(model_dir, "algorithm.kl_reward_coef=0.05", f"trainer.run_dir={tmp_path}"), start=False)
    board = placement_board(lab, devices=4)
    assert board.plan.assignment["reference"] == "main"
    actor_row = board.controls.children[0]
    actor_row.children[1].value = "actor"  # the actor's pool menu: a pool of its own
    assert board.plan.used_pools()["actor"] == ["actor", "reference"]


def test_the_board_applies_the_actors_pipeline_stages_and_takes_them_back(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=(f"actor.model_path={model_dir}", "algorithm.kl_loss_coef=0.04",
                                            f"trainer.run_dir={tmp_path}"), start=False)
    board = placement_board(lab, devices=4)
    stages = control(board, "pipeline stages")
    assert list(stages.options) == [1, 2] and stages.value == 1  # 2 actor slots: 1 or 2 stages of the 4 layers
    stages.value = 2
    assert board.plan.engines["actor"] == "torch" and board.plan.size_of("reference").p == 2
    board.apply_button.click()
    engine = lab.config.actor.engine
    assert (engine.pipeline_parallel, engine.backend, engine.remove_padding) == (2, "torch", False)
    control(board, "pipeline stages").value = 1
    board.apply_button.click()
    assert lab.config.actor.engine.pipeline_parallel == 1 and board.plan.size_of("actor").p == 1
