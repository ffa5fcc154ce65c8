"""One generation call as a batch: what the actor's ranks and a rollout group's ranks both return."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.protocol import DataBatch


class Generator(Protocol):
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams | None = None) -> dict[str, torch.Tensor]: ...


def responses_batch(engine: Generator, tokenizer: Any, prompts: DataBatch, params: SamplingParams,
                    attrs: dict[str, Any]) -> DataBatch:
    """``params.n`` responses per left-padded prompt from ``engine``: the sequence layout for training,
    ``rollout_log_probs``, the decoded ``response_text`` and every non-tensor column of the prompts repeated
    per sample; the tokens generated go into ``attrs`` (the span's)."""
    out = engine.generate(prompts["input_ids"], prompts["attention_mask"], params)
    attrs["tokens"] = int(out["response_mask"].sum())
    texts = tokenizer.batch_decode(out["responses"] * out["response_mask"], skip_special_tokens=True)
    repeated = {k: np.repeat(v, params.n, axis=0) for k, v in prompts.non_tensors.items()}
    return DataBatch(out, {**repeated, "response_text": texts}, prompts.meta)
