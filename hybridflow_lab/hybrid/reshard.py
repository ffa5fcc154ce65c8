"""Moving the actor's weights between the training layout (stage of ``p``, TP ``t``) and the generation layout
(the whole model, TP ``tg``).

Every TP-sharded weight is handled as a matrix whose rows are the split dimension (the weight for
column-parallel layers, its transpose for row-parallel ones), so a gathered block of shards is one
contiguous buffer and a generation weight is a *view* of it: nothing is re-laid out or copied.
``hybrid.gather`` has the groups and buffers: all-gather inside the stage, then broadcast across stages.

- ``hybridflow`` (the paper's 3D-HybridEngine): gather inside the micro-DP group into buffers of ``t / tg``
  shards per weight; the training shard is moved *into* its slot of that buffer (no second copy: zero
  redundancy). Back to training, the slot is copied out and the buffers dropped: no bytes move between ranks.
- ``hybridflow_v``: gather the whole model inside the model replica (the training TP group, then the pipeline
  group), keep the training shard beside it, slice the generation shard out of the full copy.
- ``ds_chat``: every rank holds a ZeRO-3 style 1/world flat partition and all-gathers the full
  model over all ranks; generation runs on the full replica.

Replicated weights (norms) of the rank's own stage are shared between the two models and never move; those of
other stages are broadcast over the pipeline group (counted apart: Table 2's ``M`` is the TP-split weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_lab.hybrid.gather import Groups, all_gather_rows, owner_stages, process_groups, stage_buffers
from hybridflow_lab.hybrid.layout import STRATEGIES, ParallelLayout
from hybridflow_lab.models.decoder import DecoderLM, shard_model
from hybridflow_lab.models.pipeline import DecoderStage
from hybridflow_lab.models.tensor_parallel import TensorParallel, split_dim

__all__ = ["Groups", "Resharder", "TransitionStats", "process_groups", "training_shard"]  # the workers' imports


@dataclass(frozen=True, kw_only=True)
class TransitionStats:
    """One transition on one rank: bytes received (TP-split weights, and replicated weights of other stages),
    parameter bytes held at the peak, bytes held twice, seconds."""

    direction: str
    bytes_received: int
    replicated_bytes_received: int
    peak_param_bytes: int
    redundant_param_bytes: int
    seconds: float


def training_shard(full: DecoderLM, layout: ParallelLayout, rank: int, groups: Groups) -> DecoderLM | DecoderStage:
    """This rank's training model: its TP shard of ``full``, cut to its pipeline stage when ``layout.p > 1``."""
    model = shard_model(full, TensorParallel(layout.t, layout.training_tp_rank(rank), groups.training_tp))
    return DecoderStage(model, layout.training_stage(rank), layout.p) if layout.p > 1 else model


