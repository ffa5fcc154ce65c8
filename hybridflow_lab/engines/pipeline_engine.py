"""The pipeline-parallel engine: this rank holds one stage of the model (``models.pipeline``), its TP shard of the
stage's layers, and trains it with the torch engine's AdamW, DDP over the data-parallel replicas of the stage.

An optimizer step's micro-batches go through the stage's schedule together (``backward_passes``; ``infer`` for
forward-only passes), padded to one shape. The functions written for a whole model (the actor's policy loss,
SFT's loss, log-probs) run unchanged on the last stage: they are handed ``StageLogits``, which returns the logits
the pipeline computed for their micro-batch. Their metrics, and ``infer``'s outputs, are the last stage's, sent
to the other stages, so every rank reports the same step. The gradient norm is the whole model's, over the
stages and the TP shards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.engines.torch_engine import TorchEngine
from hybridflow_lab.engines.train_base import MicroLossFn, StepMetrics
from hybridflow_lab.engines.training_state import Moments
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.lora import trainable_names
from hybridflow_lab.models.pipeline import DecoderStage, Pipeline
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel, clip_grad_norm, gather, split_dim
from hybridflow_lab.protocol import DataBatch


class StageLogits(nn.Module):
    """The model as a loss function sees it on the last stage: the logits of one micro-batch, already computed."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, keep_last: int = 0, **unsupported: Any) -> torch.Tensor:
        if any(value is not None for value in unsupported.values()):
            raise ValueError(f"a pipeline stage's logits cannot serve {sorted(unsupported)} (remove_padding, a KV "
                             "cache): the pipeline runs padded passes")
        return self.logits[:, -keep_last:] if keep_last else self.logits


def padded_alike(micros: Sequence[DataBatch]) -> list[DataBatch]:
    """The micro-batches padded to one shape (a pipeline schedule splits one batch into equal chunks): rows of zero
    mask added, and the sequence and response columns padded on the right (the layout keeps the responses last)."""
    rows = max(len(micro) for micro in micros)
    length = max(micro["input_ids"].shape[1] for micro in micros)
    padded = []
    for micro in micros:
        extra, responses = length - micro["input_ids"].shape[1], micro["responses"].shape[1]
        columns = {}
        for key, value in micro.tensors.items():
            if value.dim() >= 2 and value.shape[1] in (responses, micro["input_ids"].shape[1]):
                value = F.pad(value, (0, 0) * (value.dim() - 2) + (0, extra))
            columns[key] = F.pad(value, (0, 0) * (value.dim() - 1) + (0, rows - len(micro)))
        padded.append(DataBatch(columns))
    return padded


@dataclass(frozen=True)
class StagePlace:
    """Where a rank's stage sits: stage ``index`` of ``stages`` in the pipeline over ``group`` (its ranks in stage
    order), run with ``schedule`` (``1f1b`` or ``gpipe``)."""

    index: int
    stages: int
    group: dist.ProcessGroup
    schedule: str = "1f1b"


