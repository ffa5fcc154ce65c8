"""The actor's hybrid engine: which weights generation runs on, and the transitions that put them there.

Three cases, chosen from the config:

- **in place**: training and generation use the same layout (``t == tg``) and the training
  engine keeps whole weights (torch, ZeRO-1/2): generation runs on the training model; nothing moves.
- **reshard**: the ``Resharder`` switches the training shards (TP ``t``) to generation shards (TP
  ``tg``) with ``rollout.reshard``'s strategy before each generation, and back after it.
- **gathered copy**: ZeRO-3 and FSDP hold 1/N of every weight; after each update the full weights
  are gathered into a separate generation model (DeepSpeed-Chat's scheme). vLLM is always fed
  this way: its engine holds its own copy of the weights. An actor trained with LoRA adapters is
  too: the copy gets the merged weights (``W + s B A``), so generation runs at the plain model's speed.

Every transition that moves or gathers weights is recorded as a ``transfer`` span with the bytes
this rank received, the parameter bytes it held at the peak and the bytes held twice; a sync into
a generation copy is the ``weight_sync`` span (tensors, bytes, seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller.memory import device_used_mib
from hybridflow_lab.controller.mesh import Mesh
from hybridflow_lab.engines.train_base import TrainEngine
from hybridflow_lab.engines.weight_fingerprint import check_fingerprints, fingerprints, tensor_fingerprint
from hybridflow_lab.hybrid.layout import ParallelLayout
from hybridflow_lab.hybrid.reshard import Groups, Resharder, TransitionStats
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.lora import has_adapters, merged_weights
from hybridflow_lab.telemetry import Phase

READ_BACK_RTOL = 1e-9  # a copy read back is exact: float64 sums in the same order
SpanFn = Callable[..., AbstractContextManager[dict[str, Any]]]
WeightSink = Callable[[Iterable[tuple[str, torch.Tensor]]], Mapping[str, Any]]


def actor_layout(config: LabConfig) -> ParallelLayout:
    """The actor's training (TP ``actor.engine.tensor_parallel``, ``pipeline_parallel`` stages) and generation (TP
    ``rollout.tensor_parallel``, one stage: the generation engines hold every layer) layouts over its
    ``actor.ranks``. vLLM is fed full weights and shards them itself: its layout has ``tg`` 1."""
    t, p = config.actor.engine.tensor_parallel, config.actor.engine.pipeline_parallel
    tg = 1 if config.rollout.engine == "vllm" else config.rollout.tensor_parallel
    return ParallelLayout(t=t, p=p, tg=tg, d=config.actor.ranks // (t * p))


def actor_meshes(config: LabConfig) -> dict[str, Mesh]:
    """The named meshes the actor's worker group needs (``train``, ``generate``, ``regroup``).

    vLLM's tensor parallelism across the actor's ranks (its external launcher) groups consecutive ranks,
    so with vLLM the generation mesh is ``ranks / tg`` replicas of ``tg`` consecutive ranks.
    """
    meshes = actor_layout(config).meshes()
    if config.rollout.engine == "vllm":
        tg = config.rollout.tensor_parallel
        meshes["generate"] = Mesh.of(dp=config.actor.ranks // tg, tp=tg)
    return meshes


def weights_whole(config: LabConfig) -> bool:
    """Whether every rank's training engine holds whole (possibly TP-sharded) weights it can generate with."""
    engine = config.actor.engine
    return engine.backend == "torch" or (engine.backend == "deepspeed" and engine.zero_stage < 3)


