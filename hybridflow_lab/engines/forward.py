"""Forward passes over ``prompt | response`` sequences: response log-probs, entropies, values.

Batches use the layout of ``torch_rollout.sequences_batch``: ``input_ids``,
``attention_mask`` and ``position_ids`` over the whole sequence, ``responses`` for the
last ``R`` positions.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow_lab.engines.sampling import entropy_from_logits, log_probs_from_logits
from hybridflow_lab.protocol import DataBatch


def response_logits(module: nn.Module, batch: DataBatch) -> torch.Tensor:
    """Logits that predict each response token: ``[batch, R, vocab]``."""
    length = batch["responses"].shape[1]
    logits = module(batch["input_ids"], batch["attention_mask"], batch["position_ids"], keep_last=length + 1)
    return logits[:, :-1]


def response_log_probs(module: nn.Module, batch: DataBatch, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under softmax(logits / temperature), and optionally entropies."""
    logits = response_logits(module, batch)
    log_probs = log_probs_from_logits(logits, batch["responses"], temperature)
    return log_probs, entropy_from_logits(logits, temperature) if with_entropy else None


def response_values(module: nn.Module, batch: DataBatch) -> torch.Tensor:
    """Critic values for the positions that produce each response token: ``[batch, R]``."""
    length = batch["responses"].shape[1]
    values = module(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return values[:, -length - 1 : -1]


def response_nll(module: nn.Module, batch: DataBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the response tokens, summed (supervised fine-tuning's loss)."""
    log_probs, _ = response_log_probs(module, batch)
    return -(log_probs * batch["response_mask"]).sum(), {}


def count_response_tokens(batch: DataBatch) -> float:
    """The averaging unit of token-mean losses."""
    return float(batch["response_mask"].sum())