class StagedModel:
    """One rank's stage of a model and the pipeline it runs in: whole-model functions of each micro-batch run on the
    last stage, their outputs sent to every stage (forward-only passes: the actor's log-probs, the reference's)."""

    def __init__(self, model: DecoderLM, place: StagePlace, device: str = "cpu") -> None:
        self.stage = DecoderStage(model, place.index, place.stages)
        self.place = place
        self.pipeline = Pipeline(self.stage, place.group, place.schedule, device)
        self.last_rank = dist.get_global_rank(place.group, place.stages - 1)

    def run(self, micros: Sequence[DataBatch], fn: Callable[[nn.Module, DataBatch], Any], train: bool,
            module: nn.Module, precision: AbstractContextManager[Any]) -> list[Any]:
        """``fn(model, micro)`` of each micro-batch on the last stage ([] on the others), the micro-batches padded
        to one shape; ``module`` runs this stage (the stage, or its DDP wrapper)."""
        padded = padded_alike(micros)
        rows = len(padded[0])
        batch = DataBatch.concat(padded)

        def on_last_stage(logits: torch.Tensor, indices: torch.Tensor) -> Any:
            return fn(StageLogits(logits), padded[int(indices[0]) // rows])

        with precision:
            return self.pipeline.run(batch["input_ids"], batch["attention_mask"], len(padded), on_last_stage, train,
                                     module)

    @torch.no_grad()
    def infer(self, micros: Sequence[DataBatch], fn: Callable[[nn.Module, DataBatch], Any],
              module: nn.Module | None = None, precision: AbstractContextManager[Any] | None = None) -> list[Any]:
        """``fn(model, micro)`` of each micro-batch, on every stage (collective over the pipeline)."""
        was_training = self.stage.training
        self.stage.eval()
        try:
            outputs = self.run(micros, fn, False, module or self.stage, precision or nullcontext())
        finally:
            self.stage.train(was_training)
        sent = [outputs if self.stage.is_last else None]
        dist.broadcast_object_list(sent, src=self.last_rank, group=self.place.group)
        return [_unpadded(output, micro) for output, micro in zip(sent[0], micros, strict=True)]


class PipelineEngine(TorchEngine):
    """The stage at ``place`` of ``model`` (this rank's ``tp`` shard, whole on entry: the other stages' layers are
    dropped); DDP over ``dp_group``, the ranks holding the same stage and shard (a group of one rank without data
    parallelism)."""

    def __init__(self, model: DecoderLM, optim: OptimConfig, place: StagePlace, dp_group: dist.ProcessGroup,
                 tp: TensorParallel = SINGLE, device: str = "cpu", bf16: bool = False) -> None:
        self.staged = StagedModel(model, place, device)
        self.stage, self.pp_group = self.staged.stage, place.group
        super().__init__(self.stage, optim, dp_group, tp, device, bf16)

    def backward_passes(self, micro_batches: Sequence[DataBatch], loss_fn: MicroLossFn, metrics: StepMetrics) -> None:
        self.staged.run(micro_batches, lambda module, micro: loss_fn(module, micro) * metrics.scale, True,
                        self.module, self.precision())

    def infer(self, micro_batches: Sequence[DataBatch], fn: Callable[[nn.Module, DataBatch], Any]) -> list[Any]:
        return self.staged.infer(micro_batches, fn, self.module, self.precision())

    def step(self, metrics: StepMetrics, skip_nonfinite: bool = False, apply: bool = True) -> dict[str, float]:
        sent = [(metrics.sums, metrics.token_means, metrics.maxima)]
        dist.broadcast_object_list(sent, src=self.staged.last_rank, group=self.pp_group)
        metrics.sums, metrics.token_means, metrics.maxima = sent[0]
        return super().step(metrics, skip_nonfinite, apply)

    def _clip_gradients(self) -> float:
        max_norm = self.optim_config.grad_clip or float("inf")
        return float(clip_grad_norm(self.stage, max_norm, self.tp, self.pp_group))

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's weights, stage after stage and tensor by tensor, each sent from its stage to the
        others (collective over every rank): a consumer that copies each tensor away holds one at a time."""
        for index in range(self.stage.stages):
            owner = dist.get_global_rank(self.pp_group, index)
            mine = self.stage.index == index
            own = self.stage.state_dict() if mine else {}
            specs = [[(name, _full_shape(value, name, self.tp), value.dtype) for name, value in own.items()]
                     if mine else None]
            dist.broadcast_object_list(specs, src=owner, group=self.pp_group)
            for name, shape, dtype in specs[0]:
                tensor = gather(own[name], name, self.tp).contiguous() if mine else \
                    torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=owner, group=self.pp_group)
                yield name, tensor

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.full_weights())

    def _full_moments(self) -> Moments:
        return self._merged(super()._full_moments())

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        trained = trainable_names(self.stage)
        return self._merged({name: value for name, value in super().full_state_dict().items() if name in trained})

    def _merged(self, part: dict[str, Any]) -> dict[str, Any]:
        """The stages' ``part`` dicts (disjoint names) merged, on every rank of the pipeline (collective)."""
        parts: list[dict[str, Any]] = [{} for _ in range(self.stage.stages)]
        dist.all_gather_object(parts, {name: _on_cpu(value) for name, value in part.items()}, group=self.pp_group)
        return {name: value for stage_part in parts for name, value in stage_part.items()}

    def _optimizer_file(self, path: Path) -> Path:
        return path / f"optimizer-pp{self.stage.index}-tp{self.tp.rank}.pt"

    def _writes_model_dir(self) -> bool:
        return super()._writes_model_dir() and self.stage.is_first

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)  # every stage writes its optimizer state into it
        super().save_checkpoint(path)

    def _load_weights(self, path: Path) -> None:
        from hybridflow_lab.models.factory import load_matching, read_weights
        from hybridflow_lab.models.tensor_parallel import shard_state_dict

        names = set(self.stage.state_dict())  # this stage's part of the whole model's checkpoint
        weights = {name: value for name, value in read_weights(path).items() if name in names}
        load_matching(self.stage, shard_state_dict(weights, self.tp), str(path))


def _full_shape(shard: torch.Tensor, name: str, tp: TensorParallel) -> torch.Size:
    """The shape of the whole tensor whose TP shard is ``shard``."""
    dim = split_dim(name)
    if dim is None or not tp.enabled or shard.dim() == 0:
        return shard.shape
    return torch.Size(size * tp.size if axis == dim else size for axis, size in enumerate(shard.shape))


def _on_cpu(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _unpadded(output: Any, micro: DataBatch) -> Any:
    """``infer``'s output for a padded micro-batch cut back to ``micro``'s rows and response length."""
    if isinstance(output, tuple):
        return tuple(_unpadded(item, micro) for item in output)
    if not isinstance(output, torch.Tensor) or output.dim() == 0:
        return output
    output = output[: len(micro)]
    return output[:, : micro["responses"].shape[1]] if output.dim() >= 2 else output
