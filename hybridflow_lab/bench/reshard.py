"""``hybridflow-lab bench reshard``: the actor's training-to-generation transition, three strategies.

The ``small`` model on 4 CPU ranks (gloo), for (t, tg) in (4, 2), (2, 1), (4, 4): bytes each rank
receives against the paper's Table 2 formula, parameter bytes held at the peak, bytes held twice,
and the transition's seconds (slowest rank, median over repeats). M counts the tensor-parallel
weights; replicated norm weights (0.05% of ``small``) never move.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

import torch

from hybridflow_lab.controller import Dispatch, ResourcePool, Role, Worker, WorkerGroup, init_cluster, register
from hybridflow_lab.hybrid import STRATEGIES, ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.hybrid.reshard import Resharder, process_groups
from hybridflow_lab.models import create_model_dir, load_causal_lm
from hybridflow_lab.models.decoder import shard_model
from hybridflow_lab.models.tensor_parallel import TensorParallel, split_dim

LAYOUTS = ((4, 2), (2, 1), (4, 4))


class ReshardBenchWorker(Worker):
    """One rank of the actor: a TP-``t`` shard and a resharder per strategy."""

    def __init__(self, model_dir: str, t: int, tg: int) -> None:
        full = load_causal_lm(model_dir)
        layout = ParallelLayout(t=t, tg=tg, d=self.world_size // t)
        groups = process_groups(self.device_mesh)
        model = shard_model(full, TensorParallel(t, layout.training_tp_rank(self.rank), groups.training_tp))
        del full
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


def run(repeats: int = 5, warmup: int = 1, size: str = "small", layouts: tuple[tuple[int, int], ...] = LAYOUTS,
        ranks: int = 4) -> dict[str, Any]:
    init_cluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_model_dir(f"{tmp}/model", size, "qwen2", seed=0)
        full = load_causal_lm(model_dir)
        model_bytes = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if split_dim(n) is not None)
        for t, tg in layouts:
            layout = ParallelLayout(t=t, tg=tg, d=ranks // t)
            group = WorkerGroup(Role(ReshardBenchWorker, str(model_dir), t, tg), ResourcePool(ranks),
                                meshes=layout.meshes(), name=f"reshard-bench-{t}-{tg}")
            try:
                for strategy in STRATEGIES:
                    per_rank = group.transitions(strategy, warmup + repeats)
                    rows.append(_row(strategy, layout, model_bytes, [stats[warmup:] for stats in per_rank]))
            finally:
                group.shutdown()
    return {"bench": "reshard", "model": size, "ranks": ranks, "model_param_bytes": model_bytes,
            "repeats": repeats, "results": rows, "goal": _goal(rows)}


def _row(strategy: str, layout: ParallelLayout, model_bytes: int, per_rank: list[list[dict[str, Any]]]) -> dict:
    seconds = [max(rank[i]["seconds"] for rank in per_rank) for i in range(len(per_rank[0]))]
    first = [rank[0] for rank in per_rank]
    return {"strategy": strategy, "t": layout.t, "tg": layout.tg,
            "bytes_per_rank": max(s["bytes_received"] for s in first),
            "formula_bytes_per_rank": round(formula_bytes_per_rank(strategy, layout, model_bytes)),
            "peak_param_bytes_per_rank": max(s["peak_param_bytes"] for s in first),
            "redundant_param_bytes": max(s["redundant_param_bytes"] for s in first),
            "seconds": round(statistics.median(seconds), 4)}


def _goal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout where ours moves bytes: our speed-up over DS-Chat against (DS-Chat bytes / our bytes) x 0.5."""
    checks = []
    for ours in (r for r in rows if r["strategy"] == "hybridflow" and r["bytes_per_rank"] > 0):
        ds = next(r for r in rows if r["strategy"] == "ds_chat" and (r["t"], r["tg"]) == (ours["t"], ours["tg"]))
        required = ds["bytes_per_rank"] / ours["bytes_per_rank"] * 0.5
        speedup = ds["seconds"] / ours["seconds"]
        checks.append({"t": ours["t"], "tg": ours["tg"], "speedup_vs_ds_chat": round(speedup, 2),
                       "required": round(required, 2), "met": speedup >= required})
    return checks
