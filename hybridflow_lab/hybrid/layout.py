"""One model's 3D layout: training p-t-d and, for the actor, generation pg-tg-dg-d (paper section 5.2).

``ParallelLayout`` is the one layout type of the Lab: the placement's per-model sizes, the simulator's
parallel sizes and the hybrid engine's meshes.

Ranks are in Megatron order for ``p = 1``: tensor-parallel peers are consecutive, then data-parallel
replicas. The paper's regrouping puts **micro-DP groups on consecutive ranks** (size
``dg = (t / tg) * (p / pg)``: the training shards, across tensor shards and pipeline stages, that make
up one generation shard) and **generation groups on strided ranks** (stride ``dg``), so the generation
shard of a rank is its micro-DP group's training shards together: gathering inside the micro-DP group
is the whole transition. A rank's number is
``replica * t * p + (generation stage * tg + generation shard) * dg + (s % (p / pg)) * (t / tg) + k % (t / tg)``
for training stage ``s`` and training tensor shard ``k``; with ``p = 1`` it is Megatron's ``replica * t + k``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow_lab.config.batch_sizes import divisors
from hybridflow_lab.config.schema import RESHARD_STRATEGIES as STRATEGIES
from hybridflow_lab.controller.mesh import DP, PP, TP, Mesh


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

    def rank(self, replica: int, stage: int, shard: int) -> int:
        """The rank holding training stage ``stage`` and tensor shard ``shard`` of model replica ``replica``."""
        stages_in, shards_in = self.p // self.pg, self.t // self.tg
        generation = (stage // stages_in) * self.tg + shard // shards_in
        return replica * self.t * self.p + generation * self.dg + (stage % stages_in) * shards_in + shard % shards_in

    def training_mesh(self) -> Mesh:
        """pp x dp x tp over the regrouped ranks (``pp`` only where ``p > 1``; for ``p = 1``, Megatron's dp x tp)."""
        order = [self.rank(replica, stage, shard)
                 for stage in range(self.p) for replica in range(self.d) for shard in range(self.t)]
        axes = ((PP, self.p),) if self.p > 1 else ()
        return Mesh((*axes, (DP, self.d), (TP, self.t)), ranks=tuple(order))

    def generation_mesh(self) -> Mesh:
        """dp x pp x tp for generation: ``d * dg`` replicas of ``pg`` stages of ``tg`` strided ranks (``pp`` only
        where ``pg > 1``)."""
        stages_in, shards_in = self.p // self.pg, self.t // self.tg
        order = [self.rank(replica, stage * stages_in + micro // shards_in, shard * shards_in + micro % shards_in)
                 for replica in range(self.d) for micro in range(self.dg)
                 for stage in range(self.pg) for shard in range(self.tg)]
        axes = ((PP, self.pg),) if self.pg > 1 else ()
        return Mesh(((DP, self.d * self.dg), *axes, (TP, self.tg)), ranks=tuple(order))

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
        """Which training tensor shard ``rank`` holds."""
        return self.training_mesh().coord(rank, TP)

    def training_stage(self, rank: int) -> int:
        """Which training pipeline stage ``rank`` holds."""
        return self.training_mesh().coord(rank, PP)

    def generation_tp_rank(self, rank: int) -> int:
        """Which generation tensor shard ``rank`` holds: its micro-DP group's place in its generation TP group."""
        return self.generation_mesh().coord(rank, TP)

    def generation_stage(self, rank: int) -> int:
        """Which generation pipeline stage ``rank`` holds."""
        return self.generation_mesh().coord(rank, PP)


def formula_bytes_per_rank(strategy: str, layout: ParallelLayout, model_bytes: int) -> float:
    """The paper's Table 2 communication volume per rank for a training-to-generation transition: with pipeline
    stages, the mean over the ranks (stages differ in size, so ranks differ in what they receive)."""
    train, generation, world = layout.t * layout.p, layout.tg * layout.pg, layout.world_size
    if strategy == "hybridflow":
        return (train - generation) / (generation * train) * model_bytes
    if strategy == "hybridflow_v":
        return (train - 1) / train * model_bytes
    if strategy == "ds_chat":
        return (world - 1) / world * model_bytes
    raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
