"""The analytic cost model of the paper's auto-mapping (section 6): seconds per stage and bytes per device.

Training and forward-only passes are compute-bound (FLOPs over the achieved rate), with tensor-parallel
all-reduces, the pipeline bubble and the data-parallel gradient all-reduce added; where devices share CPU
cores, a pipeline's ranks compete for them only while busy (1 / bubble of the time). Generation is
memory-bound: every decoding step reads the generation shard of the weights and the batch's KV cache,
and the batch per replica is as large as the KV cache that fits in the memory left over. The actor's
training-to-generation transition costs the 3D-HybridEngine's bytes (Table 2) over the TP links.

Stages follow the paper: ``generation`` (actor), ``preparation`` (one forward pass of the actor for
old log-probs, the reference, the critic and the reward/cost models), ``training`` (actor and critic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow_lab.hybrid.layout import ParallelLayout, formula_bytes_per_rank
from hybridflow_lab.placement.hardware import HardwareProfile
from hybridflow_lab.placement.workload import TRAINED, ModelSpec, Workload

ADAM_BYTES_PER_PARAM = 12  # fp32 master weights, first and second moments
MEMORY_RESERVE = 0.9  # the fraction of device memory the models may fill (the rest: allocator, buffers)


@dataclass(frozen=True)
class ModelCost:
    """A model on ``layout``: seconds per stage (0 where it has no work) and the bytes each device holds."""

    role: str
    layout: ParallelLayout
    stage_s: dict[str, float]
    memory_bytes: float

    @property
    def total_s(self) -> float:
        return sum(self.stage_s.values())


def resident_bytes(role: str, spec: ModelSpec, layout: ParallelLayout, workload: Workload) -> float:
    """Bytes a model keeps on each device between stages: weights, and for trained models gradients, the
    optimizer state (sharded over data parallel, as ZeRO-1 does) and one micro-batch's checkpointed activations."""
    shards = layout.t * layout.p
    weights = spec.params * workload.dtype_bytes / shards
    if role not in TRAINED:
        return weights
    optimizer = spec.params * ADAM_BYTES_PER_PARAM / (shards * layout.d)
    layer_inputs = workload.tokens_per_micro_batch * spec.hidden * workload.dtype_bytes
    activations = layer_inputs * (spec.layers / layout.p + 16 / layout.t)  # checkpoints + one live layer
    return 2 * weights + optimizer + activations


