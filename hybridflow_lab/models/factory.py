"""Tiny models built from a transformers config with a fixed seed, saved and loaded as HF directories."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hybridflow_lab.models.causal_lm import CausalLM
from hybridflow_lab.models.decoder import DecoderLM, init_weights
from hybridflow_lab.models.families import model_impl
from hybridflow_lab.models.tensor_parallel import SINGLE, TensorParallel, shard_state_dict
from hybridflow_lab.models.tokenizers import char_tokenizer
from hybridflow_lab.models.transformers_lm import TransformersLM, load_transformers_lm

# name -> (hidden, intermediate, layers, heads, kv heads); roughly 1M, 4M (the standard workload) and 11M.
# "small" splits 1, 2 or 4 ways for tensor parallelism (8 heads, 4 KV heads, vocabulary 100).
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 384, 4, 4, 2),
    "standard": (256, 1024, 4, 4, 2),
    "small": (384, 1152, 6, 8, 4),
}
TINY_FAMILIES = ("qwen2", "llama", "qwen3", "mistral", "gemma3_text", "phi3", "qwen3_moe")  # tiny_config's archs
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"  # Hugging Face's older format: a pickle, which can run code when loaded
PICKLE_WEIGHTS_INDEX = "pytorch_model.bin.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def tiny_config(
    size: str, arch: str, tokenizer: PreTrainedTokenizerBase, max_positions: int = 2048
) -> PretrainedConfig:
    """An HF config of a named size for ``arch`` (a ``TINY_FAMILIES`` model_type) and the tokenizer's vocabulary."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; sizes: {', '.join(SIZES)}")
    if arch not in TINY_FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; architectures: {', '.join(TINY_FAMILIES)}")
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    return AutoConfig.for_model(arch,
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch]],
        **_family_fields(arch, hidden, intermediate, layers, heads, max_positions),
    )


def _family_fields(arch: str, hidden: int, intermediate: int, layers: int, heads: int, positions: int
                   ) -> dict[str, Any]:
    """What a family's tiny config sets beyond the sizes: Qwen3's and Gemma 3's heads sized as the others' (their
    defaults are 128 and 256); Mistral's sliding window as long as the positions (its code runs, every sequence
    fits); Gemma 3's short enough to matter, on every other layer; Qwen3-MoE's 4 experts, 2 per token."""
    if arch == "mistral":
        return {"sliding_window": positions}
    fields: dict[str, Any] = {"head_dim": hidden // heads} if arch in ("qwen3", "gemma3_text", "qwen3_moe") else {}
    if arch == "gemma3_text":
        fields.update(query_pre_attn_scalar=hidden // heads, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if arch == "qwen3_moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate // 2,
                      norm_topk_prob=True)
    return fields


def build_model(config: PretrainedConfig, seed: int = 0, std: float = 0.02) -> CausalLM:
    """A freshly initialised float32 model (same seed, same weights), on the path ``model_impl`` picks; on the
    transformers path, weights that are not a linear layer's or an embedding's (fused experts) get the family's own
    initialisation, seeded too."""
    if model_impl(config) == "native":
        model: CausalLM = DecoderLM(config)
    else:
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = TransformersLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                    attn_implementation="sdpa"))
    init_weights(model, std, seed)
    return model


