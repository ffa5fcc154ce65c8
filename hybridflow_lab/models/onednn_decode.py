"""The built-in engine's decoding step on the CPU in C++ over oneDNN's pre-packed weights (``rollout.decoding=onednn``).

Through torch's linear, each of a decoding step's GEMMs (one row per sequence) spends much of its time re-packing
the weight it streams from memory; oneDNN multiplies by weights packed once into its own blocked layout. That
layout is an opaque tensor, which ``torch.compile`` cannot take as an input, so the whole step is a short C++
function (``onednn_decode.cpp``) calling ATen and oneDNN directly: the same computation as ``decode_step``, with
q/k/v and gate/up each one GEMM, and the norms, rotary, cache writes and attention over the written slots as plain
loops (each ATen operation costs microseconds more than its arithmetic at one token per row). The weights are packed
when a generation starts: a second copy of them, held for that generation only. It mirrors the decoders of
``MIRRORED_ARCHITECTURES`` only and refuses, by name, a model of any other.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.kv_cache import KVCache
from hybridflow_lab.models.lora import LoraLinear, merge

SOURCE = Path(__file__).with_name("onednn_decode.cpp")
NO_BIAS = torch.empty(0)
# the model_types whose decoding step onednn_decode.cpp computes (Mistral's window: the decoder refuses sequences
# longer than it, so every slot is inside it)
MIRRORED_ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral")


def unmirrored_architecture(model_type: str) -> str | None:
    """Why the C++ step cannot decode a model of ``model_type`` (config.json's), or None when it mirrors it."""
    if model_type in MIRRORED_ARCHITECTURES:
        return None
    return (f"the oneDNN decoding step mirrors the {', '.join(MIRRORED_ARCHITECTURES)} decoders only, and this "
            f"model's model_type is {model_type!r}")


def missing_onednn() -> str | None:
    """Why this torch cannot run oneDNN's packed linear layers, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    return None


@functools.cache
def _kernel() -> ModuleType:
    # built on first use (about 30 s) into torch's extension cache, shared by every process of this user
    from torch.utils.cpp_extension import load

    return load("hybridflow_onednn_decode", [str(SOURCE)], extra_cflags=["-O3", "-fopenmp-simd"])


def _weight(layer: nn.Module) -> torch.Tensor:
    """The weight ``layer`` multiplies by: LoRA's merged with its adapters while they are on."""
    if isinstance(layer, LoraLinear) and layer.adapters_enabled:
        return merge(layer.weight, layer.lora_A, layer.lora_B, layer.scaling)
    return layer.weight


def _bias(*layers: nn.Module) -> torch.Tensor:
    biases = [layer.bias for layer in layers]
    return torch.cat(biases) if biases[0] is not None else NO_BIAS


class PackedDecoder:
    """``model``'s weights packed for oneDNN (for batches of about ``rows``), and its decoding step over them."""

    def __init__(self, model: DecoderLM, rows: int) -> None:
        unmirrored = unmirrored_architecture(model.config.model_type)
        if unmirrored:
            raise ValueError(unmirrored)
        weight = model.lm_head.weight
        if model.tp.enabled or weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("the oneDNN decoding step runs a float32 model on the CPU without tensor parallelism; "
                             f"this one is {weight.dtype} on {weight.device}"
                             f"{' with TP' if model.tp.enabled else ''}")
        self.model = model
        attention = model.model.layers[0].self_attn
        self.heads, self.kv_heads = attention.heads, attention.kv_heads
        self.intermediate = model.model.layers[0].mlp.gate_proj.weight.shape[0]
        self.eps = model.model.norm.eps
        with torch.no_grad():
            self.weights = [*(w for layer in model.model.layers for w in self._pack_layer(layer, rows)),
                            model.model.norm.weight.detach(), self._pack(rows, model.lm_head)]
        self.kernel = _kernel()

    @staticmethod
    def _pack(rows: int, *layers: nn.Module) -> torch.Tensor:
        weights = [_weight(layer) for layer in layers]
        return torch.ops.mkldnn._reorder_linear_weight(weights[0].contiguous() if len(weights) == 1
                                                       else torch.cat(weights), rows)

    def _pack_layer(self, layer: nn.Module, rows: int) -> list[torch.Tensor]:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        return [layer.input_layernorm.weight.detach(), self._pack(rows, *qkv), _bias(*qkv),
                self._pack(rows, attention.o_proj), _bias(attention.o_proj),
                layer.post_attention_layernorm.weight.detach(),
                self._pack(rows, mlp.gate_proj, mlp.up_proj), _bias(mlp.gate_proj, mlp.up_proj),
                self._pack(rows, mlp.down_proj), _bias(mlp.down_proj),
                *((attention.q_norm.weight.detach(), attention.k_norm.weight.detach()) if attention.q_norm is not None
                  else (NO_BIAS, NO_BIAS))]

    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``decode_step``'s logits ``[batch, vocab]`` for one new token per row."""
        slot = cache.next_slot()
        backbone = self.model.model
        return self.kernel.decode_step(
            tokens, slot.positions, backbone.embed_tokens.weight.detach(), backbone.rotary.inv_freq,
            float(backbone.rotary.scaling), self.weights, list(slot.keys), list(slot.values), cache.length - 1,
            cache.valid, self.heads, self.kv_heads, self.intermediate, self.eps)
