"""Pipeline stages of the project's decoder, and one rank's part in running them.

A model of ``L`` layers splits into ``p`` stages of contiguous layers (``stage_layers``), the embedding on the first
and the final norm and head on the last, as Megatron and verl split it. A stage keeps the full model's parameter
names (``model.layers.5.mlp...``), so the stages' state dicts together are the model's. Under tensor parallelism a
stage holds its rank's TP shard of its layers and runs their collectives inside its TP group.

``Pipeline`` runs one rank's stage with ``torch.distributed.pipelining`` (its GPipe and 1F1B schedules, P2P over
the pipeline group, gloo here): a batch is split into micro-batches, activations flow forward and their gradients
back between neighbouring stages, and the last stage applies ``fn`` to each micro-batch's logits together with the
indices of its rows, so a loss or a log-prob reads whatever per-row data it needs (advantages, masks) by index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from hybridflow_lab.models.decoder import DecoderLM, padded_causal_mask, positions_from_mask
from hybridflow_lab.models.tensor_parallel import copy_to_parallel, gather_last_dim

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}

# fn(logits of a micro-batch, the indices of its rows in the batch) -> a loss (training) or any tensor (forward)
RowsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each of ``stages`` stages: contiguous, as even as possible, the earlier stages taking one more
    where they do not divide (the last stage also computes the head)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} layers: each stage needs a layer; use 1 to "
                         f"{num_layers} stages")
    size, extra = divmod(num_layers, stages)
    starts = [index * size + min(index, extra) for index in range(stages + 1)]
    return [range(starts[index], starts[index + 1]) for index in range(stages)]


class DecoderStage(nn.Module):
    """Stage ``index`` of ``stages`` of ``full`` (sharing its modules): ``forward(x, attention_mask)`` takes token
    ids on the first stage and hidden states after it, and returns ``(hidden, attention_mask)`` for the next stage,
    or the logits on the last."""

    def __init__(self, full: DecoderLM, index: int, stages: int) -> None:
        super().__init__()
        self.config, self.tp = full.config, full.tp
        self.index, self.stages = index, stages
        self.layer_range = stage_layers(len(full.model.layers), stages)[index]
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(layer): full.model.layers[layer] for layer in self.layer_range})
        if self.is_last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head
        self.rotary = full.model.rotary

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        if self.is_first:
            x = self.model.embed_tokens(x)
        cos, sin = self.rotary(positions_from_mask(attention_mask, attention_mask), x.dtype)
        mask = padded_causal_mask(attention_mask, attention_mask.shape[1])
        for layer, module in self.model.layers.items():
            x = module(x, cos, sin, mask, None, int(layer))
        if not self.is_last:
            return x, attention_mask
        return gather_last_dim(self.lm_head(copy_to_parallel(self.model.norm(x), self.tp)), self.tp)


class Pipeline:
    """This rank's ``stage`` in the pipeline over ``group`` (its ranks in stage order), run with ``schedule``."""

    def __init__(self, stage: DecoderStage, group: dist.ProcessGroup | None, schedule: str = "1f1b",
                 device: str = "cpu") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")
        self.stage, self.group, self.schedule, self.device = stage, group, schedule, device

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, micro_batches: int, fn: RowsFn,
            train: bool, module: nn.Module | None = None) -> list[torch.Tensor]:
        """``fn`` of each of ``micro_batches`` micro-batches of the batch (equal row chunks), in order, on the last
        stage ([] on the others); with ``train``, ``fn`` returns the micro-batch's loss and its gradients accumulate
        on every stage's parameters (summed over micro-batches, not averaged); 1F1B needs at least as many
        micro-batches as stages to train. Every stage passes the same batch;
        only the first reads its token ids, and only the last its rows. ``module`` runs the stage (default the stage
        itself; a DDP wrapper of it, whose gradients the schedule then averages over the replicas)."""
        if train and micro_batches < self.stage.stages and self.schedule == "1f1b":
            raise ValueError(f"the 1F1B schedule needs at least as many micro-batches as stages "
                             f"({self.stage.stages}); got {micro_batches}")
        if len(input_ids) % micro_batches:
            raise ValueError(f"{len(input_ids)} rows do not split into {micro_batches} equal micro-batches")
        # a new stage per call, told the shapes it sends and receives: batches differ in length, and a stage left
        # to infer them runs a micro-batch (and ``fn``) once more
        inputs, outputs = self._activations(len(input_ids) // micro_batches, input_ids.shape[1])
        stage = PipelineStage(module or self.stage, self.stage.index, self.stage.stages, torch.device(self.device),
                              input_args=inputs, output_args=outputs, group=self.group)
        # forward-only passes are the same in every schedule: GPipe's, which takes any number of micro-batches
        kind = SCHEDULES[self.schedule] if train else ScheduleGPipe
        schedule = kind(stage, n_microbatches=micro_batches, loss_fn=fn, scale_grads=False)
        results: list[torch.Tensor] = []
        first = (input_ids,) if self.stage.is_first else ()
        kwargs = {"attention_mask": attention_mask} if self.stage.is_first else {}
        target = torch.arange(len(input_ids)) if self.stage.is_last else None
        step = schedule.step if train else schedule.eval
        with torch.enable_grad() if train else torch.no_grad():
            step(*first, target=target, losses=results if self.stage.is_last else None, return_outputs=False,
                 **kwargs)
        return results

    def _activations(self, rows: int, length: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """What this stage receives and sends for one micro-batch of ``rows`` x ``length`` tokens, as meta tensors:
        token ids, or the hidden states (the weights' dtype: the residual stream stays in it under autocast) and
        the attention mask; then the hidden states and mask, or the logits (autocast's dtype where it is on)."""
        config, dtype = self.stage.config, next(self.stage.parameters()).dtype

        def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:  # floats carry gradients back, ids and masks not
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

        between = (meta(rows, length, config.hidden_size, dtype=dtype), meta(rows, length, dtype=torch.long))
        inputs = (meta(rows, length, dtype=torch.long),) if self.stage.is_first else between
        device = torch.device(self.device).type
        logits = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype
        return inputs, (meta(rows, length, config.vocab_size, dtype=logits),) if self.stage.is_last else between
