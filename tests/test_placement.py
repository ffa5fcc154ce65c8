"""The Placement object: named layouts, YAML, the table, and the checks that run before any worker starts."""

from __future__ import annotations

import pytest

from hybridflow_lab.config import ConfigError
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.hybrid import ParallelLayout
from hybridflow_lab.placement import Placement
from hybridflow_lab.placement.hardware import PROFILES
from hybridflow_lab.placement.workload import Workload
from hybridflow_lab.trainer.lab import Lab

PAPER_MODELS = ("actor", "critic", "reference", "reward")


MODEL_SEED = 2  # conftest's model_dir builds this module's tiny model with it


def test_the_papers_named_layouts():
    colocated = Placement.colocate_all(PAPER_MODELS, 16)
    split = Placement.split(PAPER_MODELS, 64, 32)
    standalone = Placement.standalone({"actor": 64, "critic": 32, "reference": 16, "reward": 16})
    assert colocated.used_pools() == {"main": list(PAPER_MODELS)} and colocated.devices_needed() == 16
    assert split.used_pools() == {"main": ["actor", "reference"], "critic": ["critic", "reward"]}
    assert split.devices_needed() == 96 and standalone.devices_needed() == 128
    assert standalone.size_of("critic").d == 32


def test_yaml_round_trip_and_table(tmp_path):
    placement = Placement.split(PAPER_MODELS, 16, 8).with_sizes("actor", t=8, tg=2).with_sizes("critic", t=4, p=2)
    path = tmp_path / "placement.yaml"
    placement.to_yaml(path)
    assert Placement.from_yaml(path) == placement == Placement.from_yaml(placement.to_yaml())
    lines = placement.table().splitlines()
    assert lines[0].split() == ["model", "pool", "devices", "t", "p", "d", "tg", "pg", "engine"]
    assert lines[1].split() == ["actor", "main", "16", "8", "1", "2", "2", "1", "-"]
    assert lines[2].split()[:6] == ["critic", "critic", "8", "4", "2", "1"]
    assert "<table" in placement._repr_html_()
    with pytest.raises(ConfigError, match=r"unknown keys \['gpus'\]"):
        Placement.from_dict({**placement.to_dict(), "gpus": 8})


def test_sizes_that_do_not_divide_the_pool_name_the_model_pool_and_number():
    with pytest.raises(ConfigError, match=r"t\*p = 3 does not divide the 4 devices of pool 'main'") as error:
        Placement({"main": 4}, {"actor": "main"}, {"actor": ParallelLayout(t=3)}).check_sizes()
    assert error.value.key == "placement.actor"


def test_a_generation_tp_that_does_not_divide_the_training_tp_is_refused_naming_the_model_and_the_fix():
    with pytest.raises(ConfigError, match=r"tg=4 must divide t=2 .*; use tg in \[1, 2\]") as error:
        Placement.colocate_all(PAPER_MODELS, 4).with_sizes("actor", t=2, tg=4)
    assert error.value.key == "placement.actor"
    with pytest.raises(ConfigError, match=r"placement.critic: tg=3 must divide t=4"):
        Placement.from_dict({"pools": {"main": 4}, "assignment": {"critic": "main"},
                             "sizes": {"critic": {"t": 4, "tg": 3}}})


def test_a_placement_refuses_setting_d_which_fills_the_pool():
    with pytest.raises(ConfigError, match=r"placement.actor: unknown sizes \['d'\].*d fills the pool"):
        Placement.colocate_all(PAPER_MODELS, 4).with_sizes("actor", d=2)


def test_data_parallel_follows_the_pool_when_the_pool_changes():
    placement = Placement.colocate_all(PAPER_MODELS, 16).with_sizes("actor", t=8, tg=2)
    assert placement.size_of("actor") == ParallelLayout(t=8, d=2, tg=2)
    assert placement.with_changes(pools={"main": 32}).size_of("actor") == ParallelLayout(t=8, d=4, tg=2)


def test_memory_check_names_the_pool_each_models_share_and_the_device():
    workload, a100 = Workload.paper_ppo("70B"), PROFILES["a100-80gb"]
    with pytest.raises(ConfigError, match=r"pool 'main' need .* GiB per device \(actor t8 p1 d2 .* a100-80gb device "
                                          r"has 72.00 GiB usable") as error:
        Placement.colocate_all(PAPER_MODELS, 16).with_sizes("actor", t=8).check_memory(workload, a100)
    assert error.value.key == "placement.main"
    roomy = Placement.colocate_all(PAPER_MODELS, 64)
    for model in PAPER_MODELS:
        roomy = roomy.with_sizes(model, t=8, p=4, tg=8)
    roomy.check_memory(workload, a100)  # 70B on 64 GPUs with t=8 p=4 fits


def test_what_the_lab_cannot_run_fails_with_the_fix():
    apart = Placement({"main": 2, "ref": 2}, {"actor": "main", "reference": "ref"})
    with pytest.raises(ConfigError, match="inside the actor's ranks; place it on the actor's pool 'main'"):
        apart.check_lab()


def test_the_lab_generates_on_one_pipeline_stage():
    staged_generation = Placement({"main": 2}, {"actor": "main"}, {"actor": ParallelLayout(p=2, pg=2)})
    with pytest.raises(ConfigError, match=r"pg=2: the Lab's generation engines hold every layer .*; use pg=1") as error:
        staged_generation.check_lab()
    assert error.value.key == "placement.actor"


