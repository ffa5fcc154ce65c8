"""Turning prompt texts into the left-padded batch that generation takes, through the model's chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridflow_lab.protocol import DataBatch


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer carries a chat template (instruct models' tokenizers do; this project's toys don't)."""
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptFormat:
    """How a task's prompt becomes the text the model reads.

    With ``chat`` the tokenizer's chat template renders an optional system turn, each worked example of
    ``shots`` (prompt, answer) as a user turn and the assistant's reply, the prompt as the user's turn and the
    assistant's generation prompt. Otherwise the text is the system prompt and a newline when one is set, each
    worked example's prompt and answer on a line of its own, then the prompt.
    """

    chat: bool = False
    system_prompt: str = ""
    shots: tuple[tuple[str, str], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()  # the tools' OpenAI-format schemas, for the chat template's ``tools=``
    tools_text: str = ""  # the tools described in text, where the template does not render ``tools`` (or raw)

    def render(self, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[str]:
        """The model-facing text of each prompt (special tokens written out, e.g. ``<|im_start|>``). Tools go
        through the chat template where it renders them, else ``tools_text`` joins the system prompt."""
        native = self.chat and bool(self.tools) and renders_tools(tokenizer, self.tools)
        system = "\n\n".join(part for part in (self.system_prompt, "" if native else self.tools_text) if part)
        if not self.chat:
            head = "".join(f"{line}\n" for line in [system] if line)
            head += "".join(f"{prompt}{answer}\n" for prompt, answer in self.shots)
            return [head + text for text in texts]
        turns = [{"role": "system", "content": system}] if system else []
        for prompt, answer in self.shots:
            turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        tools = {"tools": list(self.tools)} if native else {}
        return [tokenizer.apply_chat_template([*turns, {"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True, **tools) for text in texts]


_RENDERS_TOOLS: dict[tuple[str, str], bool] = {}  # (chat template, tools as JSON) -> whether it renders them


def renders_tools(tokenizer: PreTrainedTokenizerBase, tools: Sequence[dict[str, Any]]) -> bool:
    """Whether the tokenizer's chat template writes ``tools`` into the prompt (many ignore the argument); probed once
    per template and tools (every prompt of a run asks)."""
    key = (tokenizer.chat_template, json.dumps(list(tools), sort_keys=True))
    if key not in _RENDERS_TOOLS:
        turn = [{"role": "user", "content": "."}]
        with_tools = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True, tools=list(tools))
        _RENDERS_TOOLS[key] = with_tools != tokenizer.apply_chat_template(turn, tokenize=False,
                                                                          add_generation_prompt=True)
    return _RENDERS_TOOLS[key]



RAW = PromptFormat()


def token_counts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                 prompt_format: PromptFormat = RAW) -> list[int]:
    """How many tokens each text has as a prompt once rendered by ``prompt_format`` (no special tokens added)."""
    rendered = prompt_format.render(tokenizer, texts)
    return [len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    max_tokens: int,
    ground_truths: Sequence[object] | None = None,
    pad_to_max: bool = False,
    prompt_format: PromptFormat = RAW,
) -> DataBatch:
    """``input_ids`` / ``attention_mask`` of the rendered prompts, left-padded to the longest, plus ``prompt_text``
    (the task's own text, which reward functions see).

    A rendered prompt longer than ``max_tokens`` is an error naming its row (truncating a prompt
    silently changes the task).
    """
    rendered = prompt_format.render(tokenizer, texts)
    for row, count in enumerate(token_counts(tokenizer, rendered)):
        if count > max_tokens:
            raise ValueError(f"prompt row {row} has {count} tokens, more than max_prompt_tokens={max_tokens}: "
                             f"{texts[row][:60]!r}; raise rollout.max_prompt_tokens or shorten the prompt")
    tokenizer.padding_side = "left"
    padding = {"padding": "max_length", "max_length": max_tokens} if pad_to_max else {"padding": True}
    encoded = tokenizer(rendered, add_special_tokens=False, return_tensors="pt", **padding)
    columns: dict[str, object] = {"prompt_text": list(texts)}
    if ground_truths is not None:
        columns["ground_truth"] = list(ground_truths)
    return DataBatch({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}, columns)


def rendered_prompts(tokenizer: PreTrainedTokenizerBase, batch: DataBatch, special_tokens: bool = False) -> list[str]:
    """Each row's prompt as the model read it, decoded from its ids (a prompt batch's ``input_ids`` or a generated
    batch's ``prompts``) without the padding; special tokens written out when ``special_tokens``."""
    ids = batch["prompts"] if "prompts" in batch else batch["input_ids"]
    real = batch["attention_mask"][:, : ids.shape[1]].bool()
    return [tokenizer.decode(row[keep], skip_special_tokens=not special_tokens) for row, keep in zip(ids, real,
                                                                                                      strict=True)]
