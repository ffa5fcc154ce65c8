"""The 3D-HybridEngine: regrouped layouts, and generation after resharding equals the single-process model."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.engines.sampling import SamplingParams
from hybridflow_lab.engines.torch_rollout import generate, sequences_batch
from hybridflow_lab.hybrid import STRATEGIES, ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.hybrid.reshard import Groups, Resharder
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.tensor_parallel import split_dim
from hybridflow_lab.protocol import DataBatch
from tests.hybrid_workers import HybridEngineProbe


def test_the_papers_figure_8_grouping():
    layout = ParallelLayout(t=4, tg=2, d=2)  # training 1-4-2, generation 1-2-2-2 on 8 ranks
    assert layout.dg == 2
    assert layout.training_tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.generation_tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.generation_tp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.generation_mesh().groups("dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_table_2_formulas():
    layout, model = ParallelLayout(t=4, tg=2, d=2), 1000
    assert formula_bytes_per_rank("hybridflow", layout, model) == pytest.approx(250)  # (4-2)/(2*4)
    assert formula_bytes_per_rank("hybridflow_v", layout, model) == pytest.approx(750)  # (4-1)/4
    assert formula_bytes_per_rank("ds_chat", layout, model) == pytest.approx(875)  # (8-1)/8
    assert formula_bytes_per_rank("hybridflow", ParallelLayout(t=4, tg=4), model) == 0
    staged = ParallelLayout(t=2, p=2, tg=2, d=2)  # t and tg count with their stages: t*p = 4, tg*pg = 2
    assert formula_bytes_per_rank("hybridflow", staged, model) == pytest.approx(250)  # (4-2)/(2*4)
    assert formula_bytes_per_rank("hybridflow_v", staged, model) == pytest.approx(750)  # (4-1)/4
    assert formula_bytes_per_rank("ds_chat", staged, model) == pytest.approx(875)  # (8-1)/8
    assert formula_bytes_per_rank("hybridflow", ParallelLayout(t=2, p=2, tg=1), model) == pytest.approx(750)
    with pytest.raises(ValueError, match=r"tg=3 must divide t=4 .*; use tg in \[1, 2, 4\]"):
        ParallelLayout(t=4, tg=3)


def test_a_layout_refuses_a_size_below_one_naming_it():
    with pytest.raises(ValueError, match=r"d=0: sizes are at least 1; use d >= 1"):
        ParallelLayout(t=2, d=0)


def test_the_grouping_with_pipeline_stages():
    """Micro-DP groups are consecutive ranks whose training shards (tensor shards and stages) make one generation
    shard; generation TP groups are strided by dg."""
    both = ParallelLayout(t=2, p=2, tg=2)  # each generation shard: one tensor shard of both stages
    assert (both.dg, [both.rank(0, stage, shard) for stage in (0, 1) for shard in (0, 1)]) == (2, [0, 2, 1, 3])
    assert both.micro_dp_groups() == [[0, 1], [2, 3]]
    assert both.generation_tp_groups() == [[0, 2], [1, 3]]
    assert both.training_tp_groups() == [[0, 2], [1, 3]]
    assert both.training_mesh().groups("pp") == [[0, 1], [2, 3]]
    assert [both.training_stage(r) for r in range(4)] == [0, 1, 0, 1]
    assert [both.training_tp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [both.generation_tp_rank(r) for r in range(4)] == [0, 0, 1, 1]

    whole = ParallelLayout(t=2, p=2, tg=1)  # one generation shard: the whole model, from all four ranks
    assert whole.dg == 4 and whole.micro_dp_groups() == [[0, 1, 2, 3]]
    assert whole.generation_tp_groups() == [[0], [1], [2], [3]]
    assert whole.training_tp_groups() == [[0, 1], [2, 3]]
    assert whole.training_mesh().groups("pp") == [[0, 2], [1, 3]]
    assert [whole.training_stage(r) for r in range(4)] == [0, 0, 1, 1]
    assert [whole.training_tp_rank(r) for r in range(4)] == [0, 1, 0, 1]

    replicas = ParallelLayout(t=1, p=2, d=2)  # two replicas of two stages
    assert replicas.dg == 2 and replicas.micro_dp_groups() == [[0, 1], [2, 3]]
    assert replicas.training_mesh().groups("pp") == [[0, 1], [2, 3]]
    assert replicas.training_mesh().groups("dp") == [[0, 2], [1, 3]]
    assert replicas.generation_tp_groups() == [[0], [1], [2], [3]]
    assert [replicas.training_stage(r) for r in range(4)] == [0, 1, 0, 1]


def test_the_resharder_refuses_generation_stages_naming_the_fix():
    with pytest.raises(ValueError, match=r"pg=2: the generation model is the whole model .*; use pg=1"):
        Resharder(None, ParallelLayout(t=1, p=2, pg=2), 0, Groups())


MODEL_SIZE, MODEL_SEED = "small", 3  # conftest's model_dir builds this module's model


def reference(model, prompt_ids, prompt_mask, new_tokens):
    out = generate(model, prompt_ids, prompt_mask, SamplingParams(new_tokens, greedy=True, ignore_eos=True), None, 0)
    batch = DataBatch(sequences_batch(out, 0))
    with torch.no_grad():
        return batch["responses"], response_log_probs(model, batch)[0]


def prompts():
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 100, (3, 6), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0
    return prompt_ids, prompt_mask


def weight_bytes(model, sharded):
    """Bytes of the TP-split weights (Table 2's M), or of the replicated ones."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if (split_dim(n) is not None) == sharded)


def check_transitions(outs, reference_out, strategy, layout, full, where):
    """Every rank generates the single process's tokens and log-probs and gets its training shard back unchanged;
    the ranks receive Table 2's bytes on average (the replicated weights of the stages they lack beside them) and
    nothing on the way back; HybridFlow holds the generation shard at the peak and nothing twice."""
    responses, log_probs = reference_out
    for rank, out in enumerate(outs):
        at = f"{where}, rank {rank}"
        assert torch.equal(out["responses"], responses), at
        torch.testing.assert_close(out["log_probs"], log_probs, rtol=1e-5, atol=1e-5, msg=at)
        assert out["training_shard_kept"], at
        assert out["to_training"].bytes_received == out["to_training"].replicated_bytes_received == 0, at
    moved = [out["to_generation"] for out in outs]
    model_bytes = weight_bytes(full, sharded=True)
    assert sum(m.bytes_received for m in moved) / len(moved) == formula_bytes_per_rank(strategy, layout, model_bytes)
    assert sum(m.replicated_bytes_received for m in moved) / len(moved) == \
        (layout.p - 1) / layout.p * weight_bytes(full, sharded=False), where
    if layout.p == 1:  # every rank holds an equal share
        assert len({m.bytes_received for m in moved}) == 1, where
    if strategy == "hybridflow":  # the paper's Table 2: peak M/tg, nothing held twice
        assert {(m.peak_param_bytes, m.redundant_param_bytes) for m in moved} == {(model_bytes // layout.tg, 0)}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("t", "p", "tg", "torch_2_11"),
                         [(4, 1, 2, False), (2, 1, 1, True), (4, 1, 4, False), (2, 2, 2, False), (2, 2, 1, False),
                          (1, 2, 1, False)],
                         ids=["4-2", "2-1-on-torch-2.11", "4-4", "t2-p2-tg2", "t2-p2-tg1", "t1-p2-d2-tg1"])
def test_generation_after_resharding_equals_the_single_process_model(ray_cluster, model_dir, t, p, tg, torch_2_11):
    """Each rank trains its TP shard (of one of two stages where ``p`` is 2); generation runs the whole model in TP
    ``tg``. torch 2.11 (the lent GPU machines') has no ``all_gather_single``: the ranks of one case hide it."""
    full = load_causal_lm(model_dir)
    prompt_ids, prompt_mask = prompts()
    layout = ParallelLayout(t=t, p=p, tg=tg, d=4 // (t * p))
    group = WorkerGroup(Role(HybridEngineProbe, model_dir, t, tg, torch_2_11, p), ResourcePool(4),
                        meshes=layout.meshes(), name=f"hybrid-{t}-{p}-{tg}")
    try:
        for round_index in range(2):  # the weights change between transitions
            expected = reference(full, prompt_ids, prompt_mask, 5)
            for strategy in STRATEGIES:
                outs = group.generate_and_score(strategy, prompt_ids, prompt_mask, 5)
                check_transitions(outs, expected, strategy, layout, full, f"{strategy}, round {round_index}")
            group.scale(0.9)
            with torch.no_grad():
                for param in full.parameters():
                    param.mul_(0.9)
    finally:
        group.shutdown()