def _forward_s(spec: ModelSpec, layout: ParallelLayout, workload: Workload, hw: HardwareProfile,
               sequences: int, efficiency: float, passes: float = 1.0) -> float:
    """``passes`` forward-equivalents over ``sequences`` full sequences on ``layout`` (3 = forward + backward)."""
    tokens = sequences * workload.sequence_tokens
    flops = passes * tokens * spec.flops_per_token(workload.sequence_tokens // 2)
    tokens_per_replica = tokens / layout.d
    micro_batches = max(1, math.ceil(tokens_per_replica / workload.tokens_per_micro_batch))
    bubble = 1 + (layout.p - 1) / micro_batches
    # a stage waiting in the bubble sleeps in its receive, so on shared cores only 1/bubble of the ranks compete
    compute = flops / (layout.world_size * hw.flops * efficiency * hw.share(layout.world_size / bubble))
    tp_comm = 0.0
    if layout.t > 1:  # two activation all-reduces per layer per forward-equivalent (ring: 2 (t-1)/t each)
        all_reduces = passes * 2 * spec.layers / layout.p
        traffic = tokens_per_replica * spec.hidden * workload.dtype_bytes * 2 * (layout.t - 1) / layout.t
        tp_comm = all_reduces * (traffic / hw.link_bandwidth(layout.t) + micro_batches * hw.collective_latency_s)
    return compute * bubble + tp_comm


def training_s(spec: ModelSpec, layout: ParallelLayout, workload: Workload, hw: HardwareProfile) -> float:
    """One update stage: forward + backward (3 forward-equivalents) per epoch, then the gradient all-reduce."""
    step = _forward_s(spec, layout, workload, hw, workload.sequences, hw.train_efficiency,
                      3.0 * workload.update_epochs)
    grads = spec.params * workload.dtype_bytes / (layout.t * layout.p)
    all_reduce = 2 * (layout.d - 1) / layout.d * grads / hw.link_bandwidth(layout.world_size) if layout.d > 1 \
        else 0.0
    return step + all_reduce * workload.update_epochs + hw.call_overhead_s


def inference_s(spec: ModelSpec, layout: ParallelLayout, workload: Workload, hw: HardwareProfile) -> float:
    """One forward pass over the iteration's sequences (log-probs, values, scores)."""
    return _forward_s(spec, layout, workload, hw, workload.sequences, hw.infer_efficiency) + hw.call_overhead_s


def generation_s(spec: ModelSpec, layout: ParallelLayout, workload: Workload, hw: HardwareProfile,
                 free_bytes: float) -> float:
    """Prefill plus memory-bound decoding on ``d * t / tg`` replicas of TP ``tg``; ``inf`` if no sequence fits.

    ``free_bytes`` per device is what the colocated models leave; the generation shard's extra weights
    (M/tg - M/t) and the KV cache come out of it.
    """
    tg, replicas = layout.tg, layout.world_size // layout.tg
    weights = spec.params * workload.dtype_bytes / tg
    kv_budget = free_bytes - (weights - spec.params * workload.dtype_bytes / (layout.t * layout.p))
    kv_per_sequence = spec.kv_bytes_per_token(workload.dtype_bytes) / tg * workload.sequence_tokens
    max_batch = int(kv_budget // kv_per_sequence) if kv_budget > 0 else 0
    if max_batch < 1:
        return math.inf
    per_replica = math.ceil(workload.sequences / replicas)
    share = hw.share(layout.world_size)  # every replica decodes at once
    waves, rate = math.ceil(per_replica / max_batch), hw.flops * hw.infer_efficiency * share
    batch = math.ceil(per_replica / waves)
    prefill = batch * workload.prompt_tokens * spec.flops_per_token(workload.prompt_tokens // 2) / (tg * rate)
    context = workload.prompt_tokens + workload.response_tokens / 2  # mean KV length while decoding
    read = weights + batch * spec.kv_bytes_per_token(workload.dtype_bytes) / tg * context
    compute = batch * spec.flops_per_token(int(context)) / (tg * rate)
    # two all-reduces per layer, plus the vocabulary-parallel embedding's and the logits' gather
    tp_calls = (2 * spec.layers + 2) * hw.collective_latency_s if tg > 1 else 0.0
    bandwidth = hw.memory_bandwidth * hw.bandwidth_efficiency * share
    step = max(read / bandwidth, compute) + hw.decode_step_overhead_s / share + tp_calls
    return waves * (prefill + workload.response_tokens * step) + hw.call_overhead_s


def reshard_s(spec: ModelSpec, layout: ParallelLayout, workload: Workload, hw: HardwareProfile) -> float:
    """The actor's training-to-generation transition: Table 2's HybridFlow bytes over the micro-DP links."""
    moved = formula_bytes_per_rank("hybridflow", layout, spec.params * workload.dtype_bytes)
    return moved / hw.link_bandwidth(layout.t) if moved else 0.0


def model_cost(role: str, spec: ModelSpec, layout: ParallelLayout, workload: Workload, hw: HardwareProfile,
               free_bytes: float) -> ModelCost:
    """What ``role`` costs in each stage on ``layout`` with ``free_bytes`` per device left for a KV cache."""
    stages = dict.fromkeys(workload.stages, 0.0)
    if role == "actor":
        stages["generation"] = generation_s(spec, layout, workload, hw, free_bytes) + \
            reshard_s(spec, layout, workload, hw)
    if role != "actor" or workload.recompute_log_probs:
        stages["preparation"] = inference_s(spec, layout, workload, hw)
    if role in TRAINED:
        stages["training"] = training_s(spec, layout, workload, hw)
    return ModelCost(role, layout, stages, resident_bytes(role, spec, layout, workload))
