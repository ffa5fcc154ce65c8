"""The actor role: trains the policy, generates with it and keeps the frozen reference, in one process per rank.

This is the paper's colocated actor: one set of weights per rank, switched between the training
layout and the generation layout by the hybrid engine (``hybridflow_lab.hybrid.engine``).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from hybridflow_lab.algorithms.kl import kl_estimate
from hybridflow_lab.algorithms.losses import aggregate, loss_units, ppo_policy_loss
from hybridflow_lab.algorithms.registry import POLICY_LOSS_KEYWORDS, PolicyLoss, get_policy_loss
from hybridflow_lab.algorithms.rollout_correction import is_level, rollout_correction
from hybridflow_lab.config import LabConfig
from hybridflow_lab.config.sequence_length import longest_sequence
from hybridflow_lab.controller import Dispatch, register
from hybridflow_lab.controller.mesh import Mesh
from hybridflow_lab.dataflows import RunNeeds
from hybridflow_lab.engines import SamplingParams, TrainingState
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.engines.frozen import build_frozen_model
from hybridflow_lab.engines.pipeline_engine import StagedModel, StagePlace
from hybridflow_lab.engines.torch_engine import TorchEngine
from hybridflow_lab.engines.torch_rollout import TorchRollout
from hybridflow_lab.engines.train_base import StepMetrics, TrainEngine
from hybridflow_lab.hybrid.engine import HybridEngine, actor_layout, actor_meshes
from hybridflow_lab.hybrid.reshard import process_groups
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.causal_lm import checkpoint_weights
from hybridflow_lab.models.decoder import compile_layers, shard_model
from hybridflow_lab.models.lora import adapters_disabled, merged_weights
from hybridflow_lab.models.routing import RouteLog, routing_mismatch, scored_routes
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.seeds import derive_seed
from hybridflow_lab.workers.batching import mean_over_steps, micro_batches, minibatches, optimizer_steps
from hybridflow_lab.workers.generation import responses_batch
from hybridflow_lab.workers.trained_role import TrainedRole

if TYPE_CHECKING:
    from hybridflow_lab.engines.vllm_rollout import VllmRollout, VllmSettings

ROW = "replay_row"  # each row's index, carried through a probe's shuffled micro-batches


def sampling_params(config: LabConfig, **overrides: object) -> SamplingParams:
    rollout = config.rollout
    values = {"max_new_tokens": rollout.max_new_tokens, "temperature": rollout.temperature, "top_p": rollout.top_p,
              "top_k": rollout.top_k, "n": config.batch.samples_per_prompt, "ignore_eos": rollout.ignore_eos,
              "forced_lengths": rollout.forced_lengths}
    return SamplingParams(**{**values, **overrides})


def vllm_settings(config: LabConfig, replica: int, sleeps: bool = True) -> VllmSettings:
    """The vLLM engine for this actor: the training dtype unless ``rollout.dtype`` names one, a context of
    the longest sequence (the prompt and response budgets, or a multi-turn trajectory's), a seed per generation
    replica (the ranks of one vLLM TP group sample the same tokens, replicas different ones); ``sleeps`` between
    generations where it shares the trainer's GPU."""
    from hybridflow_lab.engines.vllm_rollout import VllmSettings

    rollout = config.rollout
    dtype = rollout.dtype or ("bfloat16" if config.actor.engine.bf16 else "float32")
    return VllmSettings(dtype=getattr(torch, dtype), max_model_len=longest_sequence(config)[0],
                        tensor_parallel=rollout.tensor_parallel, gpu_memory_utilization=rollout.gpu_memory_utilization,
                        kv_cache_gib=rollout.kv_cache_gib, seed=config.seed + replica,
                        verify_sync=rollout.verify_weight_sync, enforce_eager=rollout.enforce_eager, sleeps=sleeps)


class ActorWorker(TrainedRole):
    """Policy training, generation and the reference policy on one rank.

    Training runs on this rank's TP shard (``actor.engine.tensor_parallel``) with data parallel
    over the rest; generation on the generation layout the hybrid engine switches to.
    """

    @staticmethod
    def meshes(config: LabConfig) -> dict[str, Mesh]:
        """The named meshes the actor's worker group needs (``train``, ``generate``, ``regroup``)."""
        return actor_meshes(config)

    def __init__(self, config: LabConfig, reference_model: bool | None = None,
                 state: TrainingState | None = None) -> None:
        """``reference_model``: build the frozen reference policy (default: when the run needs it, ``RunNeeds``;
        the Lab passes it, as a notebook's own algorithm is not known to the worker processes). ``state``: the
        policy's training state to continue from (another layout's, ``Lab.reconfigure``)."""
        torch.manual_seed(config.seed)
        self.config = config
        path = config.actor.model_path
        self.tokenizer = load_tokenizer(path)
        self.layout = actor_layout(config)
        tp, dp_group, stage = self._training_parallelism()
        policy = functools.partial(load_causal_lm, path, impl=config.actor.model_impl)
        self.engine = self.build_engine(config.actor, shard_model(policy(), tp), dp_group, tp, state, stage)
        if reference_model is None:
            reference_model = RunNeeds.of(config).reference_model
        # only when a stage reads it; under LoRA the reference is the base, the adapters switched off
        self.reference = self._reference(shard_model(policy(), tp), stage) if reference_model else None
        self.rollout: TorchRollout | VllmRollout
        params, eos, pad = sampling_params(config), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if config.rollout.engine == "vllm":
            from hybridflow_lab.engines.vllm_rollout import VllmRollout

            replica = self.mesh_coords("generate")["dp"]
            vllm = self.rollout = VllmRollout(path, params, eos, pad, vllm_settings(config, replica))
            self.hybrid = self._hybrid_engine(lambda weights: vllm.update_weights(
                checkpoint_weights(self.engine.model, weights)), vllm.discards_weights)
        else:
            self.hybrid = self._hybrid_engine(None)
            assert self.hybrid.model is not None
            self.rollout = TorchRollout(self.hybrid.model, params, eos, pad, self.engine.precision,
                                        config.rollout.decoding, self.tokenizer)
        if state is not None:
            self.weights_loaded()  # the rollout engine loaded the model path's weights

    @property
    def data_parallel_size(self) -> int:
        return self.layout.d

    def _reference(self, model: torch.nn.Module, stage: StagePlace | None) -> torch.nn.Module | StagedModel:
        """The frozen reference policy on this rank's device, sharded like the actor (ZeRO-3, FSDP, its pipeline
        stage)."""
        engine = self.config.actor.engine
        if stage is not None:
            staged = StagedModel(model.eval().requires_grad_(False), stage, self.device)
            staged.stage.to(self.device)
            return staged
        if engine.torch_compile:
            compile_layers(model)
        return build_frozen_model(engine.backend, model, zero_stage=engine.zero_stage, bf16=engine.bf16,
                                  device=self.device)

    def _training_parallelism(self) -> tuple[TensorParallel, Any, StagePlace | None]:
        """This rank's training TP place, its data-parallel group (None: all ranks) and its pipeline stage."""
        layout = self.layout
        if layout.t == 1 and layout.p == 1:
            return SINGLE, None, None
        mesh, coords = self.device_mesh("train"), self.mesh_coords("train")
        tp = TensorParallel(layout.t, coords["tp"], mesh.get_group("tp")) if layout.t > 1 else SINGLE
        stage = StagePlace(coords["pp"], layout.p, mesh.get_group("pp"), self.config.actor.engine.pipeline_schedule) \
            if layout.p > 1 else None
        return tp, mesh.get_group("dp"), stage

    def _hybrid_engine(self, load_copy: Any, copy_discarded: bool = False) -> HybridEngine:
        return HybridEngine(self.config, self.engine, self.rank, lambda: process_groups(self.device_mesh), self.span,
                            load_copy, copy_discarded)

    @register(Dispatch.MESH("generate"))
    def generate_sequences(self, prompts: DataBatch, greedy: bool = False, n: int | None = None,
                           seed: int | None = None, stop: frozenset[str] = frozenset(),
                           max_new_tokens: int | None = None) -> DataBatch:
        """``samples_per_prompt`` responses per left-padded prompt (``input_ids``, ``attention_mask``), each ending
        at EOS, at one of the ``stop`` strings (kept) or after ``max_new_tokens`` (``rollout.max_new_tokens``).

        Runs on the generation layout: prompts are split over the generation replicas, the ranks
        of one generation TP group sample the same tokens. Returns the sequence layout for
        training, ``rollout_log_probs``, the decoded ``response_text``, and every non-tensor
        column of the prompts repeated per sample.
        """
        replica = self.mesh_coords("generate")["dp"]
        params = sampling_params(self.config, greedy=greedy, n=n or self.config.batch.samples_per_prompt,
                                 seed=None if seed is None else derive_seed(seed, "replica", replica),
                                 stop=tuple(sorted(stop)),
                                 max_new_tokens=max_new_tokens or self.config.rollout.max_new_tokens)
        with self.hybrid.generating(), self.span("generate", prompts=len(prompts)) as attrs:
            return responses_batch(self.rollout, self.tokenizer, prompts, params, attrs)

    def _log_probs(self, model: torch.nn.Module | StagedModel, batch: DataBatch, with_entropy: bool) -> DataBatch:
        temperature, remove_padding = self.config.rollout.temperature, self.config.actor.engine.remove_padding

        def forward(module: torch.nn.Module, micro: DataBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            return response_log_probs(module, micro, temperature, with_entropy, remove_padding)

        micros = micro_batches(batch, self.config.batch)
        if model is self.engine.module:
            parts = self.engine.infer(micros.parts, forward)
        elif isinstance(model, StagedModel):
            parts = model.infer(micros.parts, forward, precision=self.engine.precision())
        else:
            with torch.no_grad(), self.engine.precision():
                parts = [forward(model, micro) for micro in micros.parts]
        columns = {"log_probs": micros.in_row_order([p[0] for p in parts])}
        if with_entropy:
            columns["entropy"] = micros.in_row_order([p[1] for p in parts])
        return DataBatch(columns)

    @register(Dispatch.MESH("train"))
    def compute_log_prob(self, batch: DataBatch) -> DataBatch:
        """Log-probs (``old_log_probs``) and entropies of the responses under the current policy."""
        out = self._log_probs(self.engine.module, batch, with_entropy=True)
        return DataBatch({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.MESH("train"))
    def compute_ref_log_prob(self, batch: DataBatch) -> DataBatch:
        """Log-probs of the responses under the frozen reference policy (``ref_log_probs``): a model of its own, or
        under LoRA the actor's base weights with the adapters switched off (no second copy in memory)."""
        if self.config.actor.lora.enabled:
            with adapters_disabled(self.engine.model):
                return DataBatch({"ref_log_probs": self._log_probs(self.engine.module, batch, False)["log_probs"]})
        if self.reference is None:
            raise RuntimeError("this actor holds no reference policy: it is built only when the run needs one (a KL "
                               "term); set algorithm.kl_loss_coef or algorithm.kl_reward_coef > 0")
        return DataBatch({"ref_log_probs": self._log_probs(self.reference, batch, with_entropy=False)["log_probs"]})

    @register(Dispatch.MESH("train"))
    def update_actor(self, batch: DataBatch, policy_loss: PolicyLoss = ppo_policy_loss, kl_coef: float = 0.0,
                     seed: int = 0) -> DataBatch:
        """Policy updates over this rank's share; needs ``advantages``.

        Without ``old_log_probs`` the update's own forward pass stands in for them (the PPO ratio
        is 1), which is exact when the batch gets one optimizer step: the weights that generated
        the batch are the ones being updated. ``policy_loss`` is any registered loss (a function,
        so one defined in a notebook works in the workers); ``kl_coef`` > 0 adds the KL to the
        reference as a loss term (``algorithm.kl_loss_kind``; needs ``ref_log_probs``). With
        ``rollout_log_probs`` the gap between them and the trainer's log-probs is reported every step
        (``rollout_mismatch``) and, if configured, corrected (``algorithm.rollout_is`` / ``rollout_mask``; TIS by
        default when the batch comes from an older policy version, ``rollout.max_staleness`` > 0).
        One optimizer step per ``update_minibatch_sequences`` (over all ranks), ``update_epochs``
        passes, rows shuffled with ``seed``. Returns no rows and the metrics in ``meta["metrics"]``.
        """
        needed = ["responses", "response_mask", "advantages", *(["ref_log_probs"] if kl_coef else [])]
        missing = [k for k in needed if k not in batch]
        if missing:
            raise KeyError(f"update_actor needs columns {missing}; compute them first (compute_log_prob, "
                           "compute_ref_log_prob, advantages)")
        steps, maxima = [], set()
        for micros in optimizer_steps(batch, self.config.batch, self.data_parallel_size, seed, self.engine):
            metrics, _ = policy_gradients(self.engine, micros, self.config, policy_loss, kl_coef)
            maxima.update(metrics.maxima)
            steps.append(self.engine.step(metrics, self.config.trainer.on_nonfinite == "skip"))
        self.hybrid.weights_changed()
        return DataBatch(meta={"metrics": {f"actor/{k}": v for k, v in mean_over_steps(steps, maxima).items()
                                           if k != "loss"}})

    @register(Dispatch.ONE_TO_ALL)
    def policy_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's full weights (HF names, on the CPU; LoRA adapters merged; in the checkpoint's layout for
        vLLM) from rank 0, for a rollout group of its own; ``None`` from the other ranks. Collective: sharded engines
        gather them a module at a time."""
        weights = self.engine.full_weights()
        if self.hybrid.adapted:
            weights = merged_weights(weights, self.engine.model)
        if self.config.rollout.engine == "vllm":
            weights = checkpoint_weights(self.engine.model, weights)
        gathered = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights if self.rank == 0}
        return gathered if self.rank == 0 else None

    def weights_loaded(self) -> None:
        self.hybrid.weights_changed()


def policy_gradients(engine: TrainEngine, micros: list[DataBatch], config: LabConfig, policy_loss: PolicyLoss,
                     kl_coef: float) -> tuple[StepMetrics, list[torch.Tensor]]:
    """One optimizer step's forward and backward passes over ``micros`` (see ``ActorWorker.update_actor``), its
    metrics left for ``engine.step``; and each micro-batch's policy loss per token (``pg_loss``)."""
    algorithm, temperature, remove_padding = config.algorithm, config.rollout.temperature, \
        config.actor.engine.remove_padding
    mode, norm = algorithm.aggregation, config.rollout.max_new_tokens
    tis = is_level(algorithm.rollout_is, config.rollout.max_staleness > 0, algorithm.rollout_mask)
    options = {key: getattr(algorithm, key) for key in POLICY_LOSS_KEYWORDS}
    options["dual_clip"] = options["dual_clip"] or None
    metrics = engine.start_step(sum(loss_units(micro["response_mask"], mode, norm) for micro in micros))
    pg_losses = []

    def micro_loss(module: torch.nn.Module, micro: DataBatch) -> torch.Tensor:
        mask = micro["response_mask"]
        routed = "routed_experts" in micro  # a mixture generated by the built-in engine
        with RouteLog(module) if routed else nullcontext() as routes:
            log_probs, entropy = response_log_probs(module, micro, temperature, True, remove_padding,
                                                     entropy_grad=bool(algorithm.entropy_coef))
        old_log_probs = micro["old_log_probs"] if "old_log_probs" in micro else log_probs.detach()
        pg_loss, diagnostics = policy_loss(log_probs, old_log_probs, micro["advantages"], mask, **options)
        means = {"entropy": entropy.detach(), **diagnostics}
        if routed:
            trained = scored_routes(routes.passes()[0], len(micro), mask.shape[1])
            means["routing_mismatch"] = routing_mismatch(trained, micro["routed_experts"])
        if "rollout_log_probs" in micro:
            weights, correction = rollout_correction(
                old_log_probs, micro["rollout_log_probs"], mask, tis, algorithm.rollout_is_cap,
                algorithm.rollout_mask, algorithm.rollout_mask_low, algorithm.rollout_mask_high)
            pg_loss = pg_loss * weights
            means.update({f"rollout_{k}": v for k, v in correction.items()})
            metrics.add_max("rollout_mismatch_max", correction["mismatch"], mask)
        loss = pg_loss - algorithm.entropy_coef * entropy if algorithm.entropy_coef else pg_loss
        if "ref_log_probs" in micro:
            means["kl"] = old_log_probs - micro["ref_log_probs"]
        if kl_coef:
            kl = kl_estimate(log_probs, micro["ref_log_probs"], algorithm.kl_loss_kind)
            loss = loss + kl_coef * kl
            metrics.add("kl_loss", aggregate(kl, mask, mode, norm)[0])
        loss_sum = aggregate(loss, mask, mode, norm)[0]
        metrics.add("loss", loss_sum)
        metrics.add("pg_loss", aggregate(pg_loss, mask, mode, norm)[0])
        metrics.add_token_means(means, mask)
        pg_losses.append(pg_loss.detach())
        return loss_sum

    engine.backward_passes(micros, micro_loss, metrics)
    return metrics, pg_losses


def probe_update(model: torch.nn.Module, batch: DataBatch, config: LabConfig
                 ) -> tuple[dict[str, float], dict[int, torch.Tensor]]:
    """The actor update's metrics on ``batch`` taken as one optimizer step (one epoch, one mini-batch) by ``model``,
    without applying it; and each row's policy loss per token (a replay's probe, ``trainer.replay``)."""
    algorithm = config.algorithm
    engine = TorchEngine(model, config.actor.optim)
    rows = batch.union(DataBatch({ROW: torch.arange(len(batch), device=batch["response_mask"].device)}))
    micros = micro_batches(next(minibatches(rows, len(rows), 1, config.seed)), config.batch, engine).parts
    metrics, pg_losses = policy_gradients(engine, micros, config, get_policy_loss(algorithm.policy_loss),
                                          algorithm.kl_loss_coef)
    step = engine.step(metrics, apply=False)
    per_row = {row: values for micro, losses in zip(micros, pg_losses, strict=True)
               for row, values in zip(micro[ROW].tolist(), losses, strict=True)}
    return {f"actor/{k}": v for k, v in step.items() if k not in ("loss", "lr", "nonfinite_skipped")}, per_row
