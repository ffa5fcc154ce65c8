"""DeepSpeed ZeRO stages 1, 2 and 3 (optionally offloaded to CPU), with a torch AdamW.

A torch optimizer object avoids DeepSpeed's fused-Adam build; on CPU (``DS_ACCELERATOR=cpu``)
we also skip its shared-memory all-reduce op, which only serves inference and takes minutes
to compile. Gradients are averaged over the whole world (DeepSpeed's data-parallel group).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.engines.host_offload import HostCopies, offload_optimizer_state, reload_optimizer_state
from hybridflow_lab.engines.train_base import TrainEngine, build_optimizer, build_scheduler
from hybridflow_lab.engines.training_state import Moments
from hybridflow_lab.models.lora import has_adapters, trainable_parameters

CHECKPOINT_TAG = "checkpoint"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce and all-gather bucket


def import_deepspeed(device: str = "cpu") -> ModuleType:
    """Import DeepSpeed for ``device`` (its CPU accelerator unless the ranks run on CUDA)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.startswith("cuda") else "cpu")
    # DeepSpeed's ZeRO all-gathers call the name torch 2.13 deprecated; every rank would print it once
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only op, minutes to build
    return deepspeed


def deepspeed_config(optim: OptimConfig, zero_stage: int, micro_batch_size: int, micro_batches_per_step: int,
                     offload: bool, bf16: bool, trainable_elements: int) -> dict[str, Any]:
    # DeepSpeed allocates its gradient bucket whole (by default 5e8 elements: 1.86 GiB in fp32 on every rank, for
    # any model); one larger than the trained parameters holds nothing more, so it is capped there
    bucket = min(DEEPSPEED_BUCKET_ELEMENTS, trainable_elements)
    zero: dict[str, Any] = {"stage": zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches_per_step,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},  # a NaN/inf gradient norm drops the step
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # keep the torch AdamW when offloading
        "steps_per_print": 2**31,
    }


