"""The run's prompts in order: the task's examples encoded for generation, each prompt with a ``uid`` of its own."""

from __future__ import annotations

from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from hybridflow_lab.config import RolloutConfig
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks.base import Example
from hybridflow_lab.tasks.prompts import encode_prompts
from hybridflow_lab.trainer.task_setup import TaskSetup

Position = tuple[dict[str, Any], int]  # the task source's state and the next uid


class PromptStream:
    """Draws the next prompts from ``task``'s source, left-padded by ``tokenizer`` under ``rollout``'s lengths; the
    ``uid`` of each prompt is the group id of its samples."""

    def __init__(self, task: TaskSetup, tokenizer: PreTrainedTokenizerBase, rollout: RolloutConfig,
                 next_uid: int = 0) -> None:
        self.task, self.tokenizer, self.rollout = task, tokenizer, rollout
        self.next_uid = next_uid

    def next_batch(self, n: int) -> DataBatch:
        """The next ``n`` prompts with their ground truths, ``data_source`` and ``uid``."""
        examples = self.task.source.next_batch(n)
        batch = self.encode(examples)
        batch["data_source"] = [e.data_source for e in examples]
        batch["uid"] = np.arange(self.next_uid, self.next_uid + len(examples))
        self.next_uid += len(examples)
        return batch

    def encode(self, examples: list[Example]) -> DataBatch:
        """``examples``' prompts as generation reads them, with their answers as ``ground_truth``."""
        return encode_prompts(self.tokenizer, [e.prompt for e in examples], self.rollout.max_prompt_tokens,
                              [e.answer for e in examples], self.rollout.pad_prompts, self.task.prompt_format)

    def position(self) -> Position:
        """Where the stream stands: ``restore`` returns it here."""
        return self.task.source.state_dict(), self.next_uid

    def restore(self, position: Position) -> None:
        source, self.next_uid = position
        self.task.source.load_state_dict(source)
