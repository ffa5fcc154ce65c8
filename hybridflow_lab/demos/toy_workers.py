"""Toy RLHF roles for the controller demo: real dispatch and real collectives, no real model.

The rollout role is a one-layer character model whose projection is split across the
tensor-parallel ranks of its mesh (row-parallel: each rank holds a slice of the input
dimension and the pair all-reduces partial logits), so the MESH protocol has something
genuine to do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Dispatch, Worker, register

VOCAB = "abcdefghijklmnopqrstuvwxyz "


def toy_weight(seed: int = 0) -> torch.Tensor:
    """The full next-character projection ``[vocab_out, vocab_in]`` every role derives its copy from."""
    return torch.randn(len(VOCAB), len(VOCAB), generator=torch.Generator().manual_seed(seed))


def one_hot_last(texts: list[str]) -> torch.Tensor:
    index = torch.tensor([VOCAB.index(t[-1]) for t in texts])
    return torch.nn.functional.one_hot(index, len(VOCAB)).float()


def greedy_extend(texts: list[str], logits_of: Callable[[torch.Tensor], torch.Tensor], new_chars: int) -> list[str]:
    """Append ``new_chars`` greedy characters, asking ``logits_of(one_hot)`` for the next-char logits."""
    out = list(texts)
    for _ in range(new_chars):
        out = [t + VOCAB[i] for t, i in zip(out, logits_of(one_hot_last(out)).argmax(-1).tolist(), strict=True)]
    return out


class ToyRollout(Worker):
    """Generation role: tensor-parallel over the ``rollout`` mesh's ``tp`` axis."""

    def __init__(self, seed: int = 0, new_chars: int = 6) -> None:
        tp, tp_size = self.mesh_coords("rollout")["tp"], self.mesh("rollout").axis_size("tp")
        columns = torch.arange(len(VOCAB)).chunk(tp_size)[tp]  # this rank's slice of the input dimension
        self.input_slice = slice(int(columns[0]), int(columns[-1]) + 1)
        self.weight_shard = toy_weight(seed)[:, self.input_slice]
        self.tp_group = self.device_mesh("rollout").get_group("tp")
        self.new_chars = new_chars

    def _logits(self, one_hot: torch.Tensor) -> torch.Tensor:
        partial = one_hot[:, self.input_slice] @ self.weight_shard.T
        dist.all_reduce(partial, group=self.tp_group)  # row-parallel: sum the partial products
        return partial

    @register(Dispatch.MESH("rollout"), blocking=False)
    def generate(self, prompts: DataBatch) -> DataBatch:
        """Extend every prompt greedily; returns prompt, response and the rank that produced it."""
        with self.span("decode", tokens=len(prompts) * self.new_chars):
            texts = greedy_extend(list(prompts["prompt"]), self._logits, self.new_chars)
        responses = [t[len(p):] for t, p in zip(texts, prompts["prompt"], strict=True)]
        return DataBatch(
            {"rollout_rank": torch.full((len(prompts),), self.rank)},
            {"prompt": list(prompts["prompt"]), "response": responses},
        )


class ToyReference(Worker):
    """Reference role, colocated with the rollout in the same processes: scores responses."""

    def __init__(self, seed: int = 0) -> None:
        self.log_softmax = torch.log_softmax(toy_weight(seed), dim=0)

    @register(Dispatch.DP_COMPUTE)
    def log_prob(self, batch: DataBatch) -> DataBatch:
        """Sum of per-character log-probs of each response under the full (unsharded) model."""
        totals = []
        for prompt, response in zip(batch["prompt"], batch["response"], strict=True):
            text = prompt + response
            steps = range(len(prompt), len(text))
            totals.append(sum(self.log_softmax[VOCAB.index(text[i]), VOCAB.index(text[i - 1])].item() for i in steps))
        return DataBatch({"ref_log_prob": torch.tensor(totals)})


class ToyReward(Worker):
    """Reward role on its own pool: one point per vowel in the response."""

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: DataBatch) -> DataBatch:
        scores = [float(sum(ch in "aeiou" for ch in r)) for r in batch["response"]]
        return DataBatch({"reward": torch.tensor(scores), "reward_rank": torch.full((len(batch),), self.rank)})
