"""Forward passes over ``prompt | response`` sequences: response log-probs, entropies, values.

Batches use the layout of ``torch_rollout.sequences_batch``: ``input_ids``,
``attention_mask`` and ``position_ids`` over the whole sequence, ``responses`` for the
last ``R`` positions. With ``remove_padding`` the model runs on the real tokens only
(``models.packing``) and computes outputs only where a real response token is predicted; the
results are the padded pass's at every real response token and 0 elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow_lab.engines.sampling import log_probs_and_entropy, log_probs_from_logits
from hybridflow_lab.models.packing import Packing
from hybridflow_lab.protocol import DataBatch


def response_logits(module: nn.Module, batch: DataBatch) -> torch.Tensor:
    """Logits that predict each response token: ``[batch, R, vocab]``."""
    length = batch["responses"].shape[1]
    logits = module(batch["input_ids"], batch["attention_mask"], batch["position_ids"], keep_last=length + 1)
    return logits[:, :-1]


def response_packing(batch: DataBatch) -> Packing:
    """The packing of ``batch`` whose outputs are the positions that predict its real response tokens."""
    attention_mask, response_mask = batch["attention_mask"], batch["response_mask"].bool()
    total, length = attention_mask.shape[1], response_mask.shape[1]
    predicting = torch.zeros_like(attention_mask, dtype=torch.bool)
    predicting[:, total - length - 1 : total - 1] = response_mask
    return Packing.of(attention_mask, predicting)


def _unpack(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-real-response-token ``values`` back to ``[batch, R]``, 0 at padding."""
    return values.new_zeros(response_mask.shape).masked_scatter(response_mask.bool(), values)


def response_log_probs(module: nn.Module, batch: DataBatch, temperature: float = 1.0, with_entropy: bool = False,
                       remove_padding: bool = False, entropy_grad: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under softmax(logits / temperature), and optionally entropies (without
    ``entropy_grad``, detached: a metric no loss differentiates)."""

    def scored(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not with_entropy:
            return log_probs_from_logits(logits, tokens, temperature), None
        return log_probs_and_entropy(logits, tokens, temperature, entropy_grad)

    if not remove_padding:
        return scored(response_logits(module, batch), batch["responses"])
    mask = batch["response_mask"]
    logits = module(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                    packing=response_packing(batch))
    log_probs, entropy = scored(logits, batch["responses"][mask.bool()])
    return _unpack(log_probs, mask), None if entropy is None else _unpack(entropy, mask)


def response_values(module: nn.Module, batch: DataBatch, remove_padding: bool = False) -> torch.Tensor:
    """Critic values for the positions that produce each response token: ``[batch, R]``."""
    if remove_padding:
        values = module(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                        packing=response_packing(batch))
        return _unpack(values, batch["response_mask"])
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