class HybridEngine:
    """Puts the actor's current weights where one generation on this rank needs them.

    ``load_copy`` receives the full weights as a stream of ``(name, tensor)`` in the gathered-copy case
    (vLLM's weight update) and returns the sync's numbers; without it the built-in engine gets its own
    copy model. ``copy_discarded`` says the copy loses its weights after each generation (vLLM's level-2
    sleep), so that every generation syncs first. ``model`` is what the built-in engine runs.
    """

    def __init__(self, config: LabConfig, engine: TrainEngine, rank: int, groups: Callable[[], Groups],
                 span: SpanFn, load_copy: WeightSink | None = None, copy_discarded: bool = False) -> None:
        self.layout, self.engine, self.span = actor_layout(config), engine, span
        self.adapted = has_adapters(engine.model)
        self.whole = weights_whole(config) and not self.adapted  # adapters merge into a copy
        self.gather_ways = self.layout.t * self.layout.p if weights_whole(config) else config.actor.ranks  # sources
        self.resharder: Resharder | None = None
        self.model: DecoderLM | None = None
        self.load_copy: WeightSink | None = None
        if load_copy is None and self.whole and (self.layout.dg > 1 or config.rollout.reshard != "hybridflow"):
            self.resharder = Resharder(engine.model, self.layout, rank, groups(), config.rollout.reshard)
            self.model = self.resharder.generation_model
        elif load_copy is None and self.whole:
            self.model = engine.model
        elif load_copy is None:  # the built-in engine on a gathered copy, in the training dtype
            dtype = torch.bfloat16 if config.actor.engine.bf16 else torch.float32
            self.model = load_causal_lm(config.actor.model_path, impl=config.actor.model_impl).to(engine.device, dtype)
            self.load_copy = state_dict_sink(self.model, config.rollout.verify_weight_sync)
        else:
            self.load_copy = load_copy
        self.stale = False
        self.copy_discarded = copy_discarded

    def weights_changed(self) -> None:
        """An update or a checkpoint load replaced the training weights."""
        self.stale = True

    @contextmanager
    def generating(self) -> Iterator[DecoderLM | None]:
        """The generation model, valid inside the block (collective on entry and exit when resharding)."""
        if self.resharder is None:
            self._refresh_copy()
            try:
                with self._training_state_offloaded():
                    yield self.model
            finally:
                self.stale = self.stale or self.copy_discarded
            return
        strategy = self.resharder.strategy
        with self.span("reshard_to_generation", phase=Phase.TRANSFER) as attrs:
            attrs.update(transition_attrs(self.resharder.to_generation()[1], strategy))
        try:
            yield self.model
        finally:
            with self.span("reshard_to_training", phase=Phase.TRANSFER) as attrs:
                attrs.update(transition_attrs(self.resharder.to_training(), strategy))

    @contextmanager
    def _training_state_offloaded(self) -> Iterator[None]:
        """The training engine's state in host memory while a separate generation copy runs (CUDA only: on the
        CPU there is no device memory to free); nothing moves when generation runs on the training weights."""
        if self.load_copy is None or not self.engine.device.startswith("cuda"):
            yield
            return
        with self.span("offload_training", phase=Phase.TRANSFER) as attrs:
            used = device_used_mib(self.engine.device)
            self.engine.offload()
            attrs["device_freed_mib"] = round(used - device_used_mib(self.engine.device), 1)
        try:
            yield
        finally:
            with self.span("reload_training", phase=Phase.TRANSFER):
                self.engine.reload()

    def _refresh_copy(self) -> None:
        """Gather the full weights into the generation copy if they changed (collective for ZeRO-3 and FSDP)."""
        if self.load_copy is None or not self.stale:
            return
        with self.span("weight_sync", phase=Phase.TRANSFER) as attrs:
            weights = self.engine.full_weights()
            stats = self.load_copy(merged_weights(weights, self.engine.model) if self.adapted else weights)
            full = stats["copied_bytes"]
            attrs.update(stats, bytes_moved=full - full // self.gather_ways)
        self.stale = False


def state_dict_sink(model: torch.nn.Module, verify: bool = False) -> WeightSink:
    """Copies a weight stream into ``model`` (the built-in engine's generation copy) tensor by tensor, cast to
    the copy's dtype and device, so that only the tensor in flight exists twice; every tensor must arrive. With
    ``verify`` the copy's weights are fingerprinted against what arrived (``check_seconds`` in the numbers)."""
    targets = model.state_dict()  # the copy's own parameters and buffers, not copies of them

    @torch.no_grad()
    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        arrived, expected, copied = set(), {}, 0
        for name, tensor in weights:
            if name not in targets:
                raise KeyError(f"the weight stream sent {name!r}, which the generation model does not have")
            targets[name].copy_(tensor)
            arrived.add(name)
            if verify:
                expected[name] = tensor_fingerprint(tensor, targets[name].dtype)
            copied += tensor.numel() * tensor.element_size()
        if missing := sorted(targets.keys() - arrived):
            raise KeyError(f"the weight stream did not send {len(missing)} tensor(s) of the generation model, "
                           f"first {missing[0]!r}")
        stats: dict[str, Any] = {"tensors": len(arrived), "copied_bytes": copied}
        if verify:
            start = time.perf_counter()
            check_fingerprints(expected, fingerprints(targets), READ_BACK_RTOL)
            stats["check_seconds"] = round(time.perf_counter() - start, 6)
        return stats

    return load


def transition_attrs(stats: TransitionStats, strategy: str) -> dict[str, Any]:
    """A transition's numbers as span attributes (``bytes_moved`` is the tensor-parallel weights' bytes this rank
    received, Table 2's; ``replicated_bytes_moved`` the other stages' norms)."""
    return {"bytes_moved": stats.bytes_received, "replicated_bytes_moved": stats.replicated_bytes_received,
            "strategy": strategy, "peak_param_bytes": stats.peak_param_bytes,
            "redundant_param_bytes": stats.redundant_param_bytes, "seconds": round(stats.seconds, 6)}
