"""A preallocated key/value cache for batched generation of left-padded prompts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig


class KVCache:
    """Keys and values of every layer, ``[batch, kv_heads, max_length, head_dim]`` each, written in place.

    Prompts are left-padded to one length, so all rows write at the same cache index; the
    cache keeps which slots hold real tokens and each row's next position id.
    """

    def __init__(self, config: PretrainedConfig, batch: int, max_length: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tp_size: int = 1) -> None:
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads // tp_size, max_length, dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, max_length, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self._start = 0
        self._padded = False

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    def extend(self, attention_mask: torch.Tensor | None, new: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reserve ``new`` slots; returns their position ids and the attention mask for this step."""
        start, end = self.length, self.length + new
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} tokens; cannot add {new} to {start}")
        if attention_mask is None and new == 1 and start > 0:
            return self._decode_slot(start)
        batch = self.valid.shape[0]
        real = torch.ones(batch, new, dtype=torch.bool, device=self.valid.device) if attention_mask is None \
            else attention_mask.bool()
        self.valid[:, start:end] = real
        positions = self.next_position[:, None] + (real.long().cumsum(-1) - 1).clamp(min=0)
        self.next_position += real.sum(-1)
        self._padded = self._padded or not bool(real.all())
        self._start, self.length = start, end
        if not self._padded:  # plain causal attention: SDPA's is_causal (prefill) or no mask (one token)
            return positions, None if new == 1 or start == 0 else self._causal(start, end, with_padding=False)
        return positions, self._causal(start, end, with_padding=True)

    def _decode_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One real token per row: the fast path of every decoding step (a single query sees every key before it,
        so only padding needs masking)."""
        self.valid[:, slot] = True
        positions = self.next_position[:, None].clone()
        self.next_position += 1
        self._start, self.length = slot, slot + 1
        return positions, self.valid[:, None, None, : self.length] if self._padded else None

    def next_slot(self) -> SlotCache:
        """Reserve the next decoding slot (one real token per row) and return the step's ``SlotCache``."""
        slot = self.length
        positions, _ = self._decode_slot(slot)
        return SlotCache(self.keys.unbind(0), self.values.unbind(0), torch.tensor([slot], device=self.valid.device),
                         positions, self.valid[:, None, None, :])

    def _causal(self, start: int, end: int, with_padding: bool) -> torch.Tensor:
        device = self.valid.device
        queries = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(end, device=device)[None, :]
        allowed = keys <= queries  # [new, end]
        if not with_padding:
            return allowed[None, None]
        mask = allowed[None, None] & self.valid[:, None, None, :end]
        return mask | (keys == queries)[None, None]  # a padding query still sees itself (no NaN rows)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values for ``layer``; returns everything cached so far for it."""
        self.keys[layer, :, :, self._start : self.length] = keys
        self.values[layer, :, :, self._start : self.length] = values
        return self.keys[layer, :, :, : self.length], self.values[layer, :, :, : self.length]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``, in that order (finished sequences dropped so later steps compute only what is left;
        a row repeated to share its prefix between samples)."""
        self.keys = self.keys[:, rows]
        self.values = self.values[:, rows]
        self.valid = self.valid[rows]
        self.next_position = self.next_position[rows]


class SlotCache:
    """One decoding step's view of a ``KVCache`` whose step state is all tensors, for a compiled decode step: it
    writes the step's keys and values at ``slot`` and attends over every slot of the cache, ``mask`` hiding
    padding and slots not yet written. Fixed shapes and no Python integers that change between steps, so one
    graph serves every step."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], slot: torch.Tensor,
                 positions: torch.Tensor, mask: torch.Tensor) -> None:
        self.keys, self.values, self.slot, self.positions, self.mask = keys, values, slot, positions, mask

    def extend(self, attention_mask: torch.Tensor | None, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.positions, self.mask

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(2, self.slot, keys)
        self.values[layer].index_copy_(2, self.slot, values)
        return self.keys[layer], self.values[layer]
