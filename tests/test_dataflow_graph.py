"""The dataflow graph: drawn from what a step's stages did, live while they run, for any dataflow."""

from __future__ import annotations

from hybridflow_lab.dataflows import register_algorithm
from hybridflow_lab.dataflows.algorithm import ALGORITHMS
from hybridflow_lab.telemetry import WHOLE_BATCH, Phase, Span, dataflow_graph
from hybridflow_lab.telemetry.dataflow_graph import node_html, to_svg
from hybridflow_lab.trainer.lab import Lab
from tests.test_lab import local_overrides

MODEL_SEED = 5  # conftest's model_dir builds this module's tiny model with it


def edge_columns(graph):
    return {(e.source, e.target): e.columns for e in graph.edges}


def test_a_ppo_step_is_drawn_as_its_stages_on_their_models_with_the_columns_between_them(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "algorithm.name=ppo",
                                                           "algorithm.kl_loss_coef=0.05", "batch.update_epochs=2"))
    assert "no stage has run yet" in str(lab.graph()) and lab.graph().models[:3] == ["rollout", "actor", "reference"]
    lab.step()
    graph = lab.graph()
    assert graph.step == 0 and [n.key for n in graph.nodes] == [
        "next_prompts", "generate", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"]
    models = {n.key: n.model for n in graph.nodes}
    assert models == {"next_prompts": "controller", "generate": "rollout", "reward": "reward function",
                      "old_log_prob": "actor", "ref": "reference", "values": "critic", "adv": "controller",
                      "update_critic": "critic", "update_actor": "actor"}
    edges = edge_columns(graph)
    assert edges[("old_log_prob", "update_actor")] == ["old_log_probs"]
    assert edges[("ref", "update_actor")] == ["ref_log_probs"]
    assert edges[("values", "adv")] == ["values"] and edges[("reward", "adv")] == ["scores"]
    assert edges[("adv", "update_critic")] == ["returns"] and edges[("adv", "update_actor")] == ["advantages"]
    assert edges[("generate", "reward")] == ["batch"]  # the reward reads the whole batch
    assert edges[("next_prompts", "generate")] == ["input_ids", "attention_mask"]
    batch = lab.last_batch
    sizes = {e.target: e.bytes for e in graph.edges if e.source == "old_log_prob"}
    assert sizes == {"update_actor": batch["old_log_probs"].numel() * 4}
    assert all(n.status == "done" and n.seconds > 0 for n in graph.nodes)
    assert graph.node("update_actor").moved_bytes > 0  # the rows sent to the actor's rank
    svg = to_svg(graph, selected="ref")
    assert all(f"data-stage='{key}'" in svg for key in models) and svg.count("hybridflow-edge") == len(graph.edges)
    assert "ref_log_probs" in node_html(graph.node("ref")) and "stroke='#d62728'" in svg  # the selected node
    lab.shutdown()


def test_the_running_stage_is_highlighted_and_the_stages_not_reached_yet_wait(model_dir, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run"))
    lab.step()
    seen = []
    scorer = lab.task.reward

    def reward(prompt, response, truth):
        seen.append(lab.graph())
        return scorer(prompt, response, truth)

    lab.task.reward = reward
    lab.step()
    during = seen[0]
    assert during.step == 1 and during.running() == ["reward"]
    status = {n.key: n.status for n in during.nodes}
    assert status == {"next_prompts": "done", "generate": "done", "reward": "running", "old_log_prob": "waiting",
                      "adv": "waiting", "update_actor": "waiting"}
    assert "data-status='running'" in to_svg(during)
    assert lab.graph().running() == [] and lab.graph().step == 1
    lab.shutdown()


def test_a_notebooks_own_dataflow_is_drawn_from_the_stages_it_calls(model_dir, tmp_path):
    def greedy_only(lab, step):
        batch = lab.reward(lab.generate(lab.next_prompts(), greedy=True, n=1))
        batch = lab.advantages(batch, estimator="reinforce_plus_plus")
        lab.update_actor(batch)
        return batch, step.metrics

    register_algorithm("greedy_only", greedy_only, "reinforce_plus_plus")
    try:
        lab = Lab("arithmetic_grpo", overrides=local_overrides(model_dir, tmp_path / "run",
                                                               "algorithm.name=greedy_only"))
        lab.step()
        graph = lab.graph()
        assert [n.key for n in graph.nodes] == ["next_prompts", "generate", "reward", "adv", "update_actor"]
        assert edge_columns(graph)[("adv", "update_actor")] == ["advantages"]
        lab.shutdown()
    finally:
        ALGORITHMS.pop("greedy_only")


def stage(name, start, step, reads=(), writes=None, model="controller"):
    attrs = {"reads": list(reads), "writes": writes or {}, "model": model, "pool": "controller"}
    return Span(name, Phase.STAGE, start, start + 1, step=step, attrs=attrs)


def test_repeated_stages_get_keys_of_their_own_and_a_whole_batch_reader_follows_the_last_writer():
    column = {"shape": [4], "dtype": "float32", "bytes": 16}
    spans = [stage("generate", 0, 3, writes={"responses": column}),
             stage("reward", 1, 3, [WHOLE_BATCH], {"scores": column}),
             stage("generate", 2, 3, writes={"responses": column}),
             stage("reward", 3, 3, [WHOLE_BATCH], {"scores": column}),
             stage("evaluate", 4, 3, [WHOLE_BATCH])]  # not part of the dataflow
    graph = dataflow_graph(spans)
    assert [n.key for n in graph.nodes] == ["generate", "reward", "generate#2", "reward#2"]
    assert edge_columns(graph) == {("generate", "reward"): ["batch"], ("generate#2", "reward#2"): ["batch"]}
    assert graph.edges[0].bytes == 16
    ahead = stage("generate", 5, 4, writes={"responses": column})  # the next step's responses, generated early
    assert dataflow_graph([*spans, ahead], current=3).step == 3
    assert dataflow_graph([*spans, ahead]).step == 4
