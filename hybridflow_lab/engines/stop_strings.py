"""Stop strings for the built-in engine: a response ends at the token that completes one of them.

The stop string stays in the response (vLLM's ``include_stop_str_in_output``): a multi-turn rollout trains on
exactly the tokens the policy sampled, the ones that closed a tool call included. Only rows whose new token
could end a stop string (its text holds one's last character) decode their last few tokens. Special tokens
count as no text (as vLLM decodes for its stop strings): ``<bos>`` does not complete a stop string ``<``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase


def token_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Each token id's text, special tokens as no text (as a stop string is matched)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)


class StopStrings:
    """Detects ``strings`` at the end of each row's generated tokens, with ``tokenizer``'s decoding."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: Sequence[str]) -> None:
        if not strings or not all(strings):
            raise ValueError(f"stop strings must be non-empty, got {list(strings)!r}")
        self.strings = tuple(strings)
        self.tokenizer = tokenizer
        texts = token_texts(tokenizer)
        last = {s[-1] for s in self.strings}
        self.candidates = torch.tensor([any(c in text for c in last) for text in texts])
        self.window = max(len(s) for s in self.strings) + 1  # a token holds at least one character

    def completed(self, generated: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Which rows' last token (``tokens``, the last column of ``generated [rows, length]``) completes a stop
        string."""
        done = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        for row in self.candidates[tokens.cpu()].nonzero().flatten().tolist():
            tail = generated[row, -self.window:].tolist()
            text = self.tokenizer.decode(tail, skip_special_tokens=True)
            before = self.tokenizer.decode(tail[:-1], skip_special_tokens=True)
            done[row] = any(s in text and s not in before for s in self.strings)
        return done


def single_token_stops(tokenizer: PreTrainedTokenizerBase, strings: Sequence[str]) -> tuple[int, ...]:
    """The ids of the tokens that complete a stop string of one token, for vLLM, which runs without a tokenizer and
    matches ids: the string's own token and every token whose text holds it (a BPE merge such as ``])``), where
    ``StopStrings`` stops too."""
    texts = token_texts(tokenizer)
    ids = []
    for text in strings:
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ValueError(f"stop string {text!r} is {len(encoded)} tokens for this tokenizer; vLLM here stops on "
                             "single tokens only: use rollout.engine=torch, or a call format that ends with one "
                             "token (the Hermes format's </tool_call> is one in Qwen's vocabulary)")
        ids += [token for token, token_text in enumerate(texts) if text in token_text]
    return tuple(sorted(set(ids)))
