"""Worker classes for the tensor-parallel and hybrid-engine tests."""

from __future__ import annotations

import copy

import torch

from hybridflow_lab import DataBatch
from hybridflow_lab.controller import Dispatch, Worker, register
from hybridflow_lab.engines.training_state import TrainingState
from hybridflow_lab.models import load_causal_lm
from hybridflow_lab.models.decoder import shard_model
from hybridflow_lab.models.tensor_parallel import TensorParallel
from hybridflow_lab.workers.trained_role import TrainedRole


class TensorParallelProbe(Worker):
    """Builds the model sharded along a mesh's ``tp`` axis from a full checkpoint; runs forward and backward."""

    def __init__(self, model_dir: str) -> None:
        self.full = load_causal_lm(model_dir)

    def tensor_parallel(self, mesh: str) -> TensorParallel:
        device_mesh = self.device_mesh(mesh)
        return TensorParallel(device_mesh.size(device_mesh.mesh_dim_names.index("tp")),
                              device_mesh.get_local_rank("tp"), device_mesh.get_group("tp"))

    @register(Dispatch.ONE_TO_ALL)
    def forward_backward(self, mesh: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """Logits of the sharded model and the gradients of its shards for a fixed scalar loss."""
        tp = self.tensor_parallel(mesh)
        model = shard_model(self.full, tp)
        logits = model(input_ids, attention_mask)
        (logits.log_softmax(-1)[..., 3] * attention_mask).sum().backward()
        return {"tp_rank": tp.rank, "logits": logits.detach(),
                "grads": {name: p.grad for name, p in model.named_parameters()}}


class HybridEngineProbe(Worker):
    """A training model of TP ``t`` (a stage of ``p`` where ``p > 1``) that reshards to TP ``tg`` (with any
    strategy) for greedy generation and log-probs; its weights change by ``scale``."""

    def __init__(self, model_dir: str, t: int, tg: int, torch_2_11: bool = False, p: int = 1) -> None:
        from hybridflow_lab.hybrid import STRATEGIES, ParallelLayout
        from hybridflow_lab.hybrid.reshard import Resharder, process_groups, training_shard

        if torch_2_11:  # the collective's name the lent GPU machines' torch lacks (this rank's process only)
            del torch.distributed.all_gather_single

        layout = ParallelLayout(t=t, p=p, tg=tg, d=self.world_size // (t * p))
        groups = process_groups(self.device_mesh)
        self.model = training_shard(load_causal_lm(model_dir), layout, self.rank, groups)
        self.resharders = {s: Resharder(self.model, layout, self.rank, groups, s) for s in STRATEGIES}

    @register(Dispatch.ONE_TO_ALL)
    def generate_and_score(self, strategy: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                           new_tokens: int) -> dict:
        from hybridflow_lab.engines.forward import response_log_probs
        from hybridflow_lab.engines.sampling import SamplingParams
        from hybridflow_lab.engines.torch_rollout import generate, sequences_batch
        from hybridflow_lab.protocol import DataBatch

        resharder = self.resharders[strategy]
        training = {name: param.detach().clone() for name, param in self.model.named_parameters()}
        model, to_generation = resharder.to_generation()
        out = generate(model, prompt_ids, prompt_mask, SamplingParams(new_tokens, greedy=True, ignore_eos=True),
                       None, 0)
        batch = DataBatch(sequences_batch(out, 0))
        with torch.no_grad():
            log_probs, _ = response_log_probs(model, batch)
        to_training = resharder.to_training()
        kept = all(torch.equal(training[name], param) for name, param in self.model.named_parameters())
        return {"responses": batch["responses"], "log_probs": log_probs, "to_generation": to_generation,
                "to_training": to_training, "training_shard_kept": kept}

    @register(Dispatch.ONE_TO_ALL)
    def scale(self, factor: float) -> None:
        """Multiply every training weight by ``factor`` (a weight change a pipeline stage makes without running the
        pipeline; elementwise, so the shards stay the full model's scaled shards to the bit)."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.mul_(factor)


def mesh_axis(worker: Worker, mesh: str, name: str) -> tuple[int, int, object]:
    """``worker``'s (size, coordinate, group) along axis ``name`` of ``mesh`` ((1, 0, None) if it has none)."""
    device_mesh = worker.device_mesh(mesh)
    if name not in device_mesh.mesh_dim_names:
        return 1, 0, None
    return (device_mesh.size(device_mesh.mesh_dim_names.index(name)), device_mesh.get_local_rank(name),
            device_mesh.get_group(name))


class PipelineProbe(Worker):
    """Builds one pipeline stage (of a mesh's ``pp`` axis, TP-sharded along its ``tp`` axis) from a full checkpoint;
    runs a schedule over this data-parallel replica's rows of a batch and sums the gradients over replicas."""

    def __init__(self, model_dir: str) -> None:
        self.full = load_causal_lm(model_dir)

    @register(Dispatch.ONE_TO_ALL)
    def loss_and_grads(self, mesh: str, input_ids: torch.Tensor, attention_mask: torch.Tensor, schedule: str,
                       micro_batches: int) -> dict:
        """Each micro-batch's loss (the last stage's; a fixed sum over tokens) and this stage's gradients."""
        from hybridflow_lab.models.pipeline import DecoderStage, Pipeline

        stages, stage_index, pp_group = mesh_axis(self, mesh, "pp")
        replicas, replica, dp_group = mesh_axis(self, mesh, "dp")
        tp_size, tp_rank, tp_group = mesh_axis(self, mesh, "tp")
        tp = TensorParallel(tp_size, tp_rank, tp_group)
        stage = DecoderStage(shard_model(copy.deepcopy(self.full), tp), stage_index, stages)  # fresh gradients
        rows = slice(replica * len(input_ids) // replicas, (replica + 1) * len(input_ids) // replicas)
        ids, mask = input_ids[rows], attention_mask[rows]

        def loss(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            return (logits.log_softmax(-1)[..., 3] * mask[indices]).sum()

        losses = Pipeline(stage, pp_group, schedule).run(ids, mask, micro_batches, loss, train=True)
        grads = {name: p.grad for name, p in stage.named_parameters()}
        if replicas > 1:
            for grad in grads.values():
                torch.distributed.all_reduce(grad, group=dp_group)
        return {"stage": stage_index, "tp": (tp_size, tp_rank), "losses": [float(value.detach()) for value in losses],
                "grads": grads}


class PipelineEngineProbe(TrainedRole):
    """The engine tests' training steps with the pipeline engine, on a mesh of ``pp``, ``dp`` and ``tp`` axes: every
    stage of a data-parallel replica takes the replica's rows; AdamW with EngineProbe's settings."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    @register(Dispatch.ONE_TO_ALL)
    def start(self, mesh: str, schedule: str, micro_batches: int, state: TrainingState | None = None) -> None:
        """A new engine for the layout ``mesh`` (collective), continuing from ``state`` (any engine's and layout's)
        if given."""
        from hybridflow_lab.config import OptimConfig
        from hybridflow_lab.engines.pipeline_engine import PipelineEngine, StagePlace

        stages, stage, pp_group = mesh_axis(self, mesh, "pp")
        self.replicas, self.replica, dp_group = mesh_axis(self, mesh, "dp")
        tp = TensorParallel(*mesh_axis(self, mesh, "tp"))
        torch.manual_seed(0)
        model = load_causal_lm(self.model_dir)
        if state is not None:
            state.load_weights_into(model)
        self.engine = PipelineEngine(shard_model(model, tp), OptimConfig(lr=1e-2, grad_clip=1.0),
                                     StagePlace(stage, stages, pp_group, schedule), dp_group, tp, self.device)
        if state is not None:
            self.engine.load_training_state(state)
        self.micro_batches = micro_batches

    @register(Dispatch.ONE_TO_ALL)
    def train(self, batch: DataBatch, steps: int) -> list[float]:
        """``steps`` optimizer steps on this replica's rows; the global mean losses."""
        from hybridflow_lab.engines.forward import count_response_tokens, response_nll

        rows = batch.chunk(self.replicas)[self.replica]
        return [self.engine.train_step(rows.chunk(self.micro_batches), response_nll, count_response_tokens)["loss"]
                for _ in range(steps)]

    @register(Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()

    @register(Dispatch.ONE_TO_ALL)
    def log_probs(self, batch: DataBatch, rows: int) -> torch.Tensor:
        """The response log-probs of ``batch`` (every replica the whole of it) in micro-batches of ``rows`` rows (the
        last one fewer), through the pipeline's forward-only passes."""
        from hybridflow_lab.engines.forward import response_log_probs

        parts = self.engine.infer(batch.split(rows), lambda module, micro: response_log_probs(module, micro))
        return torch.cat([log_probs for log_probs, _ in parts])
