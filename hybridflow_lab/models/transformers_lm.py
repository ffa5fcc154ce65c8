"""Any causal LM ``transformers`` loads, behind the project's decoder interface (``DecoderLM``'s ``forward``).

The engines train it, compute its log-probs and generate with it as they do the project's decoder: the model's
own ``transformers`` code runs (its norms, soft-capping, sliding windows, mixtures of experts), over its own KV
cache (``TransformersCache``). Its parameters keep the checkpoint's names (``model.*``, ``lm_head.*``): the
``transformers`` model's children are this module's, and a saved directory is in the checkpoint's format
(``checkpoint_state``), so it loads back in ``transformers``.
Packed passes (``engine.remove_padding``) compute the padded batch and return the packed pass's outputs. What
this path does not do (tensor parallelism, the compiled and oneDNN decoding steps) the config check refuses
before any worker starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from hybridflow_lab.models.decoder import positions_from_mask
from hybridflow_lab.models.packing import Packing
from hybridflow_lab.models.tensor_parallel import SINGLE


class TransformersCache:
    """``transformers``' own KV cache with what the generation loop keeps beside it: which slots hold real tokens
    and each row's next position (prompts arrive left-padded)."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.kv = DynamicCache(config=config)
        self.mask: torch.Tensor | None = None
        self.next_position: torch.Tensor | None = None

    def extend(self, attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        """Take ``input_ids``' tokens (``attention_mask``: which are real, all of them if None); their positions."""
        real = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        start = torch.zeros(len(input_ids), dtype=torch.long, device=input_ids.device) \
            if self.next_position is None else self.next_position
        positions = start[:, None] + (real.cumsum(-1) - 1).clamp(min=0)
        self.mask = real if self.mask is None else torch.cat([self.mask, real], dim=1)
        self.next_position = start + real.sum(-1)
        return positions

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``, in that order (as ``KVCache.keep_rows``)."""
        self.kv.batch_select_indices(rows)
        if self.mask is not None and self.next_position is not None:
            self.mask, self.next_position = self.mask[rows], self.next_position[rows]


class TransformersLM(nn.Module):
    """A ``transformers`` causal LM whose ``forward`` is the project decoder's: logits ``[batch, length, vocab]``
    (the last ``keep_last`` positions when > 0), over a ``TransformersCache`` when generating."""

    def __init__(self, causal_lm: PreTrainedModel) -> None:
        super().__init__()
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        self.config = causal_lm.config
        self.tp = SINGLE
        self.no_split_modules = tuple(getattr(causal_lm, "_no_split_modules", None) or ())
        # bound to the transformers model, whose children are this module's: the family's own forward runs
        self.causal_lm_forward = causal_lm.forward
        self.causal_lm = [causal_lm]  # in a list: not a child, so its parameters are not listed twice

    def train(self, mode: bool = True) -> TransformersLM:
        self.causal_lm[0].training = mode
        return super().train(mode)

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (this model's names) in the checkpoint's format: ``transformers`` undoes the conversions it
        applies on loading (Qwen3-MoE's experts, fused into one tensor in memory, are saved one per expert), so
        that vLLM and other readers find the names they expect."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.causal_lm[0], state)

    def new_cache(self, rows: int, max_length: int, dtype: torch.dtype, device: torch.device | str) -> Any:
        return TransformersCache(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: TransformersCache | None = None,
        keep_last: int = 0,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        if packing is not None:
            return self._packed_outputs(input_ids, attention_mask, position_ids, packing)
        if cache is not None:
            position_ids = cache.extend(attention_mask, input_ids)
            attention_mask = cache.mask
        elif position_ids is None:
            position_ids = positions_from_mask(attention_mask, input_ids)
        out = self.causal_lm_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     past_key_values=None if cache is None else cache.kv,
                                     use_cache=cache is not None, logits_to_keep=keep_last)
        return out.logits

    def _packed_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, packing: Packing) -> torch.Tensor:
        """The logits ``packing`` asks for, ``[outputs, vocab]``, from a padded pass: the family's attention takes
        padded batches only, so padding costs compute here, but the outputs are the packed pass's. Only the
        columns from the first output on are projected to the vocabulary."""
        length = input_ids.shape[1]
        rows, columns = packing.output_positions // length, packing.output_positions % length
        keep = length - int(columns.min())
        logits = self.forward(input_ids, attention_mask, position_ids, keep_last=keep)
        return logits[rows, columns - (length - keep)]


class TransformersScalarModel(nn.Module):
    """A ``transformers`` backbone with one scalar per position (the critic's values, the reward model's scores),
    named as ``*ForSequenceClassification`` with one label (``model.*``, ``score.weight``), so a public reward
    model's directory loads as it is; ``forward`` is ``heads.ScalarHeadModel``'s."""

    def __init__(self, backbone: PreTrainedModel, score: nn.Linear, config: PretrainedConfig) -> None:
        super().__init__()
        self.model, self.score, self.config = backbone, score, config
        self.no_split_modules = tuple(getattr(backbone, "_no_split_modules", None) or ())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, packing: Packing | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, input_ids)
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        scores = self.score(hidden).squeeze(-1)
        if packing is None:
            return scores
        return scores.flatten()[packing.output_positions]


@contextmanager
def progress_bars_off() -> Iterator[None]:
    """transformers' loading bars off inside the block (each rank loading a model would print one)."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def load_transformers_scalar_model(path: str, with_head: bool) -> TransformersScalarModel:
    """A model directory as a ``TransformersScalarModel``: a sequence classifier's backbone and head
    (``with_head``), or a causal LM's backbone under a zero head (the usual PPO critic initialisation)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    where = {"local_files_only": True, "dtype": torch.float32, "attn_implementation": "sdpa", "use_safetensors": True}
    if with_head:
        with progress_bars_off():
            classifier = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **where)
        return TransformersScalarModel(getattr(classifier, classifier.base_model_prefix), classifier.score,
                                       classifier.config)
    with progress_bars_off():
        backbone = AutoModel.from_pretrained(path, **where)
    score = nn.Linear(backbone.config.hidden_size, 1, bias=False)
    nn.init.zeros_(score.weight)
    return TransformersScalarModel(backbone, score, backbone.config)


def load_transformers_lm(path: str, dtype: torch.dtype = torch.float32) -> TransformersLM:
    """A local model directory through ``AutoModelForCausalLM``, as a ``TransformersLM`` (PyTorch's SDPA attention,
    which takes the padded masks the engines pass, on every device; safetensors weights only, as the project's
    decoder reads)."""
    from transformers import AutoModelForCausalLM

    with progress_bars_off():
        causal_lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                         attn_implementation="sdpa", use_safetensors=True)
    return TransformersLM(causal_lm)
