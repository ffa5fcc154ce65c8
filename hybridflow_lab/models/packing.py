"""Remove padding: run a padded ``[batch, length]`` batch's layers on its real tokens only.

The real tokens of every row are concatenated, ``[tokens, hidden]``, so the linear layers (almost all
of the FLOPs) compute nothing for padding. Position ids are the batch's, gathered with the tokens, so
they restart with each sequence. Attention stays within each sequence: rows of similar length are
grouped, and each group's tokens are laid out left-aligned, ``[rows, heads, longest, dim]``, under a
causal mask that also hides each row's tail, so that short rows are not padded to the longest one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
GROUP_RATIO = 0.75  # a row joins a length group while it is at least this fraction of the group's longest
GROUP_MIN_LONGEST = 64  # below this a group takes every shorter row: short attention costs less than a new group


@dataclass(frozen=True)
class LengthGroup:
    """Rows of similar length laid out together for attention."""

    members: torch.Tensor  # the group's tokens, as positions in the packed order
    slots: torch.Tensor  # their flat positions in the group's layout ``[rows * longest]``
    rows: int
    longest: int
    mask: torch.Tensor | None  # ``[rows, 1, longest, longest]``; None when every row is ``longest`` long


@dataclass(frozen=True)
class Packing:
    """Where a padded batch's real tokens go, for the packed forward pass (``DecoderLM(..., packing=)``)."""

    index: torch.Tensor  # flat ``[batch * length]`` positions of the real tokens, row by row (the packed order)
    groups: tuple[LengthGroup, ...]
    order: torch.Tensor  # the permutation from the groups' outputs, concatenated, back to the packed order
    outputs: torch.Tensor | None  # the packed tokens whose outputs are returned; None: all of them

    @classmethod
    def of(cls, attention_mask: torch.Tensor, outputs: torch.Tensor | None = None) -> Packing:
        """The packing of ``attention_mask`` (1 = real token); ``outputs`` (same shape, boolean) marks the
        positions whose outputs the caller wants, each of which must be a real token."""
        real = attention_mask.bool()
        lengths = real.sum(-1)
        index = real.flatten().nonzero().squeeze(-1)
        row_of = index // real.shape[1]
        offsets = (real.long().cumsum(-1) - 1).flatten()[index]
        groups = tuple(_group(rows, row_of, offsets, lengths) for rows in _similar_lengths(lengths))
        order = torch.cat([g.members for g in groups]).argsort()
        if outputs is not None:
            if bool((outputs & ~real).any()):
                raise ValueError("an output position is padding: the packed forward computes real tokens only")
            outputs = outputs.flatten()[index].nonzero().squeeze(-1)
        return cls(index, groups, order, outputs)

    @property
    def output_positions(self) -> torch.Tensor:
        """The flat ``[batch * length]`` positions, in the padded batch, of the tokens whose outputs are returned."""
        return self.index if self.outputs is None else self.index[self.outputs]

    @property
    def tokens(self) -> int:
        return self.index.numel()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """The real tokens of ``x`` (``[batch, length, ...]``): ``[tokens, ...]``."""
        return x.flatten(0, 1).index_select(0, self.index)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``attend(q, k, v, mask)`` within each sequence: ``[tokens, heads, dim]`` inputs (``k``/``v`` with their
        own head count), ``[tokens, heads * dim]`` out."""
        outs = []
        for group in self.groups:
            laid = [_lay_out(t, group) for t in (q, k, v)]
            out = attend(*laid, group.mask).transpose(1, 2).reshape(group.rows * group.longest, -1)
            outs.append(out.index_select(0, group.slots))
        return torch.cat(outs).index_select(0, self.order) if len(outs) > 1 else outs[0]

    def select_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (``[tokens, ...]``) the caller asked for."""
        return x if self.outputs is None else x.index_select(0, self.outputs)


def _similar_lengths(lengths: torch.Tensor) -> list[torch.Tensor]:
    """The non-empty rows, longest first, split where a row falls below ``GROUP_RATIO`` of its group's longest (a
    group whose longest row is under ``GROUP_MIN_LONGEST`` tokens takes the rest)."""
    sizes = lengths.tolist()
    groups: list[list[int]] = []
    for row in sorted((r for r, n in enumerate(sizes) if n > 0), key=lambda r: -sizes[r]):
        longest = sizes[groups[-1][0]] if groups else 0
        if groups and (longest < GROUP_MIN_LONGEST or sizes[row] >= GROUP_RATIO * longest):
            groups[-1].append(row)
        else:
            groups.append([row])
    return [torch.tensor(sorted(g), device=lengths.device) for g in groups]


def _group(rows: torch.Tensor, row_of: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> LengthGroup:
    place = torch.full_like(lengths, -1)
    place[rows] = torch.arange(len(rows), device=rows.device)
    members = (place[row_of] >= 0).nonzero().squeeze(-1)
    group_lengths = lengths[rows]
    longest = int(group_lengths.max())
    mask = None if bool((group_lengths == longest).all()) else _left_aligned_mask(group_lengths, longest)
    return LengthGroup(members, place[row_of[members]] * longest + offsets[members], len(rows), longest, mask)


def _lay_out(x: torch.Tensor, group: LengthGroup) -> torch.Tensor:
    """The group's tokens of ``x`` (``[tokens, heads, dim]``) as ``[rows, heads, longest, dim]``, zeros after each
    row's end."""
    laid = x.new_zeros(group.rows * group.longest, *x.shape[1:]).index_copy(0, group.slots,
                                                                            x.index_select(0, group.members))
    return laid.view(group.rows, group.longest, *x.shape[1:]).transpose(1, 2)


def _left_aligned_mask(lengths: torch.Tensor, longest: int) -> torch.Tensor:
    positions = torch.arange(longest, device=lengths.device)
    causal = positions[None, :] <= positions[:, None]  # [query, key]
    inside = positions[None, :] < lengths[:, None]  # [row, key]
    # A query past its row's end still sees itself, so no row of scores is all masked (NaN).
    return (causal[None] & inside[:, None, :] | torch.eye(longest, dtype=torch.bool, device=lengths.device))[:, None]
