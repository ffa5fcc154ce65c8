"""The training-engine interface shared by the torch, DeepSpeed and FSDP2 backends.

An engine owns a model wrapped for its backend, the optimizer and the learning-rate
schedule. An optimizer step is ``start_step``, then for each micro-batch a forward pass under
``accumulating`` and ``precision`` and a ``backward``, then ``step``: every micro-batch's loss
is a *sum* over its units (tokens or sequences) and is multiplied by the step's ``scale``, one
over the units of all micro-batches and all data-parallel ranks, so the gradient is exactly the
global mean whatever the split: the same as one process on the whole batch. ``train_step`` is
that loop for a loss function that returns its loss and metric sums.

Before the optimizer steps, a loss, metric or gradient norm that is NaN or infinite stops the
update with ``NonFiniteUpdate`` (or, with ``skip_nonfinite``, drops the step's gradients and
reports ``nonfinite_skipped``): the weights and optimizer state are never touched by it. A
backend that computes the norm inside its own step (DeepSpeed) checks it there and drops the
step itself; the engine then reports it the same way.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridflow_lab.config.schema import OptimConfig
from hybridflow_lab.engines.host_offload import HostCopies, offload_optimizer_state, reload_optimizer_state
from hybridflow_lab.engines.training_state import Moments, TrainingState
from hybridflow_lab.models.lora import trainable_names
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel, clip_grad_norm
from hybridflow_lab.protocol import DataBatch

# loss_fn(module, micro_batch) -> (loss summed over units, metrics summed over units)
LossFn = Callable[[nn.Module, DataBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
CountFn = Callable[[DataBatch], float]
MicroLossFn = Callable[[nn.Module, DataBatch], torch.Tensor]  # a micro-batch's loss summed over its units
TOKEN_COUNT = "tokens"  # the step's valid tokens, among the sums: what token means are divided by


class StepMetrics:
    """One optimizer step's metrics, added up over its micro-batches; ``TrainEngine.step`` reduces them over the
    data-parallel ranks. Sums in the loss's units (the loss, its terms) are reported as the step's mean, as the loss
    is; token means (clip fractions, KLs...) as means over the step's valid tokens whatever the loss's units;
    maxima as the largest value over valid tokens."""

    def __init__(self, units: float, scale: float) -> None:
        self.units = units  # the loss units of the step's micro-batches on all ranks
        self.scale = scale  # what a micro-batch's loss sum is multiplied by before ``TrainEngine.backward``
        self.sums: dict[str, torch.Tensor] = {}
        self.token_means: set[str] = set()
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        """A micro-batch's ``key`` summed over its loss units (``algorithms.losses.aggregate``)."""
        self.sums[key] = self.sums.get(key, 0.0) + value.detach().double()

    def add_token_means(self, values: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """A micro-batch's per-token ``values`` (``[rows, length]``, valid where ``mask``); once per micro-batch."""
        valid = mask.bool()
        for key, value in values.items():
            self.add(key, value[valid].sum())
            self.token_means.add(key)
        self.add(TOKEN_COUNT, valid.sum().double())

    def add_max(self, key: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """A micro-batch's non-negative per-token ``values``, of which the step reports the largest valid one."""
        value = torch.where(mask.bool(), values, torch.zeros_like(values)).max()
        self.maxima[key] = torch.maximum(self.maxima.get(key, value), value).detach().double()

    def result(self, sums: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's metrics from its ``sums`` and ``maxima`` reduced over the ranks."""
        per_unit = {k: float(v) / self.units for k, v in sums.items()}
        tokens = per_unit.pop(TOKEN_COUNT, None)
        # token sums and the token count are both per loss unit, so their ratio is a token mean
        means = {k: v / tokens if k in self.token_means else v for k, v in per_unit.items()}
        return {**means, **{k: float(v) for k, v in maxima.items()}}


def build_optimizer(params: Iterator[nn.Parameter], config: OptimConfig, device: str) -> torch.optim.Optimizer:
    """A torch AdamW for an engine on ``device``. On the CPU its fused kernel: one pass over each tensor, 4-5x faster
    than the default ``foreach`` one, whose temporaries take a pass each. On a GPU ``foreach``, as before: fused
    AdamW keeps its step counts on the parameters' device, where the engines' state movers expect the CPU."""
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, fused=torch.device(device).type == "cpu" or None)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class NonFiniteUpdate(RuntimeError):
    """A training step whose loss, metrics or gradient norm are NaN or infinite; nothing was applied."""


class TrainEngine(ABC):
    """A model being trained with one backend; ``module`` is what to call for a forward pass."""

    name = "base"
    state_on_host = False  # an engine configured to offload keeps its state in host memory already

    def __init__(self, group: dist.ProcessGroup | None = None, device: str = "cpu") -> None:
        self.group = group
        self.device = device
        self.dp_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.global_step = 0

    module: nn.Module

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The unwrapped model (its ``config``, its parameter names)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Add ``loss``'s gradients to the step's (a micro-batch's loss sum times ``StepMetrics.scale``)."""

    @abstractmethod
    def _clip_gradients(self) -> float | None:
        """Clip by the global norm and return it; None where the backend clips inside its own step."""

    @abstractmethod
    def _optimizer_step(self, clipped_norm: float | None) -> float:
        """Step the optimizer and the schedule, zero the gradients; returns the gradient norm. A backend that
        checks the norm inside its step returns a non-finite norm when it dropped the step instead."""

    @abstractmethod
    def _discard_gradients(self) -> None:
        """Drop the accumulated gradients without stepping."""

    def accumulating(self, last: bool) -> AbstractContextManager[Any]:
        """Context for one micro-batch's forward and backward; non-last ones may skip the gradient all-reduce."""
        return nullcontext()

    def precision(self) -> AbstractContextManager[Any]:
        """Context for forward passes: autocast where the engine runs mixed precision itself."""
        return nullcontext()

    @abstractmethod
    def _offload(self) -> None:
        """Move weights, gradients and optimizer state off the device."""

    @abstractmethod
    def _reload(self) -> None:
        """Bring back what ``_offload`` moved."""

    def offload(self) -> None:
        """Move the weights, gradients and optimizer state to host memory and free their device memory (verl's
        offload around generation, when the rollout engine holds its own copy of the weights); ``reload`` brings
        them back. Nothing moves for an engine whose state is already on the host; on the CPU the state is copied
        into the host buffers all the same (the hybrid engine only offloads on CUDA; tests run it here)."""
        if not self.state_on_host:
            self._offload()
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()  # hand the freed blocks back, so that vLLM's allocator can take them

    def reload(self) -> None:
        """Undo ``offload``."""
        if not self.state_on_host:
            self._reload()

    @abstractmethod
    def current_lr(self) -> float: ...

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on every rank, e.g. for a rollout engine; collective."""

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights as a stream of ``(name, tensor)``, the same on every rank; collective, so every rank
        must consume it whole. Sharded engines gather one module at a time: a consumer that copies each
        tensor away (a rollout engine's weight sync) never holds a second full copy."""
        yield from self.full_state_dict().items()

    def training_state(self) -> TrainingState:
        """The trained weights, optimizer state and schedule as full tensors any engine continues from
        (``engines.training_state``); collective, whole on rank 0."""
        return TrainingState(self._trained_weights(), self._full_moments(), self.scheduler.state_dict(),
                             self.global_step)

    def load_training_state(self, state: TrainingState) -> None:
        """Continue with ``state``'s optimizer state and schedule; its weights went into the model before this
        engine was built (``build_train_engine(..., state=)``). Collective."""
        self._load_moments(state.moments)
        self.scheduler.load_state_dict(state.scheduler)
        self.global_step = state.global_step
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # a loaded schedule sets the rate at its next step; this step needs it already

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        trained = trainable_names(self.model)
        return {name: tensor.cpu() for name, tensor in self.full_weights() if name in trained}

    @abstractmethod
    def _full_moments(self) -> Moments:
        """The optimizer state of every trained parameter, full tensors by parameter name; collective."""

    @abstractmethod
    def _load_moments(self, moments: Moments) -> None:
        """Make ``moments`` (``_full_moments``'s form) this engine's optimizer state, sharded as it shards."""

    @abstractmethod
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Weights, optimizer and schedule state under ``path`` (a directory); collective."""

    @abstractmethod
    def load_checkpoint(self, path: str | os.PathLike[str]) -> None: ...

    # ------------------------------------------------------------------ shared logic
    @torch.no_grad()
    def infer(self, micro_batches: Sequence[DataBatch], fn: Callable[[nn.Module, DataBatch], Any]) -> list[Any]:
        """``fn(module, micro_batch)`` for each micro-batch without gradients (log-probs, values)."""
        was_training = self.module.training
        self.module.eval()
        try:
            with self.precision():
                return [fn(self.module, mb) for mb in micro_batches]
        finally:
            self.module.train(was_training)

    def start_step(self, units: float) -> StepMetrics:
        """Begin an optimizer step whose micro-batches hold ``units`` loss units (tokens or sequences) on this rank;
        collective, the step's units are all ranks'. Returns the step's metrics and its loss ``scale``."""
        self.module.train()
        # a CPU float64 count: its all-reduce stays on gloo (NCCL groups are "cpu:gloo,cuda:nccl")
        local = torch.tensor(float(units), dtype=torch.float64, device="cpu")
        total = float(self._reduce({"units": local}, dist.ReduceOp.SUM)["units"])
        if total <= 0:
            raise ValueError("train_step: the micro-batches hold no units to average over (empty masks?)")
        return StepMetrics(total, self.dp_size / total)

    def step(self, metrics: StepMetrics, skip_nonfinite: bool = False, apply: bool = True) -> dict[str, float]:
        """End the step: the global metrics, the gradient norm, the lr and ``nonfinite_skipped`` (1 when the step
        was dropped for NaN/inf; see the module docstring). ``apply=False`` computes the same numbers, the gradient
        norm before clipping included, and leaves the weights and the schedule as they were (an engine that takes
        the norm inside its optimizer step, DeepSpeed, cannot)."""
        lr = self.current_lr()
        result = metrics.result(self._reduce(metrics.sums, dist.ReduceOp.SUM),
                                self._reduce(metrics.maxima, dist.ReduceOp.MAX))
        norm = self._clip_gradients()
        if not apply:
            if norm is None:
                raise NotImplementedError(f"the {self.name} engine takes the gradient norm inside its optimizer "
                                          "step, so it cannot compute a step without applying it")
            self._discard_gradients()
            return {**result, "grad_norm": norm, "lr": lr, "nonfinite_skipped": 0.0}
        bad = {k: v for k, v in {**result, "grad_norm": norm}.items() if v is not None and not math.isfinite(v)}
        if bad:
            self._discard_gradients()
            return self._not_applied(bad, result, norm, lr, skip_nonfinite)
        grad_norm = self._optimizer_step(norm)
        if not math.isfinite(grad_norm):  # the backend checked the norm inside its step and dropped the step
            return self._not_applied({"grad_norm": grad_norm}, result, grad_norm, lr, skip_nonfinite)
        self.global_step += 1
        return {**result, "grad_norm": grad_norm, "lr": lr, "nonfinite_skipped": 0.0}

    def backward_passes(self, micro_batches: Sequence[DataBatch], loss_fn: MicroLossFn, metrics: StepMetrics) -> None:
        """The forward and backward passes of an optimizer step: ``loss_fn(module, micro_batch)`` is a micro-batch's
        loss summed over its units (it may add to ``metrics``), and its gradients, times ``metrics.scale``, add up
        into the step's. A pipeline-parallel engine runs them through its schedule instead of one by one."""
        for index, micro in enumerate(micro_batches):
            with self.accumulating(last=index == len(micro_batches) - 1):
                with self.precision():
                    loss = loss_fn(self.module, micro)
                self.backward(loss * metrics.scale)

    def train_step(self, micro_batches: Sequence[DataBatch], loss_fn: LossFn, count_fn: CountFn) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` with ``loss_fn``, whose loss and metrics are sums over the units
        ``count_fn`` counts (supervised fine-tuning, the benches); the mean ``loss`` and metrics, as ``step``."""
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        metrics = self.start_step(sum(count_fn(mb) for mb in micro_batches))

        def loss_and_sums(module: nn.Module, micro: DataBatch) -> torch.Tensor:
            loss, sums = loss_fn(module, micro)
            for key, value in {"loss": loss, **sums}.items():
                metrics.add(key, value)
            return loss

        self.backward_passes(micro_batches, loss_and_sums, metrics)
        return self.step(metrics)

    def _not_applied(self, bad: dict[str, float], result: dict[str, float], norm: float | None, lr: float,
                     skip_nonfinite: bool) -> dict[str, float]:
        """A step dropped for the non-finite values ``bad``: ``NonFiniteUpdate``, or its metrics when skipping."""
        if not skip_nonfinite:
            named = ", ".join(f"{k} is {v}" for k, v in bad.items())
            raise NonFiniteUpdate(f"{named} in optimizer step {self.global_step + 1}; the step was not applied "
                                  "(trainer.on_nonfinite=skip drops such steps and carries on)")
        return {**result, "grad_norm": math.nan if norm is None else norm, "lr": lr, "nonfinite_skipped": 1.0}

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` any data-parallel rank passes (collective): how ranks agree on a count of
        micro-batches, since every rank must run as many backward passes as the others."""
        count = torch.tensor(float(value), dtype=torch.float64, device="cpu")  # on gloo, as the unit count
        return int(self._reduce({"count": count}, dist.ReduceOp.MAX)["count"])

    def _reduce(self, values: dict[str, torch.Tensor], op: dist.ReduceOp) -> dict[str, torch.Tensor]:
        """Each value reduced with ``op`` over the data-parallel ranks (one collective for all of them)."""
        if not values:
            return {}
        keys = sorted(values)
        stacked = torch.stack([values[k].reshape(()) for k in keys])
        if self.dp_size > 1:
            dist.all_reduce(stacked, op=op, group=self.group)
        return dict(zip(keys, stacked, strict=True))


class TorchOptimizerEngine(TrainEngine):
    """An engine that steps a torch AdamW and LambdaLR itself (torch/DDP and FSDP2; DeepSpeed steps its own)."""

    def __init__(self, parameters: Iterator[nn.Parameter], optim: OptimConfig,
                 group: dist.ProcessGroup | None = None, tp: TensorParallel = SINGLE, device: str = "cpu") -> None:
        super().__init__(group, device)
        self.tp = tp
        self.optim_config = optim
        self.optimizer = build_optimizer(parameters, optim, device)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.host = HostCopies()

    def _clip_gradients(self) -> float:
        max_norm = self.optim_config.grad_clip or float("inf")
        if self.tp.enabled:
            norm = clip_grad_norm(self.model, max_norm, self.tp)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP2
        return float(norm)

    def _optimizer_step(self, clipped_norm: float | None) -> float:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(clipped_norm)

    def _discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _offload(self) -> None:
        self._state_on_device = offload_optimizer_state(self.optimizer, self.device, self.host)
        self.model.to("cpu")  # parameters and any gradients (FSDP2: the local shards)

    def _reload(self) -> None:
        self.model.to(self.device)
        reload_optimizer_state(self._state_on_device, self.device)