def create_model_dir(
    path: str | os.PathLike[str],
    size: str = "tiny",
    arch: str = "qwen2",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write a new model directory (config, safetensors weights, tokenizer) that transformers can load."""
    tokenizer = tokenizer or char_tokenizer()
    model = build_model(tiny_config(size, arch, tokenizer), seed)
    return save_model_dir(model, path, tokenizer)


def save_model_dir(model: torch.nn.Module, path: str | os.PathLike[str],
                   tokenizer: PreTrainedTokenizerBase | None = None,
                   state: dict[str, torch.Tensor] | None = None) -> Path:
    """Save ``model`` (and ``tokenizer``) as an HF directory; tied weights are stored once.

    ``state`` replaces the model's own weights (e.g. the gathered full weights of a TP shard).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    state = {k: v.detach().contiguous() for k, v in (state or model.state_dict()).items()}
    if isinstance(model, TransformersLM):
        state = model.checkpoint_state(state)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    _write_weights(state, path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path / (WEIGHTS + ".tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, path / WEIGHTS)


def convert_to_safetensors(path: str | os.PathLike[str]) -> Path:
    """Write ``model.safetensors`` from a directory's ``pytorch_model.bin`` (or its shards), the explicit step
    that lets a pickle-only model directory you trust load. The pickles are read with
    ``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers."""
    path = Path(path)
    if (path / PICKLE_WEIGHTS_INDEX).is_file():
        shards = index_shards(path / PICKLE_WEIGHTS_INDEX)
    elif (path / PICKLE_WEIGHTS).is_file():
        shards = [PICKLE_WEIGHTS]
    else:
        raise FileNotFoundError(f"{path} has neither {PICKLE_WEIGHTS} nor {PICKLE_WEIGHTS_INDEX}")
    state = {}
    for shard in shards:
        state.update(torch.load(path / shard, map_location="cpu", weights_only=True))
    # pickles may share storage between tensors (tied embeddings); safetensors stores each tensor on its own
    _write_weights({k: v.detach().clone().contiguous() for k, v in state.items()}, path)
    return path / WEIGHTS


def load_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """The HF config of a local model directory, with a clear error when it is missing."""
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"model path {str(path)!r} {what}; create one with hybridflow_lab.models.create_model_dir "
            "or point at a local Hugging Face model directory (hub downloads are disabled)"
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model_impl(config)  # one of the two paths runs it
    return config


def index_shards(index: Path) -> list[str]:
    """The shard files a sharded checkpoint's index names."""
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a model directory: one safetensors file or a sharded set with an index."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return load_file(path / WEIGHTS)
    if (path / WEIGHTS_INDEX).is_file():
        return {k: v for shard in index_shards(path / WEIGHTS_INDEX) for k, v in load_file(path / shard).items()}
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
    if pickles:
        raise FileNotFoundError(
            f"{path} has only pickle weights ({', '.join(pickles)}), which can run code when loaded, so they are "
            f"not read; if you trust the directory, convert them once with "
            f"hybridflow_lab.models.convert_to_safetensors({str(path)!r})"
        )
    raise FileNotFoundError(f"{path} has neither {WEIGHTS} nor {WEIGHTS_INDEX}")


def weight_names(path: str | os.PathLike[str]) -> set[str]:
    """The tensor names of a model directory, read from the safetensors headers (no tensor is loaded)."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        with safe_open(path / WEIGHTS, "pt") as weights:
            return set(weights.keys())
    if (path / WEIGHTS_INDEX).is_file():
        return set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"])
    return set(read_weights(path))  # raises, naming what the directory holds instead


def load_causal_lm(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, impl: str = "auto") -> CausalLM:
    """Load a causal LM from a local HF directory: into the project's decoder, or through transformers
    (``families.model_impl``: ``impl`` forces a path)."""
    config = load_config(path)
    if model_impl(config, impl) == "transformers":
        return load_transformers_lm(str(path), dtype)
    model = DecoderLM(config)
    load_weights(model, path)
    return model.to(dtype)


def load_weights(model: torch.nn.Module, path: str | os.PathLike[str], tp: TensorParallel = SINGLE) -> None:
    """Load a model directory's weights into ``model``, this rank's ``tp`` shard of them (a tied ``lm_head``
    may be absent). A transformers model reads them through transformers, which converts the checkpoint's layout
    to the one it computes with (Qwen3-MoE's experts, one tensor each on disk, fused in memory)."""
    tied = ("lm_head.weight",) if getattr(model.config, "tie_word_embeddings", False) else ()
    weights = load_transformers_lm(str(path)).state_dict() if isinstance(model, TransformersLM) else \
        shard_state_dict(read_weights(path), tp)
    load_matching(model, weights, str(path), allow_missing=tied)


def load_matching(model: torch.nn.Module, weights: dict[str, Any], source: str,
                  allow_missing: tuple[str, ...] = (), ignore_unexpected: tuple[str, ...] = ()) -> None:
    """``load_state_dict`` that names the missing and unexpected keys and their source."""
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if k not in allow_missing]
    unexpected = [k for k in result.unexpected_keys if not k.startswith(ignore_unexpected)]
    if missing or unexpected:
        raise ValueError(f"weights in {source} do not match the model: missing {missing[:8]}, unexpected "
                         f"{unexpected[:8]}")
