"""A few rows of a step's batch as plain dicts: what ``lab.show``, the dashboards and wandb display."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridflow_lab.protocol import DataBatch

TEXT_COLUMNS = {"prompt_text": "prompt", "response_text": "response", "ground_truth": "ground_truth"}
SCALAR_COLUMNS = {"scores": "score", "costs": "cost"}


def sample_rows(batch: DataBatch, rows: int = 8) -> list[dict[str, Any]]:
    """The first ``rows`` sequences: prompt, response, ground truth, score (cost) and mean advantage."""
    head = batch[: min(rows, len(batch))]
    table: list[dict[str, Any]] = [{} for _ in range(len(head))]
    for key, name in TEXT_COLUMNS.items():
        if key in head:
            for row, value in zip(table, head[key], strict=True):
                row[name] = str(value)
    for key, name in SCALAR_COLUMNS.items():
        if key in head:
            for row, value in zip(table, head[key].tolist(), strict=True):
                row[name] = float(value)
    if "advantages" in head:
        mask = head["response_mask"].float()
        means = (head["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        for row, value in zip(table, means.tolist(), strict=True):
            row["advantage"] = value
    return table


def rendered_prompts(tokenizer: PreTrainedTokenizerBase, batch: DataBatch, special_tokens: bool = False) -> list[str]:
    """Each row's prompt as the model read it, decoded from its ids (a prompt batch's ``input_ids`` or a generated
    batch's ``prompts``) without the padding; special tokens written out when ``special_tokens``."""
    ids = batch["prompts"] if "prompts" in batch else batch["input_ids"]
    real = batch["attention_mask"][:, : ids.shape[1]].bool()
    return [tokenizer.decode(row[keep], skip_special_tokens=not special_tokens) for row, keep in zip(ids, real,
                                                                                                      strict=True)]
