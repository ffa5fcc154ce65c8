"""A rollout group of its own: generation-only ranks holding a copy of the policy (``rollout.pool``).

The actor's ranks generate with the hybrid engine unless the rollout gets a pool of its own; then these ranks
do, each with the whole policy (data parallel), and the Lab loads the actor's weights into them after each
update: a timed transfer, fingerprinted on arrival like the vLLM sync. Every response batch carries the
``policy_version`` that generated it, so that a run whose generation runs ahead of training
(``rollout.max_staleness``) knows how stale each batch is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow_lab.config import LabConfig
from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.engines.torch_rollout import TorchRollout
from hybridflow_lab.hybrid.engine import state_dict_sink
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.seeds import derive_seed
from hybridflow_lab.workers.actor import sampling_params, vllm_settings
from hybridflow_lab.workers.generation import responses_batch

if TYPE_CHECKING:
    from hybridflow_lab.engines.vllm_rollout import VllmRollout


class RolloutWorker(Worker):
    """Generation with a copy of the policy, refreshed by ``load_policy``; ``version`` is the number of actor
    updates its weights include."""

    def __init__(self, config: LabConfig) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        path = config.actor.model_path
        self.tokenizer = load_tokenizer(path)
        params, eos, pad = sampling_params(config), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.engine: TorchRollout | VllmRollout
        if config.rollout.engine == "vllm":
            from hybridflow_lab.engines.vllm_rollout import VllmRollout

            self.engine = VllmRollout(path, params, eos, pad, vllm_settings(config, self.rank, sleeps=False))
        else:
            self.model = load_causal_lm(path, impl=config.actor.model_impl).to(self.device)
            self.engine = TorchRollout(self.model, params, eos, pad, decoding=config.rollout.decoding,
                                       tokenizer=self.tokenizer)
        self.version = 0

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: DataBatch, greedy: bool = False, n: int | None = None,
                           seed: int | None = None, stop: frozenset[str] = frozenset(),
                           max_new_tokens: int | None = None) -> DataBatch:
        """``samples_per_prompt`` responses per prompt (this rank's share), like the actor's, plus the
        ``policy_version`` of the weights that generated them."""
        params = sampling_params(self.config, greedy=greedy, n=n or self.config.batch.samples_per_prompt,
                                 seed=None if seed is None else derive_seed(seed, "replica", self.rank),
                                 stop=tuple(sorted(stop)),
                                 max_new_tokens=max_new_tokens or self.config.rollout.max_new_tokens)
        with self.span("generate", prompts=len(prompts), policy_version=self.version) as attrs:
            batch = responses_batch(self.engine, self.tokenizer, prompts, params, attrs)
        batch["policy_version"] = np.full(len(batch), self.version, dtype=np.int64)
        return batch

    @register(Dispatch.ONE_TO_ALL)
    def load_policy(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Load the actor's full weights as policy ``version`` and check every tensor arrived (fingerprints of what
        was sent against the engine's own, unless ``rollout.verify_weight_sync`` is off); returns the transfer's
        ``tensors``, ``copied_bytes`` and ``seconds``."""
        start = time.perf_counter()
        with self.span("load_policy", version=version) as attrs:
            if isinstance(self.engine, TorchRollout):
                stats = state_dict_sink(self.model, self.config.rollout.verify_weight_sync)(weights.items())
            else:
                stats = self.engine.update_weights(weights.items())  # it checks the fingerprints itself
            stats = {**stats, "seconds": round(time.perf_counter() - start, 6)}
            attrs.update(stats, bytes_moved=stats["copied_bytes"])
        self.version = version
        return stats
