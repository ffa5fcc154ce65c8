"""``hybridflow-lab bench rollout``: the built-in generation engine, ``transformers`` ``generate`` and vLLM.

Same weights, same left-padded prompts, pure sampling (temperature 1, no top-k/top-p), exactly ``new_tokens`` per
prompt (EOS ignored, so every engine does the same work). The built-in engine eager (``torch``), with its decoding
step compiled (``torch_compiled``) and in C++ over oneDNN's pre-packed weights (``torch_onednn``), both where a C++
compiler exists, and HF alternate, and the median of ``repeats`` runs is reported. vLLM runs last, where it is
installed (``make lab`` installs its CPU build): in-process it pins the process's threads for good. Its row adds the
engine's start seconds and ``greedy_match``, the fraction of greedy rows identical to the built-in engine's.

``matmul_bound_s`` is the time the generation's FLOPs (2 per non-embedding parameter per prompt and response
position) take at this process's float32 GEMM rate, and ``<engine>_over_bound`` how far each built-in variant is
from it; ``hf_over_<engine>_seconds`` is HF's time over each one's. That rate is a large square GEMM's, which the
generation's products (one row per prompt at each decoding step) do not reach: ``linear_floor_s`` is the time the
model's linear layers take through torch's own GEMMs alone, run back to back at the generation's shapes (timed in
turn with the engines), and ``<engine>_over_linear_floor`` each engine's time over it.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hybridflow_lab.bench.roofline import linear_pass, matmul_gflops
from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.engines.torch_rollout import generate
from hybridflow_lab.models import DecoderLM, char_tokenizer, create_model_dir, describe, load_causal_lm
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.onednn_decode import missing_onednn


def arithmetic_prompts(count: int, length: int) -> list[str]:
    """``a+b=`` prompts (a, b < 1000) left-padded with spaces to ``length`` characters."""
    return [f"{(i * 37) % 1000}+{(i * 91 + 5) % 1000}=".rjust(length) for i in range(count)]


def seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def vllm_row(path: Path, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, greedy: torch.Tensor,
             pad_token_id: int, repeats: int) -> dict[str, Any]:
    """vLLM's tokens/s on the same work, its start seconds and its greedy agreement with ``greedy``."""
    from hybridflow_lab.engines.vllm_rollout import VllmRollout, VllmSettings

    start = time.perf_counter()
    engine = VllmRollout(str(path), params, None, pad_token_id,
                         VllmSettings(dtype=torch.float32, max_model_len=ids.shape[1] + params.max_new_tokens))
    init_s = time.perf_counter() - start
    engine.generate(ids, mask)  # warm-up
    median = statistics.median(seconds(lambda: engine.generate(ids, mask)) for _ in range(repeats))
    theirs = engine.generate(ids, mask, replace(params, greedy=True))["responses"]
    return {"tok_s": round(ids.shape[0] * params.max_new_tokens / median, 1),
            "greedy_match": round(float((theirs == greedy).all(-1).float().mean()), 4), "init_s": round(init_s, 1)}


def run(size: str = "small", prompts: int = 64, new_tokens: int = 64, prompt_tokens: int = 16,
        repeats: int = 3, vllm: bool = True) -> dict[str, Any]:
    tokenizer = char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = create_model_dir(f"{tmp}/model", size, "qwen2", seed=0, tokenizer=tokenizer)
        ours = load_causal_lm(path).eval()
        theirs = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                     dtype=torch.float32).eval()
        batch = tokenizer(arithmetic_prompts(prompts, prompt_tokens), return_tensors="pt")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=0)

        def ours_run(sampling: SamplingParams = params, decoding: str = "eager") -> dict[str, torch.Tensor]:
            return generate(ours, ids, mask, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id, decoding)

        def hf_run() -> None:
            with torch.inference_mode():
                theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                pad_token_id=tokenizer.pad_token_id)

        runs: dict[str, Callable[[], Any]] = {"torch": ours_run, "hf": hf_run}
        no_compiler = missing_cpp_compiler()
        no_onednn = no_compiler or missing_onednn()
        if not no_compiler:
            runs["torch_compiled"] = lambda: ours_run(decoding="compiled")
        if not no_onednn:
            runs["torch_onednn"] = lambda: ours_run(decoding="onednn")
        timed = {**runs, "linear_floor": linear_floor(ours, prompts, prompt_tokens, new_tokens)}
        for fn in timed.values():  # warm-up (and the compiled step's compilation)
            fn()
        times: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(repeats):
            for name, fn in timed.items():
                times[name].append(seconds(fn))
        medians = {name: statistics.median(t) for name, t in times.items()}
        floor_s = medians.pop("linear_floor")
        engines: dict[str, Any] = {name: {"tok_s": round(prompts * new_tokens / s, 1)} for name, s in medians.items()}
        if no_compiler:
            engines["torch_compiled"] = {"skipped": no_compiler}
        if no_onednn:
            engines["torch_onednn"] = {"skipped": no_onednn}
        threads = torch.get_num_threads()
        counts = describe(ours)
        gflop = 2 * prompts * (counts["non_embedding_parameters"] * (prompt_tokens + new_tokens)
                               + counts["head_parameters"] * new_tokens) / 1e9
        bound_s = gflop / matmul_gflops()
        if not vllm:
            engines["vllm"] = {"skipped": "left out (--quick: vLLM's start alone takes longer than the rest)"}
        elif importlib.util.find_spec("vllm") is None:
            engines["vllm"] = {"skipped": "vllm is not installed here; `make lab` installs its CPU build into .venv"}
        else:
            greedy = ours_run(replace(params, greedy=True))["responses"]
            engines["vllm"] = vllm_row(path, ids, mask, params, greedy, tokenizer.pad_token_id, repeats)
    built_in = {name: s for name, s in medians.items() if name != "hf"}
    return {
        "bench": "rollout", "model": size, "parameters": counts["parameters"], "prompts": prompts,
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "threads": threads, "engines": engines,
        **{f"hf_over_{name}_seconds": round(medians["hf"] / s, 3) for name, s in built_in.items()},
        "gflop": round(gflop, 2), "matmul_bound_s": round(bound_s, 3),
        **{f"{name}_over_bound": round(s / bound_s, 2) for name, s in built_in.items()},
        "linear_floor_s": round(floor_s, 4),
        **{f"{name}_over_linear_floor": round(s / floor_s, 2) for name, s in medians.items()},
    }


def linear_floor(model: DecoderLM, prompts: int, prompt_tokens: int, new_tokens: int) -> Callable[[], None]:
    """The generation's linear layers alone, back to back at its shapes: the prefill's over every prompt position
    (the head at the last one only), then one row per prompt for each later token."""
    backbone = [module for module in model.model.modules() if isinstance(module, nn.Linear)]
    prefill = linear_pass(backbone, prompts * prompt_tokens)
    head = linear_pass([model.lm_head], prompts)
    step = linear_pass([*backbone, model.lm_head], prompts)

    def generation() -> None:
        prefill()
        head()
        for _ in range(new_tokens - 1):
            step()

    return generation
