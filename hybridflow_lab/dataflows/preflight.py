"""What a run needs from the machine and from its model files, probed once before any worker starts: GPUs, a C++
compiler, oneDNN, vLLM and free memory; each model's config.json and the actor's tokenizer. The rules between
settings are pure (``config.rules``); these read the environment and the disk, so they live above the model code.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from hybridflow_lab.config import ConfigError, LabConfig, LoraConfig
from hybridflow_lab.config.batch_sizes import divisors
from hybridflow_lab.config.sequence_length import longest_sequence, multi_turn
from hybridflow_lab.models.causal_lm import linear_layer_names
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.factory import load_config
from hybridflow_lab.models.families import model_impl, routed_experts, window_refusal
from hybridflow_lab.models.heads import has_trained_head, untrained_head_message
from hybridflow_lab.models.lora import adapter_settings
from hybridflow_lab.models.onednn_decode import missing_onednn, unmirrored_architecture
from hybridflow_lab.models.pipeline import stage_layers
from hybridflow_lab.models.tensor_parallel import check_shardable
from hybridflow_lab.models.tokenizers import load_tokenizer

KV_CACHE_SHARE = 0.5  # of the free RAM, for all of a machine's vLLM KV caches: weights and training need the rest
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def preflight(config: LabConfig, roles: tuple[str, ...]) -> None:
    """Raise ``ConfigError`` for what the machine or the model files cannot give the run (``roles``: the trained
    ones); the config's own rules are assumed to hold."""
    models = {f"{name}.model_path": config.model_source(name)[0] for name in roles}
    for key, path in models.items():
        model_config(path, key)
    _check_transformers_path(config)
    _check_lora_targets(config, roles)
    _check_device(config, (*roles, "rollout") if config.rollout.pool else roles)
    for name in roles:
        if getattr(config, name).engine.torch_compile:
            _check_cpp_compiler(config, f"{name}.engine.torch_compile", "false")
    _check_generation(config)
    _check_vocabulary(config, models)
    if config.reward_model_path and not has_trained_head(config.reward_model_path):
        raise ConfigError("reward_model_path", untrained_head_message(config.reward_model_path))


def visible_gpus(backend: str) -> int | None:
    """GPUs the run's ranks can be placed on: the joined Ray cluster's, else this machine's (None: not known
    before joining the cluster ``HYBRIDFLOW_RAY_ADDRESS`` names)."""
    import ray

    from hybridflow_lab.controller.cluster import ADDRESS_ENV

    if backend == "ray" and ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    if backend == "ray" and os.environ.get(ADDRESS_ENV):
        return None
    return torch.cuda.device_count()


def resolve_device(config: LabConfig, gpus: int | None = None) -> str:
    """``device``, with ``auto`` made ``cuda`` when there are GPUs for the ranks (``gpus``, else
    ``visible_gpus``) and ``cpu`` otherwise."""
    if config.device != "auto":
        return config.device
    return "cuda" if (gpus if gpus is not None else visible_gpus(config.backend)) else "cpu"


def _actor_impl(config: LabConfig, model: PretrainedConfig) -> str:
    """Which path runs the actor's ``model`` (``models.families.model_impl``); ``ConfigError`` when the one forced
    cannot."""
    try:
        return model_impl(model, config.actor.model_impl)
    except ValueError as exc:
        raise ConfigError("actor.model_impl", str(exc)) from None


def model_summary(config: LabConfig) -> str:
    """The actor's model family and the path that runs it, as ``print(lab)`` shows them."""
    model = model_config(config.actor.model_path, "actor.model_path")
    impl = _actor_impl(config, model)
    return f"{model.model_type} on {'the project decoder' if impl == 'native' else 'transformers'}"


def _check_transformers_path(config: LabConfig) -> None:
    """What the transformers path cannot do is refused by key, naming the model and the path that can."""
    model = model_config(config.actor.model_path, "actor.model_path")
    if _actor_impl(config, model) != "transformers":
        return
    why = (f"{config.actor.model_path} ({model.model_type}) runs on the transformers path, which has no "
           f"{{}}; {{}}, or use a model the project's decoder runs (qwen2, llama, qwen3, mistral)")
    refused = {
        "actor.engine.tensor_parallel": (config.actor.engine.tensor_parallel > 1, "tensor parallelism", "set it to 1"),
        "rollout.tensor_parallel": (config.rollout.engine == "torch" and config.rollout.tensor_parallel > 1,
                                    "tensor parallelism", "set it to 1 (vLLM shards a model itself)"),
        "rollout.reshard": (config.rollout.reshard != "hybridflow", "resharding strategies to compare",
                            "set rollout.reshard=hybridflow"),
        "rollout.decoding": (config.rollout.engine == "torch" and config.rollout.decoding != "eager",
                             f"{config.rollout.decoding} decoding step (both mirror the project's decoder)",
                             "set rollout.decoding=eager"),
        "actor.engine.torch_compile": (config.actor.engine.torch_compile, "compiled layers",
                                       "set actor.engine.torch_compile=false"),
        "actor.engine.pipeline_parallel": (config.actor.engine.pipeline_parallel > 1, "pipeline stages",
                                           "set it to 1"),
    }
    for key, (refuse, missing, fix) in refused.items():
        if refuse:
            raise ConfigError(key, why.format(missing, fix))
    if routed_experts(model) and config.rollout.tensor_parallel > 1:
        raise ConfigError("rollout.tensor_parallel", f"{config.actor.model_path} is a mixture of "
                          f"{routed_experts(model)} experts, and the check of every weight sync reads vLLM's experts "
                          "only when one engine holds them whole: set rollout.tensor_parallel=1")


