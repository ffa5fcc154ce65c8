"""One decoder definition for the Qwen2, Llama, Qwen3 and Mistral families (``families.py``), for training and
generation.

Parameter names match ``transformers`` (``model.layers.0.self_attn.q_proj.weight``, ...), so HF
checkpoints load with ``load_state_dict`` and our checkpoints load in ``transformers``. The
model takes the HF config object itself. Generation passes a ``KVCache``; training passes an
attention mask and gets per-position logits. With a ``TensorParallel`` of size > 1 each rank
holds its Megatron-style shard (``tensor_parallel.py``) and the forward runs the collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from hybridflow_lab.models.attention import Attention, RMSNorm, Rotary
from hybridflow_lab.models.families import attention_window, native_refusal, window_refusal
from hybridflow_lab.models.kv_cache import KVCache, SlotCache
from hybridflow_lab.models.packing import Packing
from hybridflow_lab.models.tensor_parallel import (
    SINGLE,
    TensorParallel,
    VocabParallelEmbedding,
    check_shardable,
    copy_to_parallel,
    gather_last_dim,
    reduce_from_parallel,
    shard_state_dict,
)


def check_supported(config: PretrainedConfig) -> None:
    """Raise a clear error for configs this decoder cannot run."""
    refusal = native_refusal(config)
    if refusal:
        raise ValueError(refusal)


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        bias = getattr(config, "mlp_bias", False)
        intermediate = config.intermediate_size // tp.size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=bias)  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_parallel(x, self.tp)
        return reduce_from_parallel(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | SlotCache | None, layer: int, packing: Packing | None = None,
                compiled: bool = False) -> torch.Tensor:
        """The layer's output; ``compiled``: the work before and after attention runs compiled (``compile_layers``)."""
        before, after = _compiled_layer_parts() if compiled else (DecoderLayer.attention_inputs,
                                                                   DecoderLayer.attention_outputs)
        q, k, v = before(self, x, cos, sin)
        return after(self, x, self.self_attn.attend(q, k, v, mask, cache, layer, packing))

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_outputs(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


@functools.cache
def _compiled_layer_parts() -> tuple[Callable[..., Any], Callable[..., Any]]:
    # attention itself stays eager: packed attention loops over length groups, whose number varies per batch and
    # would recompile the graph for each; the token count is symbolic, so one graph serves every batch
    return (torch.compile(DecoderLayer.attention_inputs, dynamic=True),
            torch.compile(DecoderLayer.attention_outputs, dynamic=True))


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.*``)."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_supported(config)
        check_shardable(config, tp.size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if tp.enabled \
            else nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.config = config
        self.gradient_checkpointing = False  # recompute each layer's activations in the backward pass
        self.compiled_layers = False  # passes without a cache run each layer's non-attention work compiled

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | SlotCache | None = None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[batch, length, hidden]``; with ``packing``, ``[outputs, hidden]`` for the packed tokens
        ``packing.outputs`` names.

        Without a cache, ``attention_mask`` (1 = real token) may mark left and right padding;
        positions then count real tokens only. With a cache, the cache tracks masks and positions.
        """
        if cache is not None:
            position_ids, mask = cache.extend(attention_mask, input_ids.shape[1])
        else:
            if position_ids is None:
                position_ids = positions_from_mask(attention_mask, input_ids)
            if attention_window(self.config) is not None:
                refusal = window_refusal(self.config, int(position_ids.max()) + 1)
                if refusal:
                    raise ValueError(refusal)
            mask = None if packing is not None else padded_causal_mask(attention_mask, input_ids.shape[1])
        if packing is not None:
            input_ids, position_ids = packing.pack(input_ids), packing.pack(position_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        compiled = self.compiled_layers and cache is None
        for index, layer in enumerate(self.layers):
            if recompute:
                x = checkpoint(layer, x, cos, sin, mask, cache, index, packing, compiled, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache, index, packing, compiled)
        return self.norm(x if packing is None else packing.select_outputs(x))


class DecoderLM(nn.Module):
    """A causal language model: ``Backbone`` plus the ``lm_head`` (vocabulary-parallel under TP)."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = Backbone(config, tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // tp.size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, rows: int, max_length: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        """An empty KV cache for generating ``rows`` sequences of up to ``max_length`` tokens."""
        return KVCache(self.config, rows, max_length, dtype, device, self.tp.size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | SlotCache | None = None,
        keep_last: int = 0,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, length, vocab]``; only the last ``keep_last`` positions when it is > 0. With
        ``packing``, ``[outputs, vocab]`` for the packed tokens ``packing.outputs`` names."""
        hidden = self.model(input_ids, attention_mask, position_ids, cache, packing)
        if packing is None and keep_last:
            hidden = hidden[:, -keep_last:]
        hidden = copy_to_parallel(hidden, self.tp)
        return gather_last_dim(self.lm_head(hidden), self.tp)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Keep only each decoder layer's input in the forward pass and recompute the rest in the backward pass
    (memory for about a third more compute), for every backbone in ``model``."""
    for module in model.modules():
        if isinstance(module, Backbone):
            module.gradient_checkpointing = True


def compile_layers(model: nn.Module) -> None:
    """Run the work before and after attention of every decoder layer of every backbone in ``model`` compiled
    (``torch.compile``, inductor) in passes without a KV cache: the training, log-prob and value passes. Each part
    compiles on first use, once with autograd and once without; generation stays as it is."""
    for module in model.modules():
        if isinstance(module, Backbone):
            module.compiled_layers = True


def shard_model(full: DecoderLM, tp: TensorParallel) -> DecoderLM:
    """This rank's tensor-parallel shard of ``full``: a new model holding copies of its slices (``full`` itself
    without TP)."""
    if not tp.enabled:
        return full
    model = DecoderLM(full.config, tp)
    model.load_state_dict(shard_state_dict(full.state_dict(), tp))
    return model


def positions_from_mask(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token counting only real tokens (left padding does not shift positions)."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_causal_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """Boolean ``[batch, 1, length, length]`` mask: causal, padding keys hidden; None when nothing is padded.

    Every query may see itself, so rows of padding positions never become all-masked (NaN).
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal & attention_mask.bool()[:, None, None, :]
    return mask | torch.eye(length, dtype=torch.bool, device=attention_mask.device)


def init_weights(model: nn.Module, std: float, seed: int) -> None:
    """Deterministic initialisation: normal(0, std) for linear and embedding weights, zero biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def describe(model: nn.Module) -> dict[str, Any]:
    """Parameter counts (total, without embeddings / head, and the head's, which costs FLOPs at every logit even
    when tied to the embeddings), for logs and FLOP estimates."""
    total = sum(p.numel() for p in model.parameters())
    embed = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n)
    head = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False) if n.startswith("lm_head"))
    return {"parameters": total, "non_embedding_parameters": total - embed, "head_parameters": head}
