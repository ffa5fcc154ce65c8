"""``hybridflow-lab bench train``: training throughput of each engine and ZeRO stage on 2 ranks.

Supervised steps (response NLL) on the ``standard`` model with fixed random sequences; tokens/s
counts every position of every sequence, median step time after one warm-up step.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from hybridflow_lab.config import OptimConfig
from hybridflow_lab.controller import Dispatch, ResourcePool, Role, Worker, WorkerGroup, init_cluster, register
from hybridflow_lab.engines import build_train_engine
from hybridflow_lab.engines.forward import count_response_tokens, response_nll
from hybridflow_lab.models import create_model_dir, load_causal_lm
from hybridflow_lab.protocol import DataBatch

ENGINES = (("torch", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3), ("fsdp", 0))


class TrainBenchWorker(Worker):
    def __init__(self, model_dir: str, backend: str, zero_stage: int, micro_batches: int) -> None:
        self.engine = build_train_engine(backend, load_causal_lm(model_dir), OptimConfig(lr=1e-4),
                                         zero_stage=zero_stage, micro_batches_per_step=micro_batches)
        self.micro_batches = micro_batches

    @register(Dispatch.DP_COMPUTE)
    def steps(self, batch: DataBatch, count: int) -> DataBatch:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.engine.train_step(batch.chunk(self.micro_batches), response_nll, count_response_tokens)
            times.append(time.perf_counter() - start)
        return DataBatch(meta={"step_s": times})


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int) -> DataBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    return DataBatch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1),
                      "responses": ids[:, prompt:], "response_mask": mask[:, prompt:]})


def run(size: str = "standard", ranks: int = 2, rows: int = 16, prompt: int = 16, response: int = 64,
        micro_batches: int = 2, steps: int = 4, engines: tuple[tuple[str, int], ...] = ENGINES) -> dict[str, Any]:
    init_cluster()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(create_model_dir(f"{tmp}/model", size, "qwen2", seed=0))
        batch = synthetic_batch(rows, prompt, response, 90)
        for backend, stage in engines:
            group = WorkerGroup(Role(TrainBenchWorker, path, backend, stage, micro_batches), ResourcePool(ranks),
                                name=f"bench-train-{backend}{stage}")
            try:
                times = group.steps(batch, steps + 1).meta["step_s"]
            finally:
                group.shutdown()
            per_rank = times if isinstance(times[0], list) else [times]  # equal lists merge into one
            step_s = statistics.median([max(values) for values in zip(*per_rank, strict=True)][1:])  # slowest rank
            results.append({"engine": backend, "zero_stage": stage or None, "ranks": ranks,
                            "step_s": round(step_s, 4), "tokens_per_s": round(rows * (prompt + response) / step_s, 1)})
    return {"bench": "train", "model": size, "sequences_per_step": rows, "tokens_per_sequence": prompt + response,
            "results": results}
