"""Moving the actor's weights between the training layout (TP ``t``) and the generation layout (TP ``tg``).

Every TP-sharded weight is handled as a matrix whose rows are the split dimension (the weight for
column-parallel layers, its transpose for row-parallel ones), so a gathered block of shards is one
contiguous buffer and a generation weight is a *view* of it: nothing is re-laid out or copied.

- ``hybridflow`` (the paper's 3D-HybridEngine): all-gather inside the micro-DP group into a buffer
  of ``t / tg`` shards; the training shard is moved *into* its slot of that buffer (no second
  copy: zero redundancy). Back to training, the slot is copied out and the buffer dropped: no
  bytes move between ranks.
- ``hybridflow_v``: all-gather the whole model inside the training TP group, keep the training
  shard beside it, slice the generation shard out of the full copy.
- ``ds_chat``: every rank holds a ZeRO-3 style 1/world flat partition and all-gathers the full
  model over all ranks; generation runs on the full replica.

Replicated weights (norms) are shared between the two models and never move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridflow_lab.hybrid.layout import STRATEGIES, ParallelLayout
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.tensor_parallel import TensorParallel, split_dim

Gathered = tuple[int, Any]  # (bytes this rank receives, the pending collective or None)


@dataclass(frozen=True)
class TransitionStats:
    """One transition on one rank: bytes received, parameter bytes held at the peak, bytes held twice, seconds."""

    direction: str
    bytes_received: int
    peak_param_bytes: int
    redundant_param_bytes: int
    seconds: float


@dataclass(frozen=True)
class Groups:
    """The process groups a strategy needs, each containing this rank (None where unused)."""

    micro_dp: Any = None
    training_tp: Any = None
    generation_tp: Any = None
    world: Any = None


def all_gather_rows(output: torch.Tensor, shard: torch.Tensor, group: Any) -> Any:
    """Start gathering every rank's ``shard`` into ``output`` in rank order along dim 0; returns the pending work.

    torch 2.13 names this collective ``all_gather_single`` and deprecates ``all_gather_into_tensor``; torch 2.11,
    the lent GPU machines' torch, has only the older name.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=True)


def process_groups(device_mesh: Any) -> Groups:
    """The groups of ``ParallelLayout.meshes()``, from a worker's ``device_mesh(name)`` accessor."""
    return Groups(micro_dp=device_mesh("regroup").get_group("micro_dp"),
                  training_tp=device_mesh("train").get_group("tp"),
                  generation_tp=device_mesh("generate").get_group("tp"), world=dist.group.WORLD)


