"""The decoder's attention: RMS norms, rotary positions, the query/key/value projections (Qwen3's norms over each
head, Qwen2's biases) and attention itself, over a padded batch, packed sequences or a KV cache.

Under a ``TensorParallel`` of size > 1 each rank holds its heads (column-parallel projections) and a row of the
output projection, whose partial sums the group reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hybridflow_lab.models.families import head_norms, output_bias, qkv_bias
from hybridflow_lab.models.kv_cache import KVCache, SlotCache
from hybridflow_lab.models.packing import Packing
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel, copy_to_parallel, reduce_from_parallel


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """RMS norm; under tensor parallelism a norm of each head's slice (Qwen3's query and key norms) sees only this
    rank's heads, so its weight's gradient is summed over the group (``copy_to_parallel``)."""

    def __init__(self, size: int, eps: float, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_parallel(self.weight, self.tp)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * weight  # as transformers


class Rotary(nn.Module):
    """Rotary position embedding; frequencies from transformers' rope initialisers (default, llama3, ...)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
        kind = rope.get("rope_type", "default")
        if kind == "default":
            dim = head_dim(config)
            inv_freq = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        elif kind in ROPE_INIT_FUNCTIONS and not kind.startswith("dynamic"):
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](config, None)
        else:
            raise ValueError(f"rope_type {kind!r} is not supported")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cosines and the signed sines ``rotate`` takes, ``[..., head_dim]``."""
        freqs = positions[..., None].float() * self.inv_freq
        cos, sin = (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x``: ``x cos + (-x2, x1) sin`` as one roll, with the sign folded into the sines (the
    same numbers as negating ``x2``, in fewer operations: the decode step is bound by per-operation cost)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.heads, self.kv_heads = config.num_attention_heads // tp.size, config.num_key_value_heads // tp.size
        self.head_dim = head_dim(config)
        bias = qkv_bias(config)
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=output_bias(config))  # row-par.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, tp) if head_norms(config) else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, tp) if head_norms(config) else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[..., tokens, heads, dim]``, queries and keys rotated (before heads move in
        front, so packed and padded inputs share the code)."""
        x = copy_to_parallel(x, self.tp)
        q = self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               cache: KVCache | SlotCache | None, layer: int, packing: Packing | None = None) -> torch.Tensor:
        """``project``'s outputs attended, ``[..., tokens, heads * dim]``: within each packed sequence, or over the
        padded batch (and the cache, which takes the new keys and values)."""
        if packing is not None:
            return packing.attend(q, k, v, self._attend)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(layer, k, v)
        out = decode_attention(q, k, v, mask) if q.shape[2] == 1 else self._attend(q, k, v, mask)
        return out.transpose(1, 2).flatten(2)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return reduce_from_parallel(self.o_proj(attended), self.tp)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=self.kv_heads != self.heads)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one new token per row over the cache, as two batched matmuls.

    ``q`` is ``[batch, heads, 1, dim]``, ``k``/``v`` ``[batch, kv_heads, length, dim]``. Query
    heads sharing a KV head are stacked so no key is repeated; for one query token this beats
    the fused SDPA kernel on CPU, whose per-call cost dominates at this size.
    """
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * dim**-0.5  # [batch, kv_heads, group, length]
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))  # mask is [batch, 1, 1, length]
    out = torch.matmul(scores.softmax(-1), v)  # [batch, kv_heads, group, dim]
    return out.view(batch, heads, 1, dim)
