"""``hybridflow-lab bench reshard``: the actor's training-to-generation transition, three strategies.

The ``small`` model on 4 CPU ranks (gloo), for (t, p, tg) in (4, 1, 2), (2, 1, 1), (4, 1, 4) and, with pipeline
stages, (2, 2, 2), (2, 2, 1), (1, 2, 1) (``d`` fills the ranks; generation never pipelines): bytes the ranks
receive (mean and max over ranks: stages differ in size) against the paper's Table 2 formula, parameter bytes held
at the peak, bytes held twice, and the transition's seconds (slowest rank, median over repeats). M counts the
tensor-parallel weights; replicated norm weights (0.05% of ``small``) move only to the ranks of other stages, and
are reported apart.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

import torch

from hybridflow_lab.controller import Dispatch, ResourcePool, Role, Worker, WorkerGroup, init_cluster, register
from hybridflow_lab.hybrid import STRATEGIES, ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.hybrid.reshard import Resharder, process_groups, training_shard
from hybridflow_lab.models import create_model_dir, load_causal_lm
from hybridflow_lab.models.tensor_parallel import split_dim

LAYOUTS = ((4, 1, 2), (2, 1, 1), (4, 1, 4), (2, 2, 2), (2, 2, 1), (1, 2, 1))  # (t, p, tg)


class ReshardBenchWorker(Worker):
    """One rank of the actor: its training shard (TP ``t``, a stage of ``p``) and a resharder per strategy."""

    def __init__(self, model_dir: str, t: int, p: int, tg: int) -> None:
        layout = ParallelLayout(t=t, p=p, tg=tg, d=self.world_size // (t * p))
        groups = process_groups(self.device_mesh)
        model = training_shard(load_causal_lm(model_dir), layout, self.rank, groups)
        self.resharders = {s: Resharder(model, layout, self.rank, groups, s) for s in STRATEGIES}

    @register(Dispatch.ONE_TO_ALL)
    def transitions(self, strategy: str, repeats: int) -> list[dict[str, Any]]:
        """``repeats`` round trips training -> generation -> training; the stats of each to-generation."""
        resharder, stats = self.resharders[strategy], []
        for _ in range(repeats):
            torch.distributed.barrier()  # start together: a transition is as slow as its slowest rank
            _, moved = resharder.to_generation()
            resharder.to_training()
            stats.append(vars(moved))
        return stats


def run(repeats: int = 5, warmup: int = 1, size: str = "small",
        layouts: tuple[tuple[int, int, int], ...] = LAYOUTS, ranks: int = 4) -> dict[str, Any]:
    """Each (t, p, tg) of ``layouts`` on ``ranks`` ranks, every strategy: one row each, and the goal per layout."""
    init_cluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_model_dir(f"{tmp}/model", size, "qwen2", seed=0)
        full = load_causal_lm(model_dir)
        model_bytes = sum(p.nbytes for n, p in full.named_parameters() if split_dim(n) is not None)
        for t, p, tg in layouts:
            layout = ParallelLayout(t=t, p=p, tg=tg, d=ranks // (t * p))
            group = WorkerGroup(Role(ReshardBenchWorker, str(model_dir), t, p, tg), ResourcePool(ranks),
                                meshes=layout.meshes(), name=f"reshard-bench-{t}-{p}-{tg}")
            try:
                for strategy in STRATEGIES:
                    per_rank = group.transitions(strategy, warmup + repeats)
                    rows.append(_row(strategy, layout, model_bytes, [stats[warmup:] for stats in per_rank]))
            finally:
                group.shutdown()
    return {"bench": "reshard", "model": size, "ranks": ranks, "model_param_bytes": model_bytes,
            "replicated_param_bytes": sum(p.nbytes for n, p in full.named_parameters() if split_dim(n) is None),
            "repeats": repeats, "results": rows, "goal": _goal(rows)}


def _row(strategy: str, layout: ParallelLayout, model_bytes: int, per_rank: list[list[dict[str, Any]]]) -> dict:
    seconds = [max(rank[i]["seconds"] for rank in per_rank) for i in range(len(per_rank[0]))]
    first = [rank[0] for rank in per_rank]
    received = [s["bytes_received"] for s in first]
    return {"strategy": strategy, "t": layout.t, "p": layout.p, "tg": layout.tg,
            "bytes_per_rank": sum(received) / len(received), "bytes_per_rank_max": max(received),
            "formula_bytes_per_rank": formula_bytes_per_rank(strategy, layout, model_bytes),
            "replicated_bytes_per_rank": sum(s["replicated_bytes_received"] for s in first) / len(first),
            "peak_param_bytes_per_rank": max(s["peak_param_bytes"] for s in first),
            "redundant_param_bytes": max(s["redundant_param_bytes"] for s in first),
            "seconds": round(statistics.median(seconds), 4)}


def _goal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout: every strategy's mean bytes equal Table 2's, HybridFlow holds nothing twice, and its speed-up
    over DS-Chat reaches max(1, (DS-Chat bytes / our bytes) x 0.5), 1 where ours moves nothing."""
    checks = []
    for ours in (r for r in rows if r["strategy"] == "hybridflow"):
        same = [r for r in rows if _layout(r) == _layout(ours)]
        ds = next(r for r in same if r["strategy"] == "ds_chat")
        bytes_match = all(r["bytes_per_rank"] == r["formula_bytes_per_rank"] for r in same)
        required = max(1.0, ds["bytes_per_rank"] / ours["bytes_per_rank"] * 0.5) if ours["bytes_per_rank"] else 1.0
        speedup = ds["seconds"] / ours["seconds"]
        checks.append({"t": ours["t"], "p": ours["p"], "tg": ours["tg"], "bytes_equal_formula": bytes_match,
                       "hybridflow_redundant_param_bytes": ours["redundant_param_bytes"],
                       "speedup_vs_ds_chat": round(speedup, 2), "required": round(required, 2),
                       "met": bytes_match and ours["redundant_param_bytes"] == 0 and speedup >= required})
    return checks


def _layout(row: dict[str, Any]) -> tuple[int, int, int]:
    return row["t"], row["p"], row["tg"]
