"""One model's 3D layout: training p-t-d and, for the actor, generation pg-tg-dg-d (paper section 5.2).

``ParallelLayout`` is the one layout type of the Lab: the placement's per-model sizes, the simulator's
parallel sizes and the hybrid engine's meshes.

Ranks are in Megatron order: tensor-parallel peers are consecutive, then data-parallel replicas.
Within each training TP group of ``t`` ranks, the paper's regrouping puts **micro-DP groups on
consecutive ranks** (size ``dg = t / tg``) and **generation TP groups on strided ranks** (stride
``dg``), so the generation shard of a rank is the concatenation of its micro-DP group's training
shards, in rank order: one all-gather inside the micro-DP group is the whole transition.

The simulator models pipeline stages (``p``); the hybrid engine's meshes do not yet: they need
``p = pg = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow_lab.config.batch_sizes import divisors
from hybridflow_lab.config.schema import RESHARD_STRATEGIES as STRATEGIES
from hybridflow_lab.controller.mesh import Mesh


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Training TP ``t``, pipeline ``p``, data parallel ``d``; generation TP ``tg`` and pipeline ``pg``.

    A generation shard is whole training shards: ``tg`` divides ``t`` and ``pg`` divides ``p``.
    Only the actor's generation sizes are read; another model's are ignored.
    """

    t: int = 1
    p: int = 1
    d: int = 1
    tg: int = 1
    pg: int = 1

    def __post_init__(self) -> None:
        for name in ("t", "p", "d", "tg", "pg"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: sizes are at least 1; use {name} >= 1")
        for generation, training in (("tg", "t"), ("pg", "p")):
            size, of = getattr(self, generation), getattr(self, training)
            if of % size:
                raise ValueError(f"{generation}={size} must divide {training}={of} (a generation shard is whole "
                                 f"training shards); use {generation} in {divisors(of)}")

    @property
    def dg(self) -> int:
        """Micro data-parallel size: generation replicas inside one training model replica (``t / tg`` when
        ``p = pg = 1``)."""
        return (self.t // self.tg) * (self.p // self.pg)

    @property
    def world_size(self) -> int:
        """The ranks (devices) the layout spans: ``t * p * d``."""
        return self.t * self.p * self.d

    def label(self) -> str:
        """``t8 p1 d2 tg2``: ``tg`` where it differs from ``t``, ``pg`` where it is not 1."""
        return f"t{self.t} p{self.p} d{self.d}" + (f" tg{self.tg}" if self.tg != self.t else "") + \
            (f" pg{self.pg}" if self.pg != 1 else "")

    def training_mesh(self) -> Mesh:
        """dp x tp, tensor-parallel peers consecutive."""
        self._check_single_stage()
        return Mesh.of(dp=self.d, tp=self.t)

    def generation_mesh(self) -> Mesh:
        """dp x tp for generation: ``d * dg`` replicas of ``tg`` strided ranks each."""
        self._check_single_stage()
        order = [replica * self.t + tp * self.dg + micro
                 for replica in range(self.d) for micro in range(self.dg) for tp in range(self.tg)]
        return Mesh((("dp", self.d * self.dg), ("tp", self.tg)), ranks=tuple(order))

    def regroup_mesh(self) -> Mesh:
        """``micro_dp`` groups: ``dg`` consecutive ranks each."""
        self._check_single_stage()
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

    def _check_single_stage(self) -> None:
        if self.p > 1 or self.pg > 1:
            raise ValueError(f"p={self.p}, pg={self.pg}: the hybrid engine has no pipeline stages yet; use p=1 and "
                             "pg=1 (the placement simulator models p > 1)")


def formula_bytes_per_rank(strategy: str, layout: ParallelLayout, model_bytes: int) -> float:
    """The paper's Table 2 communication volume per rank for a training-to-generation transition."""
    t, tg, world = layout.t, layout.tg, layout.world_size
    if strategy == "hybridflow":
        return (t - tg) / (tg * t) * model_bytes
    if strategy == "hybridflow_v":
        return (t - 1) / t * model_bytes
    if strategy == "ds_chat":
        return (world - 1) / world * model_bytes
    raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
