"""``hybridflow-lab bench rollout``: the built-in generation engine against ``transformers`` ``generate``.

Same weights, same left-padded prompts, pure sampling (temperature 1, no top-k/top-p), exactly
``new_tokens`` per prompt (EOS ignored, so both sides do the same work); the sides alternate
and the median of ``repeats`` runs is reported.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.engines.torch_rollout import generate
from hybridflow_lab.models import char_tokenizer, create_model_dir, describe, load_causal_lm


def arithmetic_prompts(count: int, length: int) -> list[str]:
    """``a+b=`` prompts (a, b < 1000) left-padded with spaces to ``length`` characters."""
    return [f"{(i * 37) % 1000}+{(i * 91 + 5) % 1000}=".rjust(length) for i in range(count)]


def run(size: str = "small", prompts: int = 64, new_tokens: int = 64, prompt_tokens: int = 16,
        repeats: int = 3) -> dict[str, Any]:
    tokenizer = char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = create_model_dir(f"{tmp}/model", size, "qwen2", seed=0, tokenizer=tokenizer)
        ours = load_causal_lm(path).eval()
        theirs = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                     dtype=torch.float32).eval()
    batch = tokenizer(arithmetic_prompts(prompts, prompt_tokens), return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=0)

    def ours_run() -> None:
        generate(ours, ids, mask, params, tokenizer.eos_token_id, tokenizer.pad_token_id)

    def hf_run() -> None:
        with torch.inference_mode():
            theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)

    times: dict[str, list[float]] = {"torch": [], "hf": []}
    ours_run(), hf_run()  # warm-up
    for _ in range(repeats):
        for name, fn in (("torch", ours_run), ("hf", hf_run)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    tokens = prompts * new_tokens
    torch_s, hf_s = statistics.median(times["torch"]), statistics.median(times["hf"])
    return {
        "bench": "rollout", "model": size, "parameters": describe(ours)["parameters"], "prompts": prompts,
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "threads": torch.get_num_threads(),
        "torch_tok_s": round(tokens / torch_s, 1), "hf_tok_s": round(tokens / hf_s, 1),
        "ratio": round(hf_s / torch_s, 3),
    }
