"""A decoder backbone with a scalar head: the critic (a value per token) and the reward model.

Parameter names follow transformers' ``*ForSequenceClassification`` with one label
(``model.*`` and ``score.weight``), so these models save and load as HF directories.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn
from transformers import PretrainedConfig

from hybridflow_lab.models.decoder import Backbone, init_weights
from hybridflow_lab.models.factory import load_config, load_matching, read_weights, weight_names
from hybridflow_lab.models.families import model_impl
from hybridflow_lab.models.packing import Packing
from hybridflow_lab.models.transformers_lm import TransformersScalarModel, load_transformers_scalar_model

SCORE_HEAD = "score.weight"


class ScalarHeadModel(nn.Module):
    """``forward`` gives one scalar per position ``[batch, length]`` (with ``packing``, per output ``[outputs]``)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, packing: Packing | None = None) -> torch.Tensor:
        return self.score(self.model(input_ids, attention_mask, position_ids, packing=packing)).squeeze(-1)


def scalar_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of a one-label sequence-classification model on the same backbone."""
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.architectures = [config.architectures[0].replace("ForCausalLM", "ForSequenceClassification")] \
        if config.architectures else None
    return config


def load_scalar_model(path: str | os.PathLike[str], seed: int = 0, trained_head: bool = False, impl: str = "auto"
                      ) -> ScalarHeadModel | TransformersScalarModel:
    """Load a scalar-head model; from a causal-LM directory the backbone loads and the head starts at zero.

    Starting the critic from the policy's backbone is the usual PPO initialisation. A reward model passes
    ``trained_head=True``: a zero head would score every sequence 0, so a directory without one is refused. The
    project's decoder runs the families it has, transformers' models the others (``families.model_impl``).
    """
    config = load_config(path)
    with_head = SCORE_HEAD in weight_names(path)
    if trained_head and not with_head:
        raise ValueError(untrained_head_message(path))
    if model_impl(config, impl) == "transformers":
        return load_transformers_scalar_model(str(path), with_head)
    weights = read_weights(path)
    model = ScalarHeadModel(scalar_config(config))
    if with_head:
        load_matching(model, weights, str(path))
    else:
        init_weights(model.score, std=0.0, seed=seed)
        load_matching(model, weights, str(path), allow_missing=(SCORE_HEAD,), ignore_unexpected=("lm_head.",))
    return model


def has_trained_head(path: str | os.PathLike[str]) -> bool:
    """Whether a model directory holds a scalar head (a reward model or a critic), not only a causal LM."""
    return SCORE_HEAD in weight_names(path)


def untrained_head_message(path: str | os.PathLike[str]) -> str:
    """Why a causal-LM directory cannot be a reward model, and what to use instead."""
    return (f"{path} has no scalar head ({SCORE_HEAD}): it is a causal LM, not a trained reward model, and would "
            "score every response 0; point it at a reward model's directory (a ScalarHeadModel saved with "
            "save_model_dir), or leave reward_model_path empty to score with the task's rule")


def last_token_scores(scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar at each row's last real token (the reward model's score of the whole sequence)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.bool()).argmax(-1)
    return scores.gather(1, last[:, None]).squeeze(1)