def _check_lora_targets(config: LabConfig, roles: tuple[str, ...]) -> None:
    """Every module LoRA targets is a linear layer the role's model has; adapters to start from fit the role's."""
    for name in roles:
        role = getattr(config, name)
        if role.lora.adapter_path and not role.lora.enabled:
            raise ConfigError(f"{name}.lora.adapter_path", f"starts from LoRA adapters, and {name}.lora.rank is 0 "
                              f"(no adapters): set {name}.lora.rank to their r")
        if not role.lora.enabled:
            continue
        path, impl = config.model_source(name)
        model = model_config(path, f"{name}.model_path")
        layers = linear_layer_names(model, impl)
        missing = [target for target in role.lora.target_modules if target not in layers]
        if missing:
            raise ConfigError(f"{name}.lora.target_modules", f"{path} ({model.model_type}) has no linear layer "
                              f"named {', '.join(missing)}; its layers are {', '.join(sorted(layers))}: target "
                              "those")
        if role.lora.adapter_path:
            _check_saved_adapters(role.lora, f"{name}.lora")


def _check_saved_adapters(lora: LoraConfig, key: str) -> None:
    """Adapters to start from must exist and have the role's LoRA settings (rank, alpha, target modules)."""
    try:
        saved = adapter_settings(lora.adapter_path or "")
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{key}.adapter_path", f"cannot start from these adapters: {error}") from None
    differ = {field: (getattr(saved, field), getattr(lora, field)) for field in ("rank", "alpha")
              if getattr(saved, field) != getattr(lora, field)}
    if set(saved.target_modules) != set(lora.target_modules):
        differ["target_modules"] = tuple(f"[{', '.join(modules)}]" for modules in (saved.target_modules,
                                                                                   lora.target_modules))
    if differ:
        raise ConfigError(f"{key}.adapter_path", f"{lora.adapter_path} holds adapters with " + ", ".join(
            f"{field} {theirs} (this run: {ours})" for field, (theirs, ours) in differ.items()) + "; set "
            + " ".join(f"{key}.{field}={theirs}" for field, (theirs, _) in differ.items()))


def _check_device(config: LabConfig, roles: tuple[str, ...]) -> None:
    """GPUs asked for exist, one per rank of every pool, and support the training dtype."""
    gpus = visible_gpus(config.backend)
    if resolve_device(config, gpus) != "cuda":
        return
    slots = config.pool_slots(roles)
    if gpus == 0:
        raise ConfigError("device", f"cuda asks for GPUs but torch {torch.__version__} (CUDA build: "
                          f"{torch.version.cuda or 'none'}) sees none here; use device=cpu (or auto), or run on a "
                          "machine with GPUs and a CUDA build of torch")
    if gpus is not None and sum(slots.values()) > gpus:
        needed = " + ".join(f"{pool} {n}" for pool, n in slots.items())
        raise ConfigError(f"{roles[0]}.ranks", f"the pools need one GPU per rank ({needed}) but {gpus} exist; use "
                          "fewer ranks, or colocate roles on one pool (critic.pool=main)")
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        for name in (role for role in roles if role != "rollout"):
            if getattr(config, name).engine.bf16:
                raise ConfigError(f"{name}.engine.bf16", f"{torch.cuda.get_device_name()} has no bfloat16; set "
                                  f"{name}.engine.bf16=false")


def _check_cpp_compiler(config: LabConfig, key: str, off: str) -> None:
    missing = missing_cpp_compiler() if resolve_device(config) == "cpu" else None
    if missing:
        raise ConfigError(key, f"{missing}; install one (g++) or set {key}={off}")


def _check_generation(config: LabConfig) -> None:
    """The actor's model splits into the TP shards asked for and holds the longest sequence; the decoding step
    and the engine chosen run here."""
    rollout, model = config.rollout, model_config(config.actor.model_path, "actor.model_path")
    _check_shardable(model, "actor.engine.tensor_parallel", config.actor.engine.tensor_parallel)
    _check_shardable(model, "rollout.tensor_parallel", rollout.tensor_parallel)
    _check_stages(model, config.actor.engine.pipeline_parallel)
    context = getattr(model, "max_position_embeddings", None)
    longest, bound = longest_sequence(config)
    if context and longest > context:
        key = "agent.max_tokens" if multi_turn(config) else "rollout.max_prompt_tokens"
        raise ConfigError(key, f"{bound} is more than the {context} positions of {config.actor.model_path} "
                          "(config.json's max_position_embeddings); lower them to fit")
    window = window_refusal(model, longest)
    if window:
        raise ConfigError("rollout.max_new_tokens", f"{window}; lower {bound} to fit in it")
    if rollout.decoding == "onednn":
        _check_onednn(config, model)
    if rollout.decoding != "eager":
        _check_cpp_compiler(config, "rollout.decoding", "eager")
    if rollout.engine == "vllm":
        _check_vllm(config, model)


