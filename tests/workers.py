"""Worker classes used by the controller tests."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Dispatch, Execute, Worker, register, register_dispatch_mode

# a user-registered transfer protocol: same call on every rank, results in reverse rank order
REVERSED = register_dispatch_mode(
    "REVERSED_TEST",
    lambda layout, args, kwargs: [(args, kwargs)] * layout.world_size,
    lambda layout, outputs: outputs[::-1],
)


class Echo(Worker):
    """Reports where each rank is and what it received."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "tag": self.tag, "pid": os.getpid(),
                "distributed": self.distributed}

    @register(Dispatch.ONE_TO_ALL, execute=Execute.RANK_ZERO)
    def rank_zero_only(self, value: int) -> tuple[int, int]:
        return self.rank, value

    @register(Dispatch.ALL_TO_ALL)
    def per_rank(self, value: int) -> tuple[int, int]:
        return self.rank, value

    @register(Dispatch.DP_COMPUTE)
    def scale(self, batch: DataBatch, factor: float = 2.0) -> DataBatch:
        """Multiply ``x`` by ``factor`` and tag every row with this rank."""
        self.calls += 1
        out = DataBatch({"y": batch["x"] * factor, "rank": torch.full((len(batch),), self.rank)})
        out.meta["rank"] = self.rank
        return out

    @register(Dispatch.DP_COMPUTE)
    def expand(self, batch: DataBatch, n: int) -> DataBatch:
        """n output rows per input row (like n samples per prompt)."""
        return batch.repeat(n)

    @register(Dispatch.DP_COMPUTE)
    def mutate_input(self, batch: DataBatch) -> DataBatch:
        batch["x"].add_(100)
        return batch

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def scale_async(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"x": batch["x"] * 10, "producer_rank": torch.full((len(batch),), self.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def count_rows(self, batch: DataBatch) -> int:
        return len(batch)

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} was told to fail")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def placement_group(self) -> str:
        """The Ray placement group (the resource pool's reservation) this rank runs in."""
        import ray

        return ray.get_runtime_context().get_placement_group_id()

    @register(REVERSED)
    def rank_again(self) -> int:
        return self.rank

    @register(Dispatch.DP_COMPUTE)
    def timed(self, batch: DataBatch) -> DataBatch:
        with self.span("inner", bytes_moved=123, note="hello"):
            out = DataBatch({"x": batch["x"] + 1})
        return out


class MeshWorker(Worker):
    """Reports its mesh coordinates; used for MESH dispatch and process-group tests."""

    @register(Dispatch.MESH("train"))
    def tag_rows(self, batch: DataBatch) -> DataBatch:
        coords = self.mesh_coords("train")
        n = len(batch)
        return DataBatch({
            "x": batch["x"],
            "rank": torch.full((n,), self.rank),
            "dp": torch.full((n,), coords["dp"]),
            "tp": torch.full((n,), coords.get("tp", 0)),
            "pp": torch.full((n,), coords.get("pp", 0)),
        })

    @register(Dispatch.MESH("train"))
    def tp_sum(self, batch: DataBatch) -> DataBatch:
        """All-reduce over the tp axis: every row becomes x * (sum of tp ranks + tp size)."""
        group = self.device_mesh("train").get_group("tp")
        factor = torch.tensor([float(self.mesh_coords("train")["tp"] + 1)])
        dist.all_reduce(factor, group=group)
        return DataBatch({"x": batch["x"] * factor})

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(tensor)
        return tensor.item()


    @register(Dispatch.ONE_TO_ALL)
    def fail_while_peers_reduce(self, rank: int) -> float:
        if self.rank == rank:
            raise RuntimeError("gave up before the all-reduce")
        value = torch.ones(1)
        dist.all_reduce(value)  # never completes: the failed rank does not join
        return value.item()

    @register(Dispatch.ONE_TO_ALL)
    def die_while_peers_raise(self, rank: int) -> None:
        """``rank``'s process ends; the others fail at once, as a collective does when a peer's connection closes
        (gloo notices sooner than Ray reports the death)."""
        if self.rank == rank:
            os._exit(1)
        raise ConnectionError("connection closed by peer")


class Actor(Worker):
    """One of two colocated roles; both report their process id."""

    def __init__(self, weight: float) -> None:
        self.weight = weight

    @register(Dispatch.DP_COMPUTE)
    def act(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"y": batch["x"] * self.weight, "pid": torch.full((len(batch),), os.getpid())})


class Ref(Worker):
    @register(Dispatch.DP_COMPUTE)
    def ref(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"z": -batch["x"], "pid": torch.full((len(batch),), os.getpid())})


class Consumer(Worker):
    """Reads batches produced by another group."""

    @register(Dispatch.DP_COMPUTE)
    def consume(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"x": batch["x"] + 1, "consumer_rank": torch.full((len(batch),), self.rank),
                          "producer_rank": batch["producer_rank"]})


class BrokenInit(Worker):
    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("cannot start rank 1")

    @register()
    def nothing(self) -> None:
        return None
