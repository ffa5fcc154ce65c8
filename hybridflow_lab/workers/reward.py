"""Reward roles: a learned reward model, and rule-based rewards from (prompt, response, ground truth)."""

from __future__ import annotations

import torch

from hybridflow_lab.algorithms.masked import token_level
from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.models.heads import last_token_scores, load_scalar_model
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.reward_guard import FAIL_ON_ERROR, RewardFn, RewardGuard


def rule_scores(batch: DataBatch, fn: RewardFn, guard: RewardGuard = FAIL_ON_ERROR) -> DataBatch:
    """Score every row with ``fn(prompt_text, response_text, ground_truth)`` (runs wherever it is called);
    rows ``fn`` cannot score are handled by ``guard``, and counted in ``meta["reward_failures"]``."""
    prompts = batch["prompt_text"] if "prompt_text" in batch else [""] * len(batch)
    truths = batch["ground_truth"] if "ground_truth" in batch else [None] * len(batch)
    values, failures = guard.scores(fn, list(zip(prompts, batch["response_text"], truths, strict=True)))
    scores = torch.tensor(values, device=batch["response_mask"].device)
    return DataBatch({"scores": scores, "token_level_scores": token_level(scores, batch["response_mask"])},
                     meta={"reward_failures": failures})


class RewardModelWorker(Worker):
    """A scalar-head model scoring whole sequences (the score at the last real token)."""

    def __init__(self, model_path: str, micro_batch: int = 8) -> None:
        self.model = load_scalar_model(model_path, trained_head=True).eval().requires_grad_(False).to(self.device)
        self.micro_batch = micro_batch

    @register(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: DataBatch) -> DataBatch:
        """``scores`` per sequence and ``token_level_scores`` (the score on the last response token)."""
        with torch.no_grad():
            scores = torch.cat([
                last_token_scores(self.model(m["input_ids"], m["attention_mask"], m["position_ids"]),
                                  m["attention_mask"])
                for m in batch.split(self.micro_batch)
            ])
        return DataBatch({"scores": scores, "token_level_scores": token_level(scores, batch["response_mask"])})


class RuleRewardWorker(Worker):
    """Rule rewards in worker processes, for functions too slow for the controller (code execution, ...)."""

    def __init__(self, fn: RewardFn, guard: RewardGuard = FAIL_ON_ERROR) -> None:
        self.fn, self.guard = fn, guard

    @register(Dispatch.DP_COMPUTE)
    def compute_rule_score(self, batch: DataBatch) -> DataBatch:
        return rule_scores(batch, self.fn, self.guard)
