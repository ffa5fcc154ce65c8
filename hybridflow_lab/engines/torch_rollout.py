"""The built-in generation engine: batched prefill, then one-token decoding over a KV cache.

Runs any ``DecoderLM`` in place (no copy of the weights), on CPU or GPU. Prompts arrive
left-padded; rows that finish are dropped from the batch so later steps compute only the
live ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybridflow_lab.engines.sampling import SamplingParams, force_lengths, sample_next
from hybridflow_lab.engines.stop_strings import StopStrings
from hybridflow_lab.models.decode_step import compiled_decode_step, decode_step
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.kv_cache import KVCache
from hybridflow_lab.models.onednn_decode import PackedDecoder
from hybridflow_lab.models.routing import RouteLog, generation_routes

DECODINGS = ("eager", "compiled", "onednn")  # how each decoding step runs: see ``decoder``


def decoder(model: DecoderLM, decoding: str, rows: int) -> Callable[[torch.Tensor, KVCache], torch.Tensor]:
    """The decoding step ``decoding`` names, for ``model`` and batches of about ``rows``: ``eager``
    (``decode_step``), ``compiled`` (``compiled_decode_step``) or ``onednn`` (C++ over pre-packed weights, on the
    CPU: ``PackedDecoder``, which packs them now)."""
    if decoding not in DECODINGS:
        raise ValueError(f"decoding must be one of {DECODINGS}, got {decoding!r}")
    if decoding == "onednn":
        return PackedDecoder(model, rows).step
    if decoding == "compiled" and model.tp.enabled:
        raise ValueError("the compiled decoding step runs no collectives; decode a tensor-parallel shard eagerly")
    return functools.partial(compiled_decode_step if decoding == "compiled" else decode_step, model)


@torch.no_grad()  # not inference_mode: callers may train on the outputs
def generate(
    model: DecoderLM,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    eos_token_id: int | None,
    pad_token_id: int,
    decoding: str = "eager",
    stop: StopStrings | None = None,
) -> dict[str, torch.Tensor]:
    """Sample ``params.n`` responses per left-padded prompt; a response also ends at the token that completes one of
    ``stop``'s strings (``params.stop``, detected with the tokenizer).

    Returns ``responses`` and ``response_mask`` (``[batch * n, max_new_tokens]``, 1 up to and
    including the stop token), ``log_probs`` of the sampled tokens under the distribution they
    were drawn from (``sample_next``), and ``prompt_ids`` / ``prompt_mask`` repeated to match; for a mixture of
    experts, ``routed_experts`` (``routing.generation_routes``). ``decoding``: how
    each step after the prefill runs (``decoder``; the same logits, in fewer dispatched operations or faster GEMMs).
    """
    device = prompt_ids.device
    prompts, prompt_len = prompt_ids.shape
    batch = prompts * params.n
    step_logits = decoder(model, decoding, batch)
    stops = torch.tensor([*params.stop_token_ids, *([] if params.ignore_eos or eos_token_id is None
                                                     else [eos_token_id])], dtype=torch.long, device=device)
    generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
    dtype = next(model.parameters()).dtype
    cache = model.new_cache(prompts, prompt_len + params.max_new_tokens, dtype, device)

    responses = torch.full((batch, params.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(batch, params.max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=device)
    live = torch.arange(batch, device=device)  # original row of each row still in the cache
    forced = None
    if params.forced_lengths:
        if eos_token_id is None:
            raise ValueError("forced_lengths ends responses with EOS, and this tokenizer has none")
        schedule = torch.tensor(params.forced_lengths, device=device)
        forced = schedule[torch.arange(batch, device=device) % len(schedule)]

    decoded_rows: list[torch.Tensor] = []  # the rows each decoding pass computes, for a mixture's routes
    with RouteLog(model) as routes:
        logits = model(prompt_ids, prompt_mask, cache=cache, keep_last=1)[:, 0]
        if params.n > 1:  # one prefill per prompt, shared by its n samples (vLLM's parallel sampling)
            samples = torch.arange(prompts, device=device).repeat_interleave(params.n)
            prompt_ids, prompt_mask, logits = prompt_ids[samples], prompt_mask[samples], logits[samples]
            cache.keep_rows(samples)
        for step in range(params.max_new_tokens):
            if forced is not None:
                logits = force_lengths(logits, step, forced[live], eos_token_id)
            tokens, token_log_probs = sample_next(logits, params, generator)
            responses[live, step] = tokens
            log_probs[live, step] = token_log_probs
            done = torch.isin(tokens, stops)
            if stop is not None:
                done |= stop.completed(responses[live, : step + 1], tokens)
            if bool(done.any()):
                lengths[live[done]] = step + 1
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                live, tokens = live[keep], tokens[keep]
                cache.keep_rows(keep)
            if step + 1 < params.max_new_tokens:
                decoded_rows.append(live)
                logits = step_logits(tokens, cache)

    steps = torch.arange(params.max_new_tokens, device=device)
    response_mask = (steps[None, :] < lengths[:, None]).long()
    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "responses": responses.masked_fill(response_mask == 0, pad_token_id),
        "response_mask": response_mask,
        "log_probs": log_probs * response_mask,
    }
    if routes.routers:
        out["routed_experts"] = generation_routes(routes.passes(), decoded_rows, prompts, params.n,
                                                  params.max_new_tokens)
    return out


def sequences_batch(out: dict[str, torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The training layout of generated sequences: ``prompt | response`` with masks and positions."""
    prompt_mask, response_mask = out["prompt_mask"], out["response_mask"]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": out["prompt_ids"],
        "responses": out["responses"],
        "response_mask": response_mask,
        "input_ids": torch.cat([out["prompt_ids"], out["responses"]], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "rollout_log_probs": out["log_probs"],
        **({"routed_experts": out["routed_experts"]} if "routed_experts" in out else {}),
    }


class TorchRollout:
    """Generation with the built-in engine on a model that lives elsewhere (the actor's, shared); ``precision``
    is the training engine's forward context (its bf16 autocast), so that both compute alike. ``decoding``: how the
    decoding steps run (``decoder``; ``rollout.decoding``)."""

    def __init__(self, model: DecoderLM, params: SamplingParams, eos_token_id: int | None, pad_token_id: int,
                 precision: Callable[[], AbstractContextManager[Any]] = nullcontext, decoding: str = "eager",
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer  # for stop strings
        self.decoding = decoding
        self.params = params
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.precision = precision
        self._stops: dict[tuple[str, ...], StopStrings] = {}

    def stop_strings(self, strings: tuple[str, ...]) -> StopStrings | None:
        """The detector of ``strings`` (built once per set), or None for none."""
        if not strings:
            return None
        if self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer: build TorchRollout with tokenizer=")
        if strings not in self._stops:
            self._stops[strings] = StopStrings(self.tokenizer, strings)
        return self._stops[strings]

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams | None = None) -> dict[str, torch.Tensor]:
        """Responses for left-padded prompts, in the layout ``sequences_batch`` describes."""
        params = params or self.params
        stop = self.stop_strings(params.stop)
        was_training = self.model.training
        self.model.eval()
        try:
            with self.precision():
                out = generate(self.model, prompt_ids, prompt_mask, params, self.eos_token_id, self.pad_token_id,
                               self.decoding, stop)
        finally:
            self.model.train(was_training)
        return sequences_batch(out, self.pad_token_id)