def test_only_the_actor_trains_in_pipeline_stages():
    staged_critic = Placement({"main": 2}, {"actor": "main", "critic": "main"}, {"critic": ParallelLayout(p=2)})
    with pytest.raises(ConfigError, match=r"only the actor trains pipeline-parallel .*; use p=1 for the critic") as \
            error:
        staged_critic.check_lab()
    assert error.value.key == "placement.critic"


def test_the_reference_follows_the_actors_pipeline_stages():
    placement = Placement({"main": 4}, {"actor": "main", "reference": "main"})
    staged = placement.with_actor_pipeline(2)
    assert staged.size_of("reference") == staged.size_of("actor") == ParallelLayout(p=2, d=2)
    staged.check_lab()
    with pytest.raises(ConfigError, match=r"sharded like the actor \(t=1, p=2\); set its t and p to the actor's"):
        staged.with_sizes("reference", p=1).check_lab()


def test_a_pipeline_plan_writes_its_stages_and_what_they_run_on():
    placement = Placement({"main": 2}, {"actor": "main"}, engines={"actor": "deepspeed"}, zero_stages={"actor": 2})
    assert placement.overrides() == ["actor.engine.tensor_parallel=1", "rollout.tensor_parallel=1",
                                     "actor.engine.pipeline_parallel=1", "actor.pool=main", "actor.ranks=2",
                                     "actor.engine.backend=deepspeed", "actor.engine.zero_stage=2"]
    staged = placement.with_sizes("actor", p=2)  # the engine as given: the overrides still train it on torch
    assert staged.overrides() == ["actor.engine.tensor_parallel=1", "rollout.tensor_parallel=1",
                                  "actor.engine.pipeline_parallel=2", "actor.engine.remove_padding=false",
                                  "actor.pool=main", "actor.ranks=2", "actor.engine.backend=torch",
                                  "actor.engine.zero_stage=2"]


def test_a_lab_runs_a_pipeline_plan(model_dir, tmp_path):
    config = resolve_config("arithmetic_grpo", (f"actor.model_path={model_dir}", "algorithm.kl_loss_coef=0.04",
                                                f"trainer.run_dir={tmp_path}"))
    staged = Placement.from_config(config).with_actor_pipeline(2)
    lab = Lab(config, placement=staged, start=False)  # check_config passes
    engine = lab.config.actor.engine
    assert (lab.config.actor.ranks, engine.pipeline_parallel, engine.backend, engine.remove_padding) == \
        (2, 2, "torch", False)
    assert lab.placement == staged and lab.placement.size_of("reference") == ParallelLayout(p=2)


@pytest.mark.parametrize(("pool", "stages", "overrides", "key", "fix"), [
    (3, 3, ("batch.micro_batch_sequences_per_rank=16",), "actor.engine.pipeline_parallel",
     r"3 stages do not divide the model's 4 layers .*; use one of \[1, 2, 4\]"),
    (3, 2, (), "placement.actor", r"t\*p = 2 does not divide the 3 devices of pool 'main'; use t\*p in \[1, 3\]"),
    (4, 4, (), "batch.micro_batch_sequences_per_rank", "1F1B schedule of 4 stages needs at least 4; use at most 16"),
], ids=["stages_not_dividing_the_layers", "stages_not_dividing_the_pool", "fewer_micro_batches_than_stages"])
def test_a_pipeline_plan_that_cannot_run_fails_before_any_worker_starts(model_dir, tmp_path, pool, stages, overrides,
                                                                        key, fix):
    config = resolve_config("arithmetic_grpo", (f"actor.model_path={model_dir}", f"trainer.run_dir={tmp_path}",
                                                *overrides))
    plan = Placement.from_config(config).with_changes(pools={"main": pool}).with_actor_pipeline(stages)
    with pytest.raises(ConfigError, match=fix) as error:
        Lab(config, placement=plan, start=False)
    assert error.value.key == key


def test_generation_stages_beyond_the_training_stages_are_refused_naming_the_model_and_the_fix():
    with pytest.raises(ConfigError, match=r"pg=2 must divide p=1 .*; use pg in \[1\]") as error:
        Placement({"main": 2}, {"actor": "main"}).with_sizes("actor", pg=2)
    assert error.value.key == "placement.actor"


def test_a_lab_runs_a_placement_and_shows_its_own(model_dir, tmp_path):
    placement = Placement({"main": 2, "critic": 1}, {"actor": "main", "critic": "critic"},
                          {"actor": ParallelLayout(t=2, tg=1)}, engines={"actor": "torch", "critic": "torch"})
    lab = Lab("arithmetic_grpo", overrides=(f"actor.model_path={model_dir}", "algorithm.name=ppo",
                                            f"trainer.run_dir={tmp_path}"), placement=placement, start=False)
    config = lab.config
    assert (config.actor.ranks, config.actor.engine.tensor_parallel, config.rollout.tensor_parallel) == (2, 2, 1)
    assert (config.critic.pool, config.critic.ranks) == ("critic", 1)
    assert lab.placement.pools == placement.pools and lab.placement.size_of("actor") == ParallelLayout(t=2, tg=1)


def test_moving_the_actor_takes_the_models_inside_its_ranks_along():
    placement = Placement({"main": 2}, {"actor": "main", "critic": "main", "reference": "main", "reward": "main"})
    moved = placement.moved("actor", "big")
    assert moved.used_pools() == {"big": ["actor", "reference", "reward"], "main": ["critic"]}
    assert moved.pools["big"] == 2 and placement.moved("critic", "c").used_pools()["c"] == ["critic"]
    moved.check_lab()
