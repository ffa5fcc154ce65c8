"""Remove padding: run a padded ``[batch, length]`` batch's layers on its real tokens only.

The real tokens of every row are concatenated, ``[tokens, hidden]``, so the linear layers (almost all
of the FLOPs) compute nothing for padding. Position ids are the batch's, gathered with the tokens, so
they restart with each sequence. Attention stays within each sequence: for it the tokens are laid out
left-aligned, ``[batch, heads, longest, dim]``, under a causal mask that also hides each row's tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where a padded batch's real tokens go, for the packed forward pass (``DecoderLM(..., packing=)``)."""

    index: torch.Tensor  # flat ``[batch * length]`` positions of the real tokens, row by row
    slots: torch.Tensor  # their flat positions in the left-aligned attention layout ``[batch * longest]``
    batch: int
    longest: int
    mask: torch.Tensor | None  # ``[batch, 1, longest, longest]``; None when no row is shorter than ``longest``
    outputs: torch.Tensor | None  # the packed tokens whose outputs are returned; None: all of them

    @classmethod
    def of(cls, attention_mask: torch.Tensor, outputs: torch.Tensor | None = None) -> Packing:
        """The packing of ``attention_mask`` (1 = real token); ``outputs`` (same shape, boolean) marks the
        positions whose outputs the caller wants, each of which must be a real token."""
        real = attention_mask.bool()
        lengths = real.sum(-1)
        longest = int(lengths.max())
        index = real.flatten().nonzero().squeeze(-1)
        offsets = (real.long().cumsum(-1) - 1).flatten()[index]
        slots = index // real.shape[1] * longest + offsets
        mask = None if bool((lengths == longest).all()) else _left_aligned_mask(lengths, longest)
        if outputs is not None:
            if bool((outputs & ~real).any()):
                raise ValueError("an output position is padding: the packed forward computes real tokens only")
            outputs = outputs.flatten()[index].nonzero().squeeze(-1)
        return cls(index, slots, real.shape[0], longest, mask, outputs)

    @property
    def tokens(self) -> int:
        return self.index.numel()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """The real tokens of ``x`` (``[batch, length, ...]``): ``[tokens, ...]``."""
        return x.flatten(0, 1).index_select(0, self.index)

    def to_attention_layout(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads, dim]`` to ``[batch, heads, longest, dim]``, zeros after each row's end."""
        laid = x.new_zeros(self.batch * self.longest, *x.shape[1:]).index_copy(0, self.slots, x)
        return laid.view(self.batch, self.longest, *x.shape[1:]).transpose(1, 2)

    def from_attention_layout(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, heads, longest, dim]`` back to ``[tokens, heads * dim]``."""
        return x.transpose(1, 2).reshape(self.batch * self.longest, -1).index_select(0, self.slots)

    def select_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (``[tokens, ...]``) the caller asked for."""
        return x if self.outputs is None else x.index_select(0, self.outputs)


def _left_aligned_mask(lengths: torch.Tensor, longest: int) -> torch.Tensor:
    positions = torch.arange(longest, device=lengths.device)
    causal = positions[None, :] <= positions[:, None]  # [query, key]
    inside = positions[None, :] < lengths[:, None]  # [batch, key]
    # A query past its row's end still sees itself, so no row of scores is all masked (NaN).
    return (causal[None] & inside[:, None, :] | torch.eye(longest, dtype=torch.bool, device=lengths.device))[:, None]
