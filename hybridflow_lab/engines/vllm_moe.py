"""What vLLM's CPU build needs to run a mixture of experts after a weight sync.

Its CPU experts hold their weights in a prepacked grouped-gemm layout, made when the checkpoint loads. vLLM 0.32's
in-place reload writes the new weights in the checkpoint's plain layout and skips that step (it keeps the kernel it
built on the first load), so the experts would run on weights the kernel misreads: the engine's log-probs moved by
0.25 from the trainer's on a tiny Qwen3-MoE after one sync. ``repack_cpu_experts`` makes the layout again; the
sync's fingerprints are read before it, from the plain layout (``vllm_fingerprints.expert_fingerprints``).
"""

from __future__ import annotations

from torch import nn


def repack_cpu_experts(model: nn.Module) -> int:
    """Prepack every CPU expert layer's freshly loaded weights for its kernel; returns how many layers it packed."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        size = experts.moe_config.intermediate_size_per_partition
        if module.w13_weight.shape[1] != 2 * size:
            raise NotImplementedError(
                f"vLLM's CPU kernel pads these experts' intermediate size ({size}) to its alignment, and a weight "
                "sync cannot repack padded experts in place; generate with "
                "rollout.engine=torch, or on a GPU")
        experts.process_weights_after_loading(module)
        packed += 1
    return packed
