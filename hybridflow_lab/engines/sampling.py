"""Sampling parameters and the token-level maths shared by generation and training."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token; ``n`` samples per prompt."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    greedy: bool = False
    n: int = 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # besides the tokenizer's EOS
    stop: tuple[str, ...] = ()  # text that ends a response, kept in it (an agent's end of a tool call)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    forced_lengths: tuple[int, ...] = ()  # benchmarks: row i ends with EOS after forced_lengths[i % len] tokens
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0 and not self.greedy:
            raise ValueError(f"temperature must be > 0 (or set greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not 1 <= length <= self.max_new_tokens for length in self.forced_lengths):
            raise ValueError(f"forced_lengths must each be in [1, max_new_tokens], got {self.forced_lengths}")
        if self.forced_lengths and self.ignore_eos:
            raise ValueError("forced_lengths ends each response with EOS; it needs ignore_eos=False")
        if self.top_k < 0 or self.n < 1:
            raise ValueError(f"top_k must be >= 0 and n >= 1, got top_k={self.top_k}, n={self.n}")


POSITIONS_PER_CHUNK = 1024  # positions whose float32 scores over the whole vocabulary exist at once


def _by_position_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], logits: torch.Tensor,
                        *per_position: torch.Tensor) -> list[torch.Tensor]:
    """``fn(logits_chunk, *chunks)`` over chunks of positions, each of its per-position outputs reassembled to
    ``logits.shape[:-1]``: the float32 copy a low-precision or temperature-scaled ``[positions, vocab]`` needs is
    made one chunk at a time."""
    rows = logits.reshape(-1, logits.shape[-1]).split(POSITIONS_PER_CHUNK)
    others = [t.reshape(-1).split(POSITIONS_PER_CHUNK) for t in per_position]
    results = [fn(chunk, *parts) for chunk, *parts in zip(rows, *others, strict=True)]
    return [torch.cat(column).view(logits.shape[:-1]) for column in zip(*results, strict=True)]


def _log_softmax(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    scores = rows.float() / temperature if temperature != 1.0 else rows.float()
    return scores.log_softmax(-1)


def _entropy(log_p: torch.Tensor) -> torch.Tensor:
    return -(log_p.exp() * log_p).sum(-1)


def _picked(log_p: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return log_p.gather(-1, ids[:, None]).squeeze(-1)


def log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), in float32; ``logits[..., v]`` and ``tokens[...]``."""
    return _by_position_chunks(lambda rows, ids: (_picked(_log_softmax(rows, temperature), ids),), logits, tokens)[0]


def log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                          entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs_from_logits`` and the entropy of softmax(logits / temperature) per position, in float32, from one
    log-softmax per chunk. Without ``entropy_grad`` the entropy is a detached metric: autograd saves none of its
    ``[positions, vocab]`` intermediates, which an update whose loss has no entropy term does not need."""

    def chunk(rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_p = _log_softmax(rows, temperature)
        return _picked(log_p, ids), _entropy(log_p if entropy_grad else log_p.detach())

    log_probs, entropy = _by_position_chunks(chunk, logits, tokens)
    return log_probs, entropy


def force_lengths(logits: torch.Tensor, generated: int, lengths: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``logits`` for the next token of rows that have ``generated`` tokens and must end with EOS at ``lengths``:
    EOS ruled out before the last token, the only choice at it."""
    last = (lengths == generated + 1)[:, None]
    is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_token_id
    return logits.masked_fill(last & ~is_eos | ~last & is_eos, float("-inf"))


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``[batch, vocab]`` logits (temperature, then top-k, then top-p), and its log-prob
    under the distribution it was drawn from: softmax(logits / temperature) renormalised over the tokens top-k
    and top-p keep (the behaviour policy an importance weight needs). Greedy decoding reports
    softmax(logits / temperature)."""
    if params.greedy:
        tokens = logits.argmax(-1)
        return tokens, log_probs_from_logits(logits, tokens, params.temperature)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_scores.softmax(-1) >= params.top_p  # keep the token that crosses top_p
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    tokens = torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)
    return tokens, scores.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
