"""LoRA: low-rank adapters on a model's linear projections, with the base weights frozen.

``apply_lora`` swaps each targeted ``nn.Linear`` for a ``LoraLinear`` that keeps the base ``weight``
(and ``bias``) under their own names and adds ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]``,
so ``y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T``. ``lora_B`` starts at zero: the adapted
model starts as the base. With the adapters switched off (``adapters_disabled``) the model *is* the
base, which is how the actor's reference policy costs no second copy of the weights (verl's
``ref_in_actor``). ``merged_weights`` turns a weight stream with adapters into the plain model's
(``W + s B A``), which is what a rollout engine loads; the trainable tensors alone are the
adapter checkpoint, written in PEFT's format (``peft.PeftModel.from_pretrained`` loads it; ``load_adapters`` reads
what PEFT wrote).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from hybridflow_lab.config import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's names: its wrapper's, then the model's own
ADAPTER_MATRICES = ("lora_A", "lora_B")  # PEFT's are nn.Linear layers: ``lora_A.weight``


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, config: LoraConfig) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.Parameter(torch.empty(config.rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, config.rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear initialises its weight
        self.scaling = config.scaling
        self.dropout = nn.Dropout(config.dropout)
        self.adapters_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return out
        return out + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * lora_b @ lora_a``, computed in float32 and returned in ``weight``'s dtype."""
    update = (lora_b.float() @ lora_a.float()) * scaling
    return (weight.float() + update).to(weight.dtype)


def apply_lora(model: nn.Module, config: LoraConfig, trainable: tuple[str, ...] = ()) -> nn.Module:
    """Put adapters on ``model``'s targeted projections in place and freeze everything but them and the
    parameters whose names start with one of ``trainable`` (a critic's value head). Returns ``model``."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in config.target_modules]
    if not targets:
        raise ValueError(f"the model has no linear layer named one of {config.target_modules}")
    model.requires_grad_(False)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoraLinear(module, config))
    for name, parameter in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B") or name.startswith(trainable):
            parameter.requires_grad_(True)
    model.lora_config = config
    return model


def has_adapters(model: nn.Module) -> bool:
    """Whether ``apply_lora`` put adapters on ``model``."""
    return getattr(model, "lora_config", None) is not None


def trainable_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters an optimizer should step: all of them, or only the adapters (and heads) under LoRA."""
    return (parameter for parameter in model.parameters() if parameter.requires_grad)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing as its base inside the block (the reference policy)."""
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for layer in layers:
        layer.adapters_enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.adapters_enabled = True


def merged_weights(weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of a plain model's weights from ``weights``, a stream of ``model``'s (with adapters): each adapted
    layer's ``weight`` merged with its ``lora_A``/``lora_B``, which are not sent. A layer's three tensors arrive
    together (state dicts and module-by-module gathers keep a module's parameters adjacent), so only one layer's
    are held at a time."""
    scaling = {name: module.scaling for name, module in model.named_modules() if isinstance(module, LoraLinear)}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix not in scaling or leaf == "bias":
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del pending[prefix]
            yield f"{prefix}.weight", merge(parts["weight"], parts["lora_A"], parts["lora_B"], scaling[prefix])
    if pending:
        raise KeyError(f"the weight stream ended inside adapted layer {next(iter(pending))!r} "
                       f"(got {sorted(next(iter(pending.values())))})")


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def trainable_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` (default: the model's) that ``model`` trains: what an adapter checkpoint holds."""
    names = trainable_names(model)
    state = state if state is not None else model.state_dict()
    return {name: tensor.detach().contiguous() for name, tensor in state.items() if name in names}


def peft_name(name: str) -> str:
    """A trainable tensor's name in PEFT's files (``...q_proj.lora_A``: ``base_model.model...q_proj.lora_A.weight``)."""
    return PEFT_PREFIX + name + (".weight" if name.rsplit(".", 1)[-1] in ADAPTER_MATRICES else "")


def peft_config(config: LoraConfig, heads: list[str], base_model: str | None) -> dict[str, object]:
    """``config`` as PEFT's ``adapter_config.json``: ``alpha / rank`` scaling (not rsLoRA), no bias, the trained heads
    as ``modules_to_save``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
            "target_modules": list(config.target_modules), "modules_to_save": heads or None, "bias": "none",
            "use_rslora": False, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}


def save_adapters(model: nn.Module, path: str | os.PathLike[str], state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the trainable tensors of ``state`` (default: the model's; adapters and any trained head) and the LoRA
    settings under ``path``, in PEFT's format."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = trainable_state(model, state)
    heads = sorted({name.rpartition(".")[0] for name in tensors if name.rsplit(".", 1)[-1] not in ADAPTER_MATRICES})
    tmp = path / (ADAPTER_WEIGHTS + ".tmp")
    save_file({peft_name(name): tensor for name, tensor in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, path / ADAPTER_WEIGHTS)
    base_model = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config(model.lora_config, heads, base_model), indent=1))
    return path


def adapter_settings(path: str | os.PathLike[str]) -> LoraConfig:
    """The LoRA settings of the adapters PEFT (or this project) saved under ``path``."""
    config_file = Path(path) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG}: not a LoRA adapter directory (PEFT's format)")
    saved = json.loads(config_file.read_text())
    variants = [key for key in ("use_rslora", "use_dora") if saved.get(key)]
    if saved.get("peft_type") != "LORA" or variants:
        raise ValueError(f"{config_file} holds {saved.get('peft_type')} adapters {' '.join(variants)}; only plain "
                         "LoRA (alpha / r scaling) loads here")
    targets = saved["target_modules"]
    return LoraConfig(rank=saved["r"], alpha=float(saved["lora_alpha"]), dropout=saved.get("lora_dropout", 0.0),
                      target_modules=tuple(sorted([targets] if isinstance(targets, str) else targets)))


def load_adapters(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load adapters in PEFT's format (``save_adapters``'s, or PEFT's own) into ``model``, built with the same
    LoRA settings; every trainable tensor must be in the file and nothing else."""
    path = Path(path)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS}: not a LoRA checkpoint")
    names = {peft_name(name): name for name in trainable_names(model)}
    weights = load_file(path / ADAPTER_WEIGHTS)
    if set(weights) != set(names):
        missing, unexpected = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise ValueError(f"the adapters in {path} do not match the model's: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]} (was it saved with other lora settings?)")
    model.load_state_dict({names[key]: tensor for key, tensor in weights.items()}, strict=False)