def as_rows(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The weight as a matrix whose rows are its TP split dimension (a view)."""
    return weight.t() if split_dim(name) == 1 else weight


def from_rows(rows: torch.Tensor, name: str) -> torch.Tensor:
    return rows.t() if split_dim(name) == 1 else rows


def param_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


class Resharder:
    """Switches one rank's actor between ``train_model`` (its stage ``layout.training_stage(rank)`` of ``layout.p``,
    TP ``layout.t``; a ``DecoderStage`` when ``p > 1``) and a generation model (the whole model, TP ``layout.tg``).

    ``to_generation()`` returns the generation model, whose sharded weights are views of freshly
    gathered buffers; ``to_training()`` releases them. Both return ``TransitionStats``.
    """

    def __init__(self, train_model: DecoderLM | DecoderStage, layout: ParallelLayout, rank: int, groups: Groups,
                 strategy: str = "hybridflow") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
        if layout.pg > 1:
            raise ValueError(f"pg={layout.pg}: the generation model is the whole model (the Lab's generation "
                             "engines do not pipeline); use pg=1")
        self.train_model, self.layout, self.rank, self.groups, self.strategy = \
            train_model, layout, rank, groups, strategy
        self.stage, shard = layout.training_stage(rank), layout.training_tp_rank(rank)
        self.train_params = dict(train_model.named_parameters())
        self.sharded = {n: p for n, p in self.train_params.items() if split_dim(n) is not None}
        generation_tp = 1 if strategy == "ds_chat" else layout.tg
        tp = TensorParallel(generation_tp, layout.generation_tp_rank(rank) if generation_tp > 1 else 0,
                            groups.generation_tp)
        with torch.device("meta"):
            self.generation_model = DecoderLM(train_model.config, tp)
        self.stages = owner_stages(self.generation_model, layout.p)
        self.shapes = {n: p.shape for n, p in self.generation_model.named_parameters()}
        # step 1 gathers ``slots`` training shards per weight (the generation shard's, or the whole stage's)
        self.slots = layout.t // layout.tg if strategy == "hybridflow" else layout.t
        self.slot = shard % self.slots
        self.stage_group = groups.micro_dp_stage if strategy == "hybridflow" else groups.training_tp
        replica = rank // (layout.t * layout.p)
        self.pipeline_ranks = [layout.rank(replica, stage, shard) for stage in range(layout.p)]
        self._share_own_replicated()
        self._buffers: dict[str, torch.Tensor] = {}
        self._partitions: dict[str, torch.Tensor] = {}  # ds_chat's ZeRO-3 training state

    @property
    def sharded_names(self) -> list[str]:
        """Every TP-split weight of the whole model, in its order (the same on every rank)."""
        return [n for n in self.shapes if split_dim(n) is not None]

    def _share_own_replicated(self) -> None:
        for name in self.shapes:
            if split_dim(name) is None and self.stages[name] == self.stage:
                self._set_generation_tensor(name, self.train_params[name].data)
        rotary = self.train_model.rotary if isinstance(self.train_model, DecoderStage) else \
            self.train_model.model.rotary
        self.generation_model.model.rotary = rotary

    def _set_generation_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Point the generation model's parameter ``name`` at ``tensor`` (no copy)."""
        prefix, attr = name.rsplit(".", 1)
        self.generation_model.get_submodule(prefix)._parameters[attr] = torch.nn.Parameter(tensor,
                                                                                           requires_grad=False)

    def _empty(self, shape: tuple[int, ...] | torch.Size | int) -> torch.Tensor:
        like = next(iter(self.sharded.values()))
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    # ------------------------------------------------------------------ transitions
    def to_generation(self) -> tuple[DecoderLM, TransitionStats]:
        if self.strategy == "ds_chat":
            self._partition_for_zero3()
        start = time.perf_counter()
        replicated, pending = self._broadcast_replicated()
        received = self._gather_partitions() if self.strategy == "ds_chat" else self._gather_stages()
        wait(pending)
        for name in self.sharded_names:
            self._set_generation_tensor(name, from_rows(self._generation_rows(name), name))
        stats = TransitionStats(direction="to_generation", bytes_received=received,
                                replicated_bytes_received=replicated, peak_param_bytes=self._held_bytes(),
                                redundant_param_bytes=self._redundant_bytes(), seconds=time.perf_counter() - start)
        return self.generation_model, stats

    def to_training(self) -> TransitionStats:
        start = time.perf_counter()
        if self.strategy == "hybridflow":  # the training shard lives in its buffer slot: copy it out, drop the rest
            for param in self.sharded.values():
                param.data = param.data.clone(memory_format=torch.contiguous_format)
        for name in self.shapes:  # the generation model lets go of everything it received
            if split_dim(name) is not None or self.stages[name] != self.stage:
                self._set_generation_tensor(name, self._empty(0))
        self._buffers.clear()
        return TransitionStats(direction="to_training", bytes_received=0, replicated_bytes_received=0,
                               peak_param_bytes=self._held_bytes(), redundant_param_bytes=self._redundant_bytes(),
                               seconds=time.perf_counter() - start)

    # ------------------------------------------------------------------ what moves
    def _broadcast_replicated(self) -> tuple[int, list[Any]]:
        """Start broadcasting each stage's replicated weights over the pipeline group from the rank holding them."""
        received, works = 0, []
        if self.layout.p == 1:
            return received, works
        for name, shape in self.shapes.items():
            if split_dim(name) is not None:
                continue
            stage = self.stages[name]
            tensor = self.train_params[name].data if stage == self.stage else self._empty(shape)
            if stage != self.stage:
                self._set_generation_tensor(name, tensor)
                received += tensor.nbytes
            works.append(dist.broadcast(tensor, src=self.pipeline_ranks[stage], group=self.groups.pipeline,
                                        async_op=True))
        return received, works

    def _gather_stages(self) -> int:
        """All-gather this stage's weights among its ``slots`` ranks (this rank's training shard in its slot;
        ``hybridflow``: moved there), then broadcast each stage's over the pipeline group; the bytes received."""
        flats, self._buffers = stage_buffers({n: self._gathered_rows(n) for n in self.sharded_names}, self.stages,
                                             self.layout.p, next(iter(self.sharded.values())))
        received, works = 0, []
        for name, param in self.sharded.items():
            rows = self._buffers[name]
            slot = rows.chunk(self.slots)[self.slot]
            slot.copy_(as_rows(param.data, name))
            if self.strategy == "hybridflow":
                param.data = from_rows(slot, name)  # the training shard now lives inside the buffer
            if self.slots > 1:  # this rank's input is its own slot of the output: gathering writes around it
                works.append(all_gather_rows(rows, slot, self.stage_group))
                received += rows.nbytes - slot.nbytes
        wait(works)
        if self.layout.p > 1:
            wait([dist.broadcast(flat, src=self.pipeline_ranks[stage], group=self.groups.pipeline, async_op=True)
                  for stage, flat in enumerate(flats)])
            received += sum(flat.nbytes for stage, flat in enumerate(flats) if stage != self.stage)
        return received

    def _rows(self, name: str) -> torch.Size:
        """The shape of ``name``'s generation weight as rows."""
        return as_rows(torch.empty(self.shapes[name], device="meta"), name).shape

    def _gathered_rows(self, name: str) -> tuple[int, ...]:
        """The shape of ``slots`` training shards of ``name`` as rows."""
        rows = self._rows(name)
        return (rows[0] * self.generation_model.tp.size * self.slots // self.layout.t, *rows[1:])

    def _gather_partitions(self) -> int:
        """All-gather every weight's partitions over the world; the bytes received."""
        world, received, works = self.layout.world_size, 0, []
        for name in self.sharded_names:
            partition = self._partitions[name]
            flat = self._empty(world * partition.numel())
            mine = flat.chunk(world)[self.rank]
            mine.copy_(partition)
            rows = self._rows(name)
            self._buffers[name] = flat[: rows.numel()].view(rows)
            works.append(all_gather_rows(flat, mine, self.groups.world))
            received += (world - 1) * partition.nbytes
        wait(works)
        return received

    def _partition_for_zero3(self) -> None:
        """This rank's 1/world flat slice of every full weight: DeepSpeed-Chat's ZeRO-3 training state, emulated
        from the model replica's training shards (gathered as ``hybridflow_v`` does, not counted as the
        transition's)."""
        world = self.layout.world_size
        self._gather_stages()
        for name in self.sharded_names:
            flat = self._buffers.pop(name).flatten()
            size = -(-flat.numel() // world)
            padded = torch.zeros(size * world, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            self._partitions[name] = padded[self.rank * size:(self.rank + 1) * size].clone()

    def _generation_rows(self, name: str) -> torch.Tensor:
        buffer = self._buffers[name]
        if self.strategy == "hybridflow_v":
            return buffer.chunk(self.layout.tg)[self.layout.generation_tp_rank(self.rank)]
        return buffer

    # ------------------------------------------------------------------ accounting
    def _training_state(self) -> list[torch.Tensor]:
        """The tensors holding this rank's training copy of the sharded weights."""
        if self.strategy == "ds_chat":
            return list(self._partitions.values())
        return [p.data for p in self.sharded.values()]

    def _held_bytes(self) -> int:
        """Parameter bytes this rank holds for the sharded weights (training state + gathered buffers)."""
        return param_bytes([*self._training_state(), *self._buffers.values()])

    def _redundant_bytes(self) -> int:
        """Bytes of the training state held a second time beside a gathered copy that contains them."""
        gathered = {b.untyped_storage().data_ptr() for b in self._buffers.values()}
        if not gathered:
            return 0
        return param_bytes([t for t in self._training_state() if t.untyped_storage().data_ptr() not in gathered])
