"""Token-in/token-out trajectories: the ids the policy sampled and the ids of each observation, concatenated.

Text is decoded for display and for the environment, never re-encoded to build the training input. In the batch
a trajectory is the ``responses`` after its prompt: ``response_mask`` covers the policy's own tokens only (the
loss trains on those), ``attention_mask`` every real token (observations are context), and the rollout's
log-probs exist for the policy's tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridflow_lab.agents.environment import Role
from hybridflow_lab.models.decoder import positions_from_mask
from hybridflow_lab.tasks.base import Example

ENDINGS = ("answer", "turns", "tokens", "error")  # why a trajectory ended: metrics count each


@dataclass
class Turn:
    """One policy turn (its sampled ids, their log-probs, its text) and what answered it."""

    ids: list[int]
    log_probs: list[float]
    text: str
    reward: float = 0.0
    observation: str | None = None
    role: Role = "tool"
    observation_ids: list[int] = field(default_factory=list)
    observation_text: str = ""  # as rendered (the chat template's turn markers included)
    counts: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode on ``example``: its prompt ids, its turns, and why it ended."""

    example: Example
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    ended: str | None = None

    @property
    def length(self) -> int:
        """Tokens after the prompt: the policy's and the observations'."""
        return sum(len(t.ids) + len(t.observation_ids) for t in self.turns)

    def context(self) -> list[int]:
        """What the policy reads next: the prompt, then every turn and observation."""
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.ids + turn.observation_ids
        return ids

    @property
    def score(self) -> float:
        return sum(turn.reward for turn in self.turns)

    def segments(self) -> list[tuple[str, str]]:
        """``(kind, text)`` in order: ``policy`` turns and ``tool`` / ``user`` observations (for display)."""
        out = []
        for turn in self.turns:
            out.append(("policy", turn.text))
            if turn.observation_ids:
                out.append((turn.role, turn.observation_text))
        return out


def left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as left-padded ``[rows, longest]`` ids and their attention mask."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        mask[row, width - len(tokens):] = 1
    return ids, mask


def episode_scores(turn_rewards: Sequence[Sequence[float]]) -> torch.Tensor:
    """Each trajectory's score: the sum of its turns' rewards."""
    return torch.tensor([sum(rewards) for rewards in turn_rewards], dtype=torch.float32)


def turn_level(turn_rewards: Sequence[Sequence[float]], turn_ends: Sequence[Sequence[int]], width: int
               ) -> torch.Tensor:
    """``[rows, width]`` token rewards: each turn's reward on its last policy token (``turn_ends``), zeros
    elsewhere: per-turn credit for GAE, where ``token_level`` puts the whole episode's score on its last token."""
    rewards = torch.zeros(len(turn_rewards), width)
    for row, (turns, ends) in enumerate(zip(turn_rewards, turn_ends, strict=True)):
        for reward, end in zip(turns, ends, strict=True):
            if end >= 0:
                rewards[row, end] += reward
    return rewards


def trajectories_batch(trajectories: list[Trajectory], pad_token_id: int) -> tuple[dict[str, torch.Tensor],
                                                                                   dict[str, Any]]:
    """The training layout of ``trajectories`` (``prompts | responses`` with the masks above) and their per-row
    columns: ``response_text`` (the whole trajectory as the policy read it), ``answer_text`` (the last turn),
    ``turns``, ``turn_rewards``, ``turn_ends`` (each turn's last policy token in ``responses``, -1 for an empty
    turn), ``tool_calls`` and ``ended``."""
    rows, width = len(trajectories), max(1, max(t.length for t in trajectories))
    prompts, prompt_mask = left_padded([t.prompt_ids for t in trajectories], pad_token_id)
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    trajectory_mask = torch.zeros(rows, width, dtype=torch.long)
    log_probs = torch.zeros(rows, width)
    turn_ends: list[list[int]] = []
    for row, trajectory in enumerate(trajectories):
        at, ends = 0, []
        for turn in trajectory.turns:
            ends.append(at + len(turn.ids) - 1 if turn.ids else -1)
            for ids, policy in ((turn.ids, True), (turn.observation_ids, False)):
                responses[row, at: at + len(ids)] = torch.tensor(ids, dtype=torch.long)
                trajectory_mask[row, at: at + len(ids)] = 1
                if policy:
                    response_mask[row, at: at + len(ids)] = 1
                    log_probs[row, at: at + len(ids)] = torch.tensor(turn.log_probs)
                at += len(ids)
        turn_ends.append(ends)
    attention_mask = torch.cat([prompt_mask, trajectory_mask], dim=1)
    tensors = {"prompts": prompts, "responses": responses, "response_mask": response_mask,
               "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
               "position_ids": positions_from_mask(attention_mask, responses), "rollout_log_probs": log_probs}
    columns = {
        "response_text": ["".join(text for _, text in t.segments()) for t in trajectories],
        "answer_text": [t.turns[-1].text if t.turns else "" for t in trajectories],
        "turns": np.array([len(t.turns) for t in trajectories]),
        "turn_rewards": [[turn.reward for turn in t.turns] for t in trajectories],
        "turn_ends": turn_ends,
        "tool_calls": np.array([sum(turn.counts.get("call_attempts", 0) for turn in t.turns) for t in trajectories]),
        "ended": [t.ended or "turns" for t in trajectories],
        "segments": [t.segments() for t in trajectories],
    }
    return tensors, columns
