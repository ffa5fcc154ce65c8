"""``hybridflow-lab bench sync``: the actor's weight sync into vLLM after each update (needs vLLM: ``make lab``).

An actor on 2 Ray ranks trains with DeepSpeed ZeRO-2 or ZeRO-3 and generates with vLLM (one replica
per rank). Each round updates the actor and generates, which syncs the new weights into vLLM and
verifies them: per sync, the seconds (streaming the gather into vLLM's in-place reload; slowest
rank, median over rounds), the fingerprint check's seconds, the bytes copied into the engine and the
bytes a rank received from the others. Parameter bytes per rank at the transition's peak, against
the paper's DeepSpeed-Chat column of Table 2 (peak M, redundant M/d): the trainer's own weights
(M under ZeRO-2, M/d under ZeRO-3), vLLM's copy (M), and under ZeRO-3 the largest module gathered
at once (the stream never holds a second full copy).
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
from typing import Any

import torch

from hybridflow_lab.config import (
    AlgorithmConfig,
    BatchConfig,
    EngineConfig,
    LabConfig,
    OptimConfig,
    RoleConfig,
    RolloutConfig,
)
from hybridflow_lab.controller import ResourcePool, Role, WorkerGroup, init_cluster
from hybridflow_lab.models import char_tokenizer, create_model_dir
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks.prompts import encode_prompts
from hybridflow_lab.workers import ActorWorker

SETTINGS = (("standard", 2), ("standard", 3), ("small", 2), ("small", 3))
RANKS = 2


def actor_config(model_dir: str, zero_stage: int) -> LabConfig:
    role = RoleConfig(model_path=model_dir, ranks=RANKS, engine=EngineConfig(backend="deepspeed",
                                                                             zero_stage=zero_stage),
                      optim=OptimConfig(lr=1e-4))
    return LabConfig(backend="ray", actor=role, algorithm=AlgorithmConfig(),
                     rollout=RolloutConfig(engine="vllm", max_prompt_tokens=8, max_new_tokens=8),
                     batch=BatchConfig(rollout_batch_prompts=4, samples_per_prompt=2, update_minibatch_sequences=8,
                                       micro_batch_sequences_per_rank=4))


def sync_spans(actor: WorkerGroup, rounds: int) -> list[list[dict[str, Any]]]:
    """``rounds`` update + generate rounds; each round's ``weight_sync`` span attributes, per rank."""
    prompts = encode_prompts(char_tokenizer(), ["1+2=", "30+4=", "5+60=", "7+8="], 8)
    per_round = []
    for _ in range(rounds):
        rollout = actor.generate_sequences(prompts)
        advantages = torch.linspace(-1.0, 1.0, len(rollout))[:, None] * rollout["response_mask"]
        actor.update_actor(rollout.union(DataBatch({"advantages": advantages})))
        seen = len(actor.telemetry.spans(group=actor.name))
        actor.generate_sequences(prompts)  # syncs the updated weights
        spans = [s for s in actor.telemetry.spans(group=actor.name)[seen:] if s.name == "weight_sync"]
        per_round.append([{**s.attrs, "seconds": s.duration, "bytes_moved": s.bytes_moved} for s in spans])
    return per_round


def row(size: str, zero_stage: int, per_round: list[list[dict[str, Any]]]) -> dict[str, Any]:
    first = per_round[0][0]
    engine_bytes = first["copied_bytes"]
    trainer_bytes = engine_bytes // RANKS if zero_stage == 3 else engine_bytes
    transient = first["largest_tensor_bytes"] if zero_stage == 3 else 0
    return {
        "model": size, "zero_stage": zero_stage, "ranks": RANKS, "tensors": first["tensors"],
        "seconds": round(statistics.median(max(s["seconds"] for s in spans) for spans in per_round), 4),
        "check_seconds": round(statistics.median(max(s["check_seconds"] for s in spans) for spans in per_round), 4),
        "copied_bytes_per_rank": engine_bytes, "received_bytes_per_rank": first["bytes_moved"],
        "peak_param_bytes_per_rank": trainer_bytes + engine_bytes + transient,
        "ds_chat_peak_param_bytes": engine_bytes + engine_bytes // RANKS,  # Table 2: M gathered + M/d redundant
        "largest_gathered_bytes": transient,
    }


def run(rounds: int = 3, settings: tuple[tuple[str, int], ...] = SETTINGS) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("hybridflow-lab bench sync needs vLLM: `make lab` installs its CPU build into .venv")
    init_cluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, zero_stage in settings:
            model_dir = str(create_model_dir(f"{tmp}/{size}", size, "qwen2", seed=0))
            config = actor_config(model_dir, zero_stage)
            actor = WorkerGroup(Role(ActorWorker, config), ResourcePool(RANKS), meshes=ActorWorker.meshes(config),
                                name=f"sync-bench-{size}-zero{zero_stage}")
            try:
                rows.append(row(size, zero_stage, sync_spans(actor, rounds)))
            finally:
                actor.shutdown()
    return {"bench": "sync", "engine": "vllm", "device": "cuda" if torch.cuda.is_available() else "cpu",
            "dtype": "float32", "rounds": rounds, "results": rows}
