"""``hybridflow-lab bench memory``: a rank's peak memory for full fine-tuning, LoRA and gradient checkpointing.

Each setting runs in a fresh one-rank worker process on the real model (SmolLM2-135M-Instruct imported from
its package; ``--quick``: the tiny model): the actor's training engine (torch) and, as a KL run needs it, its
reference (a second frozen model under full fine-tuning; the base with the adapters off under LoRA), then
optimizer steps on fixed random sequences and a reference forward. ``peak_rss_mib`` is the process's high-water
resident set (``VmHWM``, the OS's figure, what an out-of-memory kill is decided on).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow_lab.bench.train import synthetic_batch
from hybridflow_lab.config import LoraConfig, OptimConfig
from hybridflow_lab.controller import Dispatch, ResourcePool, Role, Worker, WorkerGroup, init_cluster, register
from hybridflow_lab.controller.memory import peak_resident_mb, resident_mb
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.forward import count_response_tokens, response_log_probs, response_nll
from hybridflow_lab.models import create_model_dir, load_causal_lm, load_config
from hybridflow_lab.models.decoder import enable_gradient_checkpointing
from hybridflow_lab.models.lora import adapters_disabled, apply_lora


@dataclass(frozen=True)
class MemorySetting:
    """One way to train the actor: LoRA rank (0: every weight) and gradient checkpointing."""

    name: str
    lora_rank: int = 0
    gradient_checkpointing: bool = False


SETTINGS = (MemorySetting("full"), MemorySetting("full+checkpointing", gradient_checkpointing=True),
            MemorySetting("lora", lora_rank=16), MemorySetting("lora+checkpointing", 16, True))


class MemoryBenchWorker(Worker):
    """The actor's model, engine and reference under one ``MemorySetting``."""

    def __init__(self, model_dir: str, setting: MemorySetting, micro_batches: int) -> None:
        torch.manual_seed(0)
        model = load_causal_lm(model_dir)
        if setting.lora_rank:
            apply_lora(model, LoraConfig(rank=setting.lora_rank, alpha=2.0 * setting.lora_rank))
        if setting.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.engine = build_train_engine("torch", model, OptimConfig(lr=1e-5), micro_batches_per_step=micro_batches)
        self.reference = None if setting.lora_rank else load_causal_lm(model_dir).eval().requires_grad_(False)
        self.micro_batches = micro_batches
        self.built_mib = resident_mb()

    @register(Dispatch.ONE_TO_ALL)
    def measure(self, batch: Any, steps: int) -> dict[str, float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.train_step(batch.chunk(self.micro_batches), response_nll, count_response_tokens)
            times.append(time.perf_counter() - start)
        with torch.no_grad():
            if self.reference is not None:
                response_log_probs(self.reference, batch, 1.0, with_entropy=False)
            else:
                with adapters_disabled(self.engine.model):
                    response_log_probs(self.engine.model, batch, 1.0, with_entropy=False)
        parameters = list(self.engine.model.parameters())
        optimizer_bytes = sum(t.numel() * t.element_size() for state in self.engine.optimizer.state.values()
                              for t in state.values() if torch.is_tensor(t))
        reference_bytes = sum(p.numel() * p.element_size() for p in self.reference.parameters()) \
            if self.reference is not None else 0
        return {"peak_rss_mib": round(peak_resident_mb(), 1), "rss_after_build_mib": round(self.built_mib, 1),
                "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
                "optimizer_state_mib": round(optimizer_bytes / 2**20, 1),
                "reference_parameter_mib": round(reference_bytes / 2**20, 1),
                "step_s": round(statistics.median(times[1:] or times), 3)}


def run(model: str = "smollm2", rows: int = 8, prompt: int = 64, response: int = 64, micro_batches: int = 2,
        steps: int = 2, settings: tuple[MemorySetting, ...] = SETTINGS) -> dict[str, Any]:
    """The JSON report: per setting, the rank's peak resident memory and what it holds."""
    init_cluster()
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_dir(model, Path(tmp))
        vocab = load_config(path).vocab_size
        batch = synthetic_batch(rows, prompt, response, vocab)
        results = []
        for setting in settings:
            group = WorkerGroup(Role(MemoryBenchWorker, path, setting, micro_batches), ResourcePool(1),
                                name=f"bench-memory-{setting.name.replace('+', '-')}")
            try:
                results.append({"setting": setting.name, **group.measure(batch, steps)[0]})
            finally:
                group.shutdown()
    full = next((r["peak_rss_mib"] for r in results if r["setting"] == "full"), None)
    for result in results:
        result["peak_vs_full"] = round(result["peak_rss_mib"] / full, 3) if full else None
    return {"bench": "memory", "model": model, "sequences_per_step": rows, "tokens_per_sequence": prompt + response,
            "micro_batches": micro_batches, "results": results}


def _model_dir(model: str, tmp: Path) -> str:
    """``smollm2`` (imported from its package), ``tiny`` (built here) or a model directory."""
    if model == "smollm2":
        from hybridflow_lab.models.gguf_import import import_gguf, packaged_model_file

        return import_gguf(packaged_model_file("smollm2"), tmp / "smollm2").path
    if model == "tiny":
        return str(create_model_dir(tmp / "tiny", "tiny", "qwen2", seed=0))
    return model
