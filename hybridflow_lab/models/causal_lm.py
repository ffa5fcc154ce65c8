"""What the engines ask of a causal LM on either path (``families.model_impl``): the project's ``DecoderLM`` or a
``transformers`` model behind the same interface (``TransformersLM``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from hybridflow_lab.models import decoder
from hybridflow_lab.models.decoder import DecoderLayer, DecoderLM
from hybridflow_lab.models.families import model_impl
from hybridflow_lab.models.transformers_lm import TransformersLM, TransformersScalarModel

CausalLM = DecoderLM | TransformersLM


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer in ``model``: the project's, or the classes a transformers model names in
    ``_no_split_modules`` (the units FSDP shards and activation checkpointing recomputes)."""
    names = {name for m in model.modules() if isinstance(m, TransformersLM | TransformersScalarModel)
             for name in m.no_split_modules}
    return [m for m in model.modules() if isinstance(m, DecoderLayer) or type(m).__name__ in names]


def checkpoint_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weight stream under the names and layout of its saved checkpoint, which vLLM loads: unchanged
    on the project's decoder; on a transformers model each tensor goes through ``TransformersLM.checkpoint_state``
    as it passes (Qwen3-MoE's fused experts become one tensor per expert), so the stream stays a stream."""
    causal_lm = next((m for m in model.modules() if isinstance(m, TransformersLM)), None)
    for name, tensor in weights:
        yield from [(name, tensor)] if causal_lm is None else causal_lm.checkpoint_state({name: tensor}).items()


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass, on either path."""
    decoder.enable_gradient_checkpointing(model)
    for module in model.modules():
        if isinstance(module, TransformersLM):
            module.causal_lm[0].gradient_checkpointing_enable({"use_reentrant": False})
        elif isinstance(module, TransformersScalarModel):
            module.model.gradient_checkpointing_enable({"use_reentrant": False})


def linear_layer_names(config: PretrainedConfig, impl: str = "auto") -> set[str]:
    """The names of the linear layers inside a model of ``config``'s decoder layers (``q_proj``, Phi-3's
    ``qkv_proj``...), the ones LoRA may target (not the output head); built on the meta device, so no weight is
    allocated."""
    with torch.device("meta"):
        if model_impl(config, impl) == "native":
            model: nn.Module = DecoderLM(config)
        else:
            from transformers import AutoModelForCausalLM

            model = TransformersLM(AutoModelForCausalLM.from_config(config))
    return {name.rsplit(".", 1)[-1] for layer in decoder_layers(model) for name, module in layer.named_modules()
            if isinstance(module, nn.Linear)}