def _load_without_code(path: str, map_location: Any = None) -> Any:
    """A DeepSpeed checkpoint file read with ``weights_only``: tensors, plain containers and the three
    DeepSpeed classes its optimizer states hold; any other object in the file is refused, never run."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True)


class DeepSpeedEngine(TrainEngine):
    """ZeRO-sharded training. ``micro_batches_per_step`` sizes DeepSpeed's config; the step's accumulation
    boundary is set on each micro-batch, so a step may hold any number of them (token-budget micro-batches)."""

    name = "deepspeed"

    def __init__(self, model: nn.Module, optim: OptimConfig, zero_stage: int = 2, micro_batch_size: int = 1,
                 micro_batches_per_step: int = 1, offload: bool = False, bf16: bool = False,
                 device: str = "cpu") -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        super().__init__(None, device)
        # the model stays on the CPU: DeepSpeed moves it to cuda:LOCAL_RANK (ZeRO-3: one parameter at a time,
        # partitioning each as it goes)
        self.deepspeed = import_deepspeed(device)
        self.zero_stage, self.state_on_host = zero_stage, offload
        optimizer = build_optimizer(trainable_parameters(model), optim, device)
        self.adapters_only = has_adapters(model)  # a LoRA checkpoint holds the adapters, not the frozen base
        elements = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        config = deepspeed_config(optim, zero_stage, micro_batch_size, micro_batches_per_step, offload, bf16, elements)
        self.engine, self.optimizer, _, self.scheduler = self.deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=build_scheduler(optimizer, optim), config=config,
            dist_init_required=False,
        )
        self.engine.checkpoint_engine.load = _load_without_code  # DeepSpeed's own load unpickles anything
        self.module = self.engine
        self.host = HostCopies()

    @property
    def model(self) -> nn.Module:
        return self.engine.module

    @contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(last)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # only counts the micro-step; the real step is _optimizer_step

    def _clip_gradients(self) -> None:
        return None  # DeepSpeed takes the norm and clips inside its step

    def _optimizer_step(self, clipped_norm: float | None) -> float:
        """DeepSpeed's step; every ZeRO optimizer checks the gradient norm before it updates anything and drops
        the step (gradients cleared, schedule not advanced) when the norm is NaN or infinite."""
        self.engine.step()
        if not self.engine.was_step_applied():
            return math.inf
        return float(self.engine.get_global_grad_norm())

    def _discard_gradients(self) -> None:
        """Nothing to do: DeepSpeed counts micro-steps inside ``engine.step()``, so leaving out a boundary step
        would shift every later accumulation boundary. A non-finite step therefore always stops the run
        (the config check refuses ``trainer.on_nonfinite=skip`` here) and ``lab.recover()`` rebuilds the
        engine from the last checkpoint."""

    def _offload(self) -> None:
        """DeepSpeed's ``offload_states`` for its own buffers; the torch AdamW's state, and ZeRO-3's fp32 master
        partitions, into host buffers reused at every offload. DeepSpeed's own move of them asserts its FusedAdam
        under ZeRO-3, and its reload puts AdamW's step counts on the device (a sync at every update)."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        zero = self.engine.optimizer
        own = [State.lp_params, State.lp_grads, State.contiguous_grad_buffer]
        self.engine.offload_states(include=own if self.zero_stage == 3 else [*own, State.hp_params])
        if self.zero_stage == 3:
            for index, master in enumerate(zero.fp32_partitioned_groups_flat):
                master.data = self.host.copy(("master", index), master.data)
        self._state_on_device = offload_optimizer_state(zero.optimizer, self.device, self.host)

    def _reload(self) -> None:
        self.engine.reload_states()
        if self.zero_stage == 3:
            for master in self.engine.optimizer.fp32_partitioned_groups_flat:
                master.data = master.data.to(self.device)
        reload_optimizer_state(self._state_on_device, self.device)

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.zero_stage < 3:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return dict(self.full_weights())  # gathered a module at a time, never every partition at once

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.zero_stage < 3:
            yield from super().full_weights()
            return
        for prefix, module in self.model.named_modules():
            params = dict(module.named_parameters(prefix=prefix, recurse=False))
            if not params:
                continue
            with self.deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                # a clone: the consumer may keep it past the gather (vLLM buffers a layer's tensors)
                gathered = [(name, p.detach().clone()) for name, p in params.items()]
            yield from gathered

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights (under bf16 the module's own are rounded copies), gathered per parameter."""
        from deepspeed.utils import safe_get_full_fp32_param

        return {name: safe_get_full_fp32_param(p).cpu() for name, p in self.model.named_parameters()
                if p.requires_grad}

    def _full_moments(self) -> Moments:
        from deepspeed.utils import safe_get_full_optimizer_state

        steps = [state["step"] for state in self.optimizer.optimizer.state.values() if "step" in state]
        moments: Moments = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:  # one step count for all: ZeRO steps every partition at once
                moments[name] = {key: safe_get_full_optimizer_state(p, key).cpu() for key in ADAM_MOMENTS}
                moments[name].update({"step": steps[0].detach().cpu().clone()} if steps else {})
        return moments

    def _load_moments(self, moments: Moments) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        base = self.optimizer.optimizer  # the torch AdamW over DeepSpeed's flat fp32 partitions (ZeRO-3's, or 1-2's)
        flats = getattr(self.optimizer, "fp32_partitioned_groups_flat", None) \
            or self.optimizer.single_partition_of_fp32_groups
        for flat in flats:
            if flat not in base.state:  # AdamW makes its state at its first step; a carried state comes before it
                zeros = {key: torch.zeros_like(flat) for key in ADAM_MOMENTS}
                base.state[flat] = {"step": torch.tensor(0.0, device="cpu"), **zeros}  # AdamW keeps its step on the CPU
        for name, p in self.model.named_parameters():
            if name in moments:
                for key in ADAM_MOMENTS:
                    safe_set_full_optimizer_state(p, moments[name][key].to(p.device), key)
        if steps := [m["step"] for m in moments.values() if "step" in m]:
            for state in base.state.values():
                state["step"] = steps[0].clone()

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, client_state={"global_step": self.global_step},
                                    exclude_frozen_parameters=self.adapters_only)
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        if not (Path(path) / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path}")
        _, client_state = self.engine.load_checkpoint(str(path), tag=CHECKPOINT_TAG,
                                                      load_module_strict=not self.adapters_only)
        self.global_step = int(client_state["global_step"])