def as_rows(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The weight as a matrix whose rows are its TP split dimension (a view)."""
    return weight.t() if split_dim(name) == 1 else weight


def from_rows(rows: torch.Tensor, name: str) -> torch.Tensor:
    return rows.t() if split_dim(name) == 1 else rows


def param_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class Resharder:
    """Switches one rank's actor between ``train_model`` (TP ``layout.t``) and a generation model (TP ``layout.tg``).

    ``to_generation()`` returns the generation model, whose sharded weights are views of freshly
    gathered buffers; ``to_training()`` releases them. Both return ``TransitionStats``.
    """

    def __init__(self, train_model: DecoderLM, layout: ParallelLayout, rank: int, groups: Groups,
                 strategy: str = "hybridflow") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
        self.train_model, self.layout, self.rank, self.groups, self.strategy = \
            train_model, layout, rank, groups, strategy
        self.sharded = {n: p for n, p in train_model.named_parameters() if split_dim(n) is not None}
        generation_tp = 1 if strategy == "ds_chat" else layout.tg
        tp = TensorParallel(generation_tp, layout.generation_tp_rank(rank) if generation_tp > 1 else 0,
                            groups.generation_tp)
        with torch.device("meta"):
            self.generation_model = DecoderLM(train_model.config, tp)
        self._share_replicated()
        self._buffers: dict[str, torch.Tensor] = {}
        self._partitions: dict[str, torch.Tensor] = {}  # ds_chat's ZeRO-3 training state
        self._full_shapes: dict[str, torch.Size] = {}

    def _share_replicated(self) -> None:
        for name, param in self.train_model.named_parameters():
            if name not in self.sharded:
                self._set_generation_tensor(name, param.data)
        for name, buffer in self.train_model.named_buffers():
            self._set_generation_tensor(name, buffer)

    def _set_generation_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Point the generation model's parameter (or buffer) ``name`` at ``tensor`` (no copy)."""
        prefix, attr = name.rsplit(".", 1)
        module = self.generation_model.get_submodule(prefix)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor

    # ------------------------------------------------------------------ transitions
    def to_generation(self) -> tuple[DecoderLM, TransitionStats]:
        if self.strategy == "ds_chat":
            self._partition_for_zero3()
        start = time.perf_counter()
        received, pending = 0, []
        for name, param in self.sharded.items():  # collectives are queued back to back, then awaited
            moved, work = getattr(self, f"_gather_{self.strategy}")(name, param)
            received += moved
            pending += [work] if work is not None else []
        for work in pending:
            work.wait()
        for name in self.sharded:
            self._set_generation_tensor(name, from_rows(self._generation_rows(name), name))
        stats = TransitionStats("to_generation", received, self._held_bytes(), self._redundant_bytes(),
                                time.perf_counter() - start)
        return self.generation_model, stats

    def to_training(self) -> TransitionStats:
        start = time.perf_counter()
        if self.strategy == "hybridflow":  # the training shard lives in its buffer slot: copy it out, drop the rest
            for param in self.sharded.values():
                param.data = param.data.clone(memory_format=torch.contiguous_format)
        for name, param in self.sharded.items():  # the generation model lets go of the gathered buffers
            self._set_generation_tensor(name, torch.empty(0, dtype=param.dtype, device=param.device))
        self._buffers.clear()
        return TransitionStats("to_training", 0, self._held_bytes(), self._redundant_bytes(),
                               time.perf_counter() - start)

    # ------------------------------------------------------------------ strategies
    def _gather_hybridflow(self, name: str, param: torch.nn.Parameter) -> Gathered:
        shard = as_rows(param.data, name)
        dg, slot = self.layout.dg, self.rank % self.layout.dg
        buffer = torch.empty((dg * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        mine = buffer.chunk(dg)[slot]
        mine.copy_(shard)
        param.data = from_rows(mine, name)  # the training shard now lives inside the buffer
        self._buffers[name] = buffer
        if dg == 1:
            return 0, None
        # this rank's input is its own slot of the output: gathering writes the other slots around it
        work = all_gather_rows(buffer, mine, self.groups.micro_dp)
        return (dg - 1) * shard.numel() * shard.element_size(), work

    def _gather_hybridflow_v(self, name: str, param: torch.nn.Parameter) -> Gathered:
        shard = as_rows(param.data, name).contiguous()
        t = self.layout.t
        buffer = torch.empty((t * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        self._buffers[name] = buffer
        work = all_gather_rows(buffer, shard, self.groups.training_tp)
        return (t - 1) * shard.numel() * shard.element_size(), work

    def _gather_ds_chat(self, name: str, param: torch.nn.Parameter) -> Gathered:
        partition = self._partitions[name]
        world = self.layout.world_size
        flat = torch.empty(world * partition.numel(), dtype=partition.dtype, device=partition.device)
        shape = self._full_shapes[name]
        self._buffers[name] = flat[: shape.numel()].view(shape)
        work = all_gather_rows(flat, partition, self.groups.world)
        return (world - 1) * partition.numel() * partition.element_size(), work

    def _partition_for_zero3(self) -> None:
        """This rank's 1/world flat slice of every full weight: DeepSpeed-Chat's ZeRO-3 training state, emulated
        from the current TP shards (one all-gather in the training TP group, not counted as the transition's)."""
        world = self.layout.world_size
        for name, param in self.sharded.items():
            self._gather_hybridflow_v(name, param)[1].wait()
            full = self._buffers.pop(name)
            self._full_shapes[name] = full.shape
            flat = full.flatten()
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
