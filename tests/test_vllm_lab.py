"""vLLM generating for the actor on Ray ranks: fed by every training engine, in a GRPO run that learns as the
built-in engine's does, and from a notebook kernel of the project's one environment (tests/test_vllm.py: one
engine in this process)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from hybridflow_lab.config import EngineConfig
from hybridflow_lab.controller import ResourcePool
from hybridflow_lab.demos.demo_tasks import DEMO_TASKS
from hybridflow_lab.demos.rl_demo import rl_lab
from hybridflow_lab.demos.warm_cache import cached_warm_start
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.telemetry import Phase
from hybridflow_lab.ui.figures import recent_steps, timeline
from tests.test_workers import actor_group, check_actor_round, lab_config

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: `make lab` or `make test` installs it")

pytestmark = [pytest.mark.vllm, pytest.mark.ray]


MODEL_SEED = 3  # conftest's model_dir builds this module's tiny model with it


# ---------------------------------------------------------------- the actor on Ray ranks, each training engine
def vllm_config(model_dir: str, backend: str, stage: int = 2, tensor_parallel: int = 1, vllm_tp: int = 1,
                pipeline: int = 1):
    config = lab_config(model_dir, engine=backend, stage=stage)
    actor = dataclasses.replace(config.actor, engine=EngineConfig(
        backend=backend, zero_stage=stage, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline,
        remove_padding=pipeline == 1))
    rollout = dataclasses.replace(config.rollout, engine="vllm", tensor_parallel=vllm_tp)
    return dataclasses.replace(config, actor=actor, rollout=rollout)


@pytest.mark.parametrize(("backend", "stage", "tensor_parallel", "vllm_tp", "pipeline"),
                         [("deepspeed", 3, 1, 1, 1), ("fsdp", 0, 1, 1, 1), ("torch", 0, 2, 1, 1),
                          ("deepspeed", 3, 1, 2, 1), ("torch", 0, 1, 1, 2)],
                         ids=["zero3", "fsdp2", "torch-tp2", "zero3-vllm-tp2", "torch-pp2"])  # ZeRO-2: GRPO below
def test_every_training_engine_feeds_vllm_on_two_ranks(ray_cluster, model_dir, backend, stage, tensor_parallel,
                                                       vllm_tp, pipeline):
    """Generate with vLLM, update, generate again: log-probs agree with the trainer's before and after the
    update (the sync reached vLLM), and every sync is a verified ``weight_sync`` span with all tensors. With
    ``vllm_tp`` 2 one vLLM engine runs tensor-parallel over both actor ranks (vLLM's external launcher); with
    ``pipeline`` 2 the two ranks train a stage each and stream their weights to both engines."""
    actor = actor_group(vllm_config(model_dir, backend, stage, tensor_parallel, vllm_tp, pipeline), ResourcePool(2),
                        name=f"vllm-actor-{backend}-{stage}-{tensor_parallel}-{vllm_tp}-{pipeline}")
    try:
        check_actor_round(actor)
        spans = [s for s in actor.telemetry.spans(group=actor.name) if s.name == "weight_sync"]
    finally:
        actor.shutdown()
    tensors = len(load_causal_lm(model_dir).state_dict())
    assert sorted(s.rank for s in spans) == [0, 1]  # one sync per rank: after the update, before regenerating
    assert all(s.phase is Phase.TRANSFER and s.attrs["tensors"] == tensors and "check_seconds" in s.attrs
               for s in spans)


# ---------------------------------------------------------------- RL with vLLM generating, against the built-in engine
RL_STEPS = 40


@pytest.mark.slow
def test_grpo_learns_with_vllm_as_with_the_built_in_engine(ray_cluster, tmp_path):
    """From one warm start, GRPO's held-out accuracy gain with vLLM generating is the built-in engine's within
    sampling noise, and the training/rollout mismatch is reported at every step; the demo's actor trains with
    DeepSpeed ZeRO-2 on 2 ranks, each syncing every tensor into its vLLM engine at every step, verified. (PPO's
    dataflow adds a critic, which vLLM does not touch: tests/test_lab.py runs it with the built-in engine.)"""
    demo = DEMO_TASKS["sorting"]
    model_dir, _ = cached_warm_start("sorting", seed=0)  # bench async's too: trained once per machine
    tensors = len(load_causal_lm(model_dir).state_dict())
    gains, mismatch = {}, {}
    for engine in ("torch", "vllm"):
        lab = rl_lab(tmp_path, demo, 0, RL_STEPS, f"grpo-{engine}", "trainer.progress=false",
                     f"rollout.engine={engine}", model_dir=model_dir)
        try:
            before = lab.evaluate()["eval/accuracy"]
            history = lab.run()
            gains[engine] = lab.evaluate()["eval/accuracy"] - before
            bars = {bar.name: bar for bar in timeline(recent_steps(lab.telemetry.spans(), 1)).data}
            syncs = [s for s in lab.telemetry.spans() if s.name == "weight_sync"]
            engines = (lab.config.actor.engine.backend, lab.config.actor.engine.zero_stage, lab.config.actor.ranks)
        finally:
            lab.shutdown()
        if engine == "vllm":  # the sync of each step is on the dashboard's timeline, with its bytes, per rank
            assert engines == ("deepspeed", 2, 2)
            assert sorted(bars["weight_sync (transfer)"].y) == ["actor r0", "actor r1"]
            assert len(syncs) == 2 * RL_STEPS and all(s.attrs["tensors"] == tensors and "check_seconds" in s.attrs
                                                      for s in syncs)
        assert all("actor/rollout_mismatch" in step for step in history)
        mismatch[engine] = max(step["actor/rollout_mismatch_max"] for step in history)
    print({engine: round(100 * gain, 1) for engine, gain in gains.items()}, mismatch)
    assert gains["vllm"] > 0.10, gains
    assert abs(gains["vllm"] - gains["torch"]) < 0.12, gains
    assert mismatch["vllm"] < 1e-3, mismatch  # fp32: vLLM's log-probs are the trainer's


# ---------------------------------------------------------------- the notebook kernel, in the project's environment
def test_a_notebook_kernel_runs_the_readmes_cell_with_vllm_generating_on_each_rank(tmp_path):
    """One environment: a Jupyter kernel started from it runs the README's cell with ``rollout.engine=vllm`` (as the
    README says), each of the actor's two Ray ranks syncing its weights into a vLLM engine of its own."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    cell = re.search(r"```python\n(.*?)\n```", readme, re.DOTALL).group(1)
    run_dir = '"trainer.run_dir=runs/first-lab"'
    vllm_cell = cell.replace(f"{run_dir}]", f'{run_dir}, "rollout.engine=vllm"]').replace("lab.run(10)", "lab.run(2)")
    assert vllm_cell.count("rollout.engine=vllm") == 1 and "lab.run(2)" in vllm_cell
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        vllm_cell, "syncs = [s for s in lab.telemetry.spans() if s.name == 'weight_sync']\n"
                   "print(lab.config.rollout.engine, len(history), sorted({s.rank for s in syncs}))\nlab.shutdown()")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(output.get("text", "") for output in notebook.cells[1].outputs)
    assert printed.split("\n")[0] == "vllm 2 [0, 1]"
