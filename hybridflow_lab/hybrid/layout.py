"""Training layout p-t-d and generation layout pg-tg-dg-d over one set of ranks (paper section 5.2).

Ranks are in Megatron order: tensor-parallel peers are consecutive, then data-parallel replicas.
Within each training TP group of ``t`` ranks, the paper's regrouping puts **micro-DP groups on
consecutive ranks** (size ``dg = t / tg``) and **generation TP groups on strided ranks** (stride
``dg``), so the generation shard of a rank is the concatenation of its micro-DP group's training
shards, in rank order: one all-gather inside the micro-DP group is the whole transition.

Pipeline parallelism is not supported here: ``p = pg = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow_lab.config.schema import RESHARD_STRATEGIES as STRATEGIES
from hybridflow_lab.controller.mesh import Mesh


@dataclass(frozen=True)
class HybridLayout:
    """``t`` training TP size, ``d`` training DP size, ``tg`` generation TP size (``tg`` divides ``t``)."""

    t: int
    tg: int
    d: int = 1

    def __post_init__(self) -> None:
        for name in ("t", "tg", "d"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.t % self.tg:
            raise ValueError(f"generation TP {self.tg} must divide training TP {self.t}; use one of "
                             f"{[g for g in range(1, self.t + 1) if self.t % g == 0]}")

    @property
    def dg(self) -> int:
        """Micro data-parallel size: generation replicas inside one training TP group."""
        return self.t // self.tg

    @property
    def world_size(self) -> int:
        return self.t * self.d

    def training_mesh(self) -> Mesh:
        """dp x tp, tensor-parallel peers consecutive."""
        return Mesh.of(dp=self.d, tp=self.t)

    def generation_mesh(self) -> Mesh:
        """dp x tp for generation: ``d * dg`` replicas of ``tg`` strided ranks each."""
        order = [replica * self.t + tp * self.dg + micro
                 for replica in range(self.d) for micro in range(self.dg) for tp in range(self.tg)]
        return Mesh((("dp", self.d * self.dg), ("tp", self.tg)), ranks=tuple(order))

    def regroup_mesh(self) -> Mesh:
        """``micro_dp`` groups: ``dg`` consecutive ranks each."""
        return Mesh.of(block=self.world_size // self.dg, micro_dp=self.dg)

    def meshes(self) -> dict[str, Mesh]:
        """The named meshes a worker group of the actor needs: ``train``, ``generate``, ``regroup``."""
        return {"train": self.training_mesh(), "generate": self.generation_mesh(), "regroup": self.regroup_mesh()}

    def micro_dp_groups(self) -> list[list[int]]:
        """Consecutive ranks whose training shards make up one generation shard."""
        return self.regroup_mesh().groups("micro_dp")

    def generation_tp_groups(self) -> list[list[int]]:
        return self.generation_mesh().groups("tp")

    def training_tp_groups(self) -> list[list[int]]:
        return self.training_mesh().groups("tp")

    def training_tp_rank(self, rank: int) -> int:
        """Which training shard ``rank`` holds: its position in its training TP group."""
        return rank % self.t

    def generation_tp_rank(self, rank: int) -> int:
        """Which generation shard ``rank`` holds: its micro-DP group's position in its training TP group."""
        return self.training_tp_rank(rank) // self.dg


def formula_bytes_per_rank(strategy: str, layout: HybridLayout, model_bytes: int) -> float:
    """The paper's Table 2 communication volume per rank for a training-to-generation transition."""
    t, tg, world = layout.t, layout.tg, layout.world_size
    if strategy == "hybridflow":
        return (t - tg) / (tg * t) * model_bytes
    if strategy == "hybridflow_v":
        return (t - 1) / t * model_bytes
    if strategy == "ds_chat":
        return (world - 1) / world * model_bytes
    raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
