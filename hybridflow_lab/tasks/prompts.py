"""Turning prompt texts into the left-padded batch that generation takes."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from hybridflow_lab.protocol import DataBatch


def token_counts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[int]:
    """How many tokens each text has as a prompt (no special tokens added)."""
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    max_tokens: int,
    ground_truths: Sequence[object] | None = None,
    pad_to_max: bool = False,
) -> DataBatch:
    """``input_ids`` / ``attention_mask`` left-padded to the longest prompt, plus ``prompt_text``.

    A prompt longer than ``max_tokens`` is an error naming its row (truncating a prompt
    silently changes the task).
    """
    for row, count in enumerate(token_counts(tokenizer, texts)):
        if count > max_tokens:
            raise ValueError(f"prompt row {row} has {count} tokens, more than max_prompt_tokens={max_tokens}: "
                             f"{texts[row][:60]!r}; raise rollout.max_prompt_tokens or shorten the prompt")
    tokenizer.padding_side = "left"
    padding = {"padding": "max_length", "max_length": max_tokens} if pad_to_max else {"padding": True}
    encoded = tokenizer(list(texts), add_special_tokens=False, return_tensors="pt", **padding)
    columns: dict[str, object] = {"prompt_text": list(texts)}
    if ground_truths is not None:
        columns["ground_truth"] = list(ground_truths)
    return DataBatch({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}, columns)
