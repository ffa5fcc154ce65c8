"""The auto-mapping search and its simulator: enumeration, d_cost, memory, scaling, the Lab's restrictions."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hybridflow_lab import cli
from hybridflow_lab.bench.placement import misordered_pairs
from hybridflow_lab.config.presets import resolve_config
from hybridflow_lab.hybrid import ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.models import create_model_dir
from hybridflow_lab.placement.automap import AutoMapper, ColocatedSet, compositions, plan_of, set_partitions
from hybridflow_lab.placement.hardware import PROFILES, HardwareProfile, get_profile
from hybridflow_lab.placement.report import compare_with_paper, plans_table
from hybridflow_lab.placement.simulator import (
    ModelCost,
    generation_s,
    inference_s,
    reshard_s,
    resident_bytes,
    training_s,
)
from hybridflow_lab.placement.suggest import lab_mapper, suggest
from hybridflow_lab.placement.workload import LLAMA, Workload, workload_from_config

A100 = PROFILES["a100-80gb"]


@pytest.mark.parametrize(("items", "bell"), [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)])
def test_colocation_sets_are_the_set_partitions(items, bell):
    names = "abcde"[:items]
    partitions = list(set_partitions(names))
    assert len(partitions) == bell
    assert len({tuple(sorted(p)) for p in partitions}) == bell
    assert all(sorted(x for group in p for x in group) == list(names) for p in partitions)


def test_device_allocations_respect_minimums_and_units():
    splits = list(compositions(32, 3, [8, 8, 16], 8))
    assert splits == [(8, 8, 16)]
    assert set(compositions(4, 2, [1, 1], 1)) == {(1, 3), (2, 2), (3, 1)}


def test_d_cost_adds_within_a_set_and_takes_the_slowest_set_per_stage():
    def cost(role, generation, preparation, training):
        stages = {"generation": generation, "preparation": preparation, "training": training}
        return ModelCost(role, ParallelLayout(), stages, 0.0)

    actor_set = ColocatedSet(("actor", "reference"), 8, (cost("actor", 10, 2, 5), cost("reference", 0, 3, 0)))
    critic_set = ColocatedSet(("critic",), 8, (cost("critic", 0, 6, 4),))
    plan = plan_of((actor_set, critic_set), ("generation", "preparation", "training"))
    assert plan.stage_s == {"generation": 10, "preparation": 6, "training": 5}
    assert plan.total_s == 21 and plan.kind == "split"
    one_by_one = plan_of((actor_set, critic_set), ("generation", "preparation", "training"), concurrent=False)
    assert one_by_one.stage_s == {"generation": 10, "preparation": 11, "training": 9}


def test_llama_shapes_have_the_published_parameter_counts():
    assert [round(LLAMA[s].params / 1e9, 1) for s in ("7B", "13B", "34B", "70B")] == [6.7, 13.0, 33.7, 69.0]


def test_compute_bound_training_halves_with_twice_the_data_parallel_devices():
    workload, spec = Workload.paper_ppo("7B"), LLAMA["7B"]
    small, large = (training_s(spec, ParallelLayout(t=8, d=d), workload, A100) for d in (2, 4))
    assert 0.5 < large / small < 0.6  # the gradient all-reduce does not shrink with d


def test_generation_is_memory_bound_and_needs_room_for_a_kv_cache():
    workload, spec = Workload.paper_ppo("7B"), LLAMA["7B"]
    roomy = generation_s(spec, ParallelLayout(t=8, d=2, tg=2), workload, A100, 40 * 2**30)
    cramped = generation_s(spec, ParallelLayout(t=8, d=2, tg=2), workload, A100, 6 * 2**30)
    assert cramped > roomy  # fewer sequences per wave, more waves
    assert generation_s(spec, ParallelLayout(t=8, d=2, tg=2), workload, A100, 2**30) == math.inf


def test_token_budget_micro_batches_size_the_simulated_activations_and_pipeline_bubble(tmp_path):
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=0)
    overrides = [f"actor.model_path={model}", "batch.micro_batch_sequences_per_rank=4"]
    by_sequences = workload_from_config(resolve_config("arithmetic_grpo", overrides))
    longest = by_sequences.sequence_tokens
    by_tokens = workload_from_config(resolve_config(
        "arithmetic_grpo", [*overrides, f"batch.micro_batch_tokens_per_rank={16 * longest}"]))
    assert (by_sequences.tokens_per_micro_batch, by_tokens.tokens_per_micro_batch) == (4 * longest, 16 * longest)
    spec, single = by_sequences.models["actor"], ParallelLayout()
    extra = resident_bytes("actor", spec, single, by_tokens) - resident_bytes("actor", spec, single, by_sequences)
    assert extra == 12 * longest * spec.hidden * 4 * (spec.layers + 16)  # 12 more full sequences' layer inputs, float32

    paper, pipelined = Workload.paper_ppo("7B"), ParallelLayout(t=2, p=4, d=2)
    same = dataclasses.replace(paper, micro_batch_tokens=paper.micro_batch_sequences * paper.sequence_tokens)
    fewer = dataclasses.replace(paper, micro_batch_tokens=64 * paper.sequence_tokens)
    assert training_s(LLAMA["7B"], pipelined, same, A100) == training_s(LLAMA["7B"], pipelined, paper, A100)
    assert training_s(LLAMA["7B"], pipelined, fewer, A100) > training_s(LLAMA["7B"], pipelined, paper, A100)


def test_pipeline_stages_waiting_in_the_bubble_leave_shared_cores_to_the_other_ranks():
    spec = LLAMA["7B"]
    # 2 replicas of 16 sequences in micro-batches of 8: 2 micro-batches each, a bubble of 1.5 with 2 stages
    workload = Workload({"actor": spec}, prompts=32, prompt_tokens=64, response_tokens=64, micro_batch_sequences=8)
    shared = dataclasses.replace(PROFILES["cpu"], call_overhead_s=0.0)
    dedicated = dataclasses.replace(shared, cores=0)

    def forward_s(hardware, **sizes):
        return inference_s(spec, ParallelLayout(**sizes), workload, hardware)

    assert forward_s(dedicated, p=2, d=2) == pytest.approx(1.5 / 2 * forward_s(dedicated, d=2))
    # on 2 cores the 4 ranks are busy 2/3 of the time: 8/3 of them compete for the cores, not 4
    assert forward_s(shared, p=2, d=2) == pytest.approx(forward_s(shared, d=2))


def test_reshard_cost_is_table_2_bytes_over_the_link():
    workload, spec = Workload.paper_ppo("7B"), LLAMA["7B"]
    layout = ParallelLayout(t=8, d=2, tg=2)
    moved = formula_bytes_per_rank("hybridflow", layout, spec.params * 2)
    assert reshard_s(spec, layout, workload, A100) == pytest.approx(moved / A100.intra_node_bandwidth)
    assert reshard_s(spec, ParallelLayout(t=8, d=2, tg=8), workload, A100) == 0.0


def test_reshard_cost_gathers_the_pipeline_stages_into_one_generation_stage():
    workload, spec = Workload.paper_ppo("7B"), LLAMA["7B"]
    model_bytes = spec.params * 2
    # Table 2: (t p - tg pg) / (tg pg t p) of the model; t4 p2 -> tg2 pg1 moves 3/8, t1 p2 -> tg1 half
    assert reshard_s(spec, ParallelLayout(t=4, p=2, tg=2), workload, A100) == \
        pytest.approx(3 / 8 * model_bytes / A100.intra_node_bandwidth)
    assert reshard_s(spec, ParallelLayout(p=2), workload, A100) == \
        pytest.approx(model_bytes / 2 / A100.intra_node_bandwidth)


def test_a_model_too_big_for_the_devices_gets_no_plan():
    assert AutoMapper(Workload.paper_ppo("70B"), A100, 16).search() == []
    assert "no placement fits" in plans_table([])


def test_search_ranks_plans_and_restricts_them_as_asked():
    mapper = AutoMapper(Workload.paper_ppo("7B"), A100, 32, together=("actor", "reference"), max_pipeline=1,
                        tensor_parallel_roles=("actor",))
    plans = mapper.search(top=20)
    assert [p.total_s for p in plans] == sorted(p.total_s for p in plans)
    for plan in plans:
        assert any({"actor", "reference"} <= set(s.roles) for s in plan.sets)
        assert sum(s.devices for s in plan.sets) == 32
        for model in (c for s in plan.sets for c in s.costs):
            assert model.layout.p == 1 and (model.layout.t == 1 or model.role == "actor")
            assert model.layout.world_size == next(s.devices for s in plan.sets if model in s.costs)
        assert all(s.memory_bytes <= A100.memory_bytes for s in plan.sets)
    assert len(list(mapper.placements())) == 5  # the partitions of 4 models with actor and reference together


def test_paper_comparison_covers_the_papers_cells():
    rows = compare_with_paper(A100, sizes=("7B",), device_counts=(16,))
    assert rows[0]["paper"] == "colocate" and rows[0]["predicted"] in ("colocate", "split", "standalone")
    assert rows[0]["agrees"] == (rows[0]["predicted"] == "colocate")


def test_profiles_by_name_or_calibrated_file(tmp_path):
    path = tmp_path / "cpu.json"
    calibrated = HardwareProfile("cpu-calibrated", 2**32, 1e10, 5e9, 1e9, 1e9, cores=2)
    calibrated.save(path)
    assert get_profile(str(path)) == calibrated and get_profile("h200").memory_bytes > A100.memory_bytes
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        get_profile("tpu")


def test_plan_command_ranks_the_labs_placements(tmp_path, capsys):
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=0)
    out = tmp_path / "plans.json"
    assert cli.main(["plan", "--config", "arithmetic_grpo", f"actor.model_path={model}", "algorithm.name=ppo",
                     "--devices", "4", "--out", str(out)]) == 0
    assert "colocate" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["profile"] == "cpu" and report["devices"] == 4 and report["plans"]
    assert {"actor", "critic"} <= {role for plan in report["plans"] for s in plan["sets"] for role in s["roles"]}


def test_suggestions_are_valid_lab_placements(tmp_path):
    model = create_model_dir(tmp_path / "m", "standard", "qwen2", seed=0)
    config = resolve_config("arithmetic_grpo", [f"actor.model_path={model}", "algorithm.name=ppo"])
    suggestions = suggest(config, 4)
    assert suggestions and [s.estimated_step_s for s in suggestions] == sorted(s.estimated_step_s for s in suggestions)
    for suggestion in suggestions:
        placed = suggestion.plan.apply(config)  # passes the config validation
        assert placed.actor.pool == "main" and placed.actor.ranks + (
            placed.critic.ranks if placed.critic.pool != "main" else 0) <= 4
        assert placed.actor.engine.tensor_parallel == 1 or placed.actor.engine.backend == "torch"


def test_placement_kinds_follow_the_papers_names():
    def plan(*groups):
        return plan_of(tuple(ColocatedSet(g, 8, ()) for g in groups), ())

    assert plan(("actor", "critic", "reference", "reward")).kind == "colocate"
    assert plan(("actor", "reference"), ("critic", "reward")).kind == "split"
    assert plan(("actor", "reward"), ("critic", "reference")).kind == "mixed"
    assert plan(("actor",), ("critic",), ("reference",), ("reward",)).kind == "standalone"


def test_ranking_check_ignores_settings_measured_within_noise():
    rows = [{"setting": "a", "measured_s": 1.00, "predicted_s": 1.2}, {"setting": "b", "measured_s": 1.02,
                                                                      "predicted_s": 1.1},
            {"setting": "c", "measured_s": 2.0, "predicted_s": 1.0}]
    assert misordered_pairs(rows) == [("a", "c"), ("b", "c")]
    rounds = {"a": [0.9, 1.1], "b": [0.95, 1.1], "c": [1.05, 2.95]}  # a round of c was faster than one of a
    assert misordered_pairs([{**row, "measured_rounds_s": rounds[row["setting"]]} for row in rows]) == []


def test_the_labs_reference_follows_the_actors_tensor_parallel_sizes(tmp_path):
    model = create_model_dir(tmp_path / "m", "small", "qwen2", seed=0)
    config = resolve_config("arithmetic_grpo", [f"actor.model_path={model}", "algorithm.kl_loss_coef=0.04",
                                                "batch.micro_batch_sequences_per_rank=16"])
    mapper = lab_mapper(config, 4, PROFILES["cpu"])
    for devices in (1, 2, 4):
        actor, reference = mapper.best_for_set(("actor", "reference"), devices).costs
        assert (reference.layout.t, reference.layout.d) == (actor.layout.t, actor.layout.d)
    suggestions = suggest(config, 4)
    assert suggestions and all(s.plan.size_of("reference").t == s.plan.size_of("actor").t for s in suggestions)


def test_the_lab_search_leaves_slots_idle_when_ranks_would_share_cores(tmp_path):
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=0)
    config = resolve_config("arithmetic_grpo", [f"actor.model_path={model}", "batch.micro_batch_sequences_per_rank=16"])
    shared, dedicated = PROFILES["cpu"], dataclasses.replace(PROFILES["cpu"], cores=0)
    assert shared.cores == 2
    assert [s.devices for s in lab_mapper(config, 4, shared).search()[0].sets] == [2]
    assert [s.devices for s in lab_mapper(config, 4, dedicated).search()[0].sets] == [4]


def test_the_lab_search_sweeps_the_pipeline_stages_its_validation_accepts_for_the_actor_only(tmp_path):
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=0)
    config = resolve_config("arithmetic_grpo", [f"actor.model_path={model}", "algorithm.name=ppo"])
    mapper = lab_mapper(config, 4, PROFILES["cpu"])

    def staged(role, devices):
        return {(par.t, par.p, par.d) for par in mapper.parallel_choices(role, devices) if par.p > 1}

    # 64 sequences per optimizer step, 32 per micro-batch: 1F1B runs 2 stages on one replica, never 4 stages
    assert staged("actor", 2) == {(1, 2, 1)} and staged("actor", 4) == {(2, 2, 1)}
    assert staged("critic", 4) == set()


def test_a_device_too_small_for_fewer_than_4_shards_gets_a_pipeline_suggestion_that_runs(tmp_path):
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=0)
    config = resolve_config("arithmetic_grpo", [f"actor.model_path={model}", "algorithm.kl_loss_coef=0.04"])
    ten_mib = dataclasses.replace(PROFILES["cpu"], memory_bytes=10 * 2**20)  # the actor and reference: 5.7 MiB in 4
    suggestion, = suggest(config, 4, ten_mib)
    engine = suggestion.plan.apply(config).actor.engine
    assert (engine.tensor_parallel, engine.pipeline_parallel, engine.backend, engine.remove_padding) == \
        (2, 2, "torch", False)
    assert suggestion.label == "colocate: main: 4, actor t2 p2 tg2"