def _check_stages(model: PretrainedConfig, p: int) -> None:
    """The actor's layers split evenly into its pipeline stages, and no weight is shared between two stages."""
    key, layers = "actor.engine.pipeline_parallel", model.num_hidden_layers
    if p == 1:
        return
    if layers % p:
        split = (f"they would take {', '.join(str(len(stage)) for stage in stage_layers(layers, p))} layers, the "
                 "largest stage setting the pace") if p <= layers else f"{p - layers} stage(s) would hold no layer"
        raise ConfigError(key, f"{p} stages do not divide the model's {layers} layers ({split}); use one of "
                          f"{divisors(layers)}")
    if routed_experts(model):
        raise ConfigError(key, f"the model is a mixture of {routed_experts(model)} experts, whose routes the stages do "
                          f"not report for the rollout's check; set {key}=1")
    if getattr(model, "tie_word_embeddings", False):
        raise ConfigError(key, "the model ties its output head to its embeddings (config.json's tie_word_embeddings), "
                          "which sit on the first and the last stage; tied weights across stages are not built: set "
                          f"{key}=1")


def _check_onednn(config: LabConfig, model: PretrainedConfig) -> None:
    key, device = "rollout.decoding", resolve_device(config)
    if device != "cpu":
        raise ConfigError(key, f"onednn packs the weights for oneDNN's CPU kernels, and the actor runs on {device}; "
                          f"set {key}=compiled (it runs on a GPU too) or eager")
    refusal = missing_onednn() or unmirrored_architecture(model.model_type)
    if refusal:
        raise ConfigError(key, f"{refusal}; set {key}=compiled or eager")


def _check_vllm(config: LabConfig, model: PretrainedConfig) -> None:
    rollout, ranks = config.rollout, config.actor.ranks
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", "vllm is not installed in this environment; on the CPU `make lab` (or "
                          "`make test`) installs vLLM's CPU build into .venv, the kernel JupyterLab starts from "
                          "there; on a GPU machine pip install -e '.[gpu]'; or use rollout.engine=torch")
    from vllm import ModelRegistry

    architecture = (model.architectures or [type(model).__name__])[0]
    if architecture not in ModelRegistry.get_supported_archs():
        raise ConfigError("actor.model_path", f"vLLM cannot load {architecture} (the model's config.json "
                          "architectures); use rollout.engine=torch for it, or a model vLLM supports")
    if not torch.cuda.is_available():
        import psutil

        free = psutil.virtual_memory().available / 2**30
        if rollout.kv_cache_gib * ranks > KV_CACHE_SHARE * free:
            raise ConfigError("rollout.kv_cache_gib", f"{ranks} vLLM engines x {rollout.kv_cache_gib} GiB of KV "
                              f"cache is more than {KV_CACHE_SHARE:.0%} of the {free:.1f} GiB this machine has free; "
                              f"use at most {max(1, int(KV_CACHE_SHARE * free) // ranks)}")


def _check_vocabulary(config: LabConfig, models: dict[str, str]) -> None:
    """Every model embeds every id of the actor's tokenizer (the one that encodes prompts for all of them)."""
    path = config.actor.model_path
    size = len(_tokenizer(path))
    if config.reward_model_path:
        models = {**models, "reward_model_path": config.reward_model_path}
    for key, model_path in models.items():
        vocab = model_config(model_path, key).vocab_size
        if size > vocab:
            raise ConfigError(key, f"{model_path} has vocab_size {vocab} but the actor's tokenizer ({path}) has "
                              f"{size} tokens, so ids {vocab} and up have no embedding; use the tokenizer the model "
                              f"was built with, or a model whose vocab_size is at least {size}")


def _tokenizer(path: str) -> Any:
    # without tokenizer files transformers quietly builds an empty tokenizer from config.json's model_type
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError("actor.model_path", f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save "
                          f"the model's tokenizer there with tokenizer.save_pretrained({path!r}), or create the "
                          "directory with hybridflow_lab.models.create_model_dir")
    return load_tokenizer(path)


def _check_shardable(model: PretrainedConfig, key: str, size: int) -> None:
    try:
        check_shardable(model, size)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def model_config(path: str, key: str) -> PretrainedConfig:
    """The config.json of the model directory ``path`` that setting ``key`` names; ``ConfigError`` when missing."""
    if not path:
        raise ConfigError(key, "no model directory given; create one with `hybridflow-lab init-model` or "
                          "hybridflow_lab.models.create_model_dir")
    try:
        return load_config(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(key, str(exc)) from None
