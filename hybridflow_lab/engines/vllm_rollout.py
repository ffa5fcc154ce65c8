"""vLLM as the rollout engine (the GPU path; install the ``gpu`` extra).

vLLM loads the same HF directory as the actor. After each actor update the trainer pushes
the gathered weights with ``update_weights`` (vLLM's ``reload_weights`` worker call, which
also works on the CPU backend where ``load_weights`` does not), and the engine releases its
memory between generations with sleep/wake-up where the platform supports it (CUDA).
The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) inside the actor rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow_lab.engines.sampling import SamplingParams
from hybridflow_lab.engines.torch_rollout import sequences_batch


def vllm_sampling_kwargs(params: SamplingParams, eos_token_id: int | None) -> dict[str, Any]:
    """Our sampling parameters in vLLM's terms (top_k -1 = off; greedy = temperature 0)."""
    return {
        "n": params.n,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.max_new_tokens if params.ignore_eos else 0,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": list(params.stop_token_ids),
        "seed": params.seed,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]


def pack_outputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completions: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
    n: int,
    max_new_tokens: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """vLLM's completions (``n`` per prompt, in prompt order) in the layout of the built-in engine."""
    rows = len(completions)
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)
    scores = torch.zeros(rows, max_new_tokens)
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.long)
    for row, tokens in enumerate(completions):
        length = min(len(tokens), max_new_tokens)
        responses[row, :length] = torch.tensor(tokens[:length], dtype=torch.long)
        mask[row, :length] = 1
        if log_probs is not None:
            scores[row, :length] = torch.tensor(log_probs[row][:length])
    out = {
        "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),
        "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
        "responses": responses,
        "response_mask": mask,
        "log_probs": scores,
    }
    return sequences_batch(out, pad_token_id)


class VllmRollout:
    """A ``vllm.LLM`` on this rank's device(s), fed the actor's weights after every update."""

    def __init__(self, model_path: str, params: SamplingParams, eos_token_id: int | None, pad_token_id: int,
                 tensor_parallel: int = 1, gpu_memory_utilization: float = 0.5, seed: int = 0) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.params, self.eos_token_id, self.pad_token_id = params, eos_token_id, pad_token_id
        self.sleep_supported = torch.cuda.is_available()  # the CPU backend rejects sleep mode
        self.llm = LLM(model=model_path, tensor_parallel_size=tensor_parallel, seed=seed, enforce_eager=True,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_supported,
                       dtype="auto", load_format="safetensors")  # never "auto"'s pickle fallback

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load new weights in place (names as in the HF checkpoint), then drop cached prefixes."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the KV cache and offload the weights until the next generation (CUDA only)."""
        if self.sleep_supported:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_supported:
            self.llm.wake_up()

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams | None = None) -> dict[str, torch.Tensor]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        params = params or self.params
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in unpadded_prompts(prompt_ids, prompt_mask)]
        outputs = self.llm.generate(prompts, VllmSamplingParams(**vllm_sampling_kwargs(params, self.eos_token_id)),
                                    use_tqdm=False)
        completions = [list(c.token_ids) for out in outputs for c in out.outputs]
        log_probs = [[step[token].logprob for token, step in zip(c.token_ids, c.logprobs or [], strict=False)]
                     for out in outputs for c in out.outputs]
        return pack_outputs(prompt_ids, prompt_mask, completions, log_probs, params.n, params.max_new_tokens,
                            self.pad_token_id)
