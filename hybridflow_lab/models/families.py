"""The model families the project's own decoder runs, and why it refuses a config it cannot.

The decoder (``decoder.py``) is Llama's, with the few lines each family changes: Qwen2's biases on the query, key
and value projections, Qwen3's RMS norms over each query and key head, Mistral's sliding window (exact while a
sequence fits inside it). Every other causal LM is for ``transformers``' own model classes.
"""

from __future__ import annotations

from typing import Literal

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

NATIVE_FAMILIES = ("qwen2", "llama", "qwen3", "mistral")
ModelImpl = Literal["native", "transformers"]


def native_refusal(config: PretrainedConfig) -> str | None:
    """Why the project's decoder cannot run ``config``, or None when it can."""
    if config.model_type not in NATIVE_FAMILIES:
        return (f"model_type {config.model_type!r} is not one the project's decoder runs "
                f"({', '.join(NATIVE_FAMILIES)})")
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention on some layers (config.use_sliding_window=True) is not supported"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} is not supported; the project's decoder runs 'silu'"
    return None


def model_impl(config: PretrainedConfig, forced: str = "auto") -> ModelImpl:
    """Which path runs ``config``: ``native`` (the project's decoder) where it can, else ``transformers``; ``forced``
    (``native`` or ``transformers``) takes that path, or says why it cannot."""
    refusal = native_refusal(config)
    if forced == "native" and refusal:
        raise ValueError(f"{refusal}; the transformers path runs it (model_impl=transformers, or auto)")
    if forced == "native" or (forced == "auto" and refusal is None):
        return "native"
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model_type {config.model_type!r} is neither a family the project's decoder runs "
                         f"({', '.join(NATIVE_FAMILIES)}) nor one transformers' AutoModelForCausalLM loads; point "
                         "at a causal LM's directory (a *ForCausalLM in its config.json's architectures)")
    return "transformers"


def qkv_bias(config: PretrainedConfig) -> bool:
    """Whether the query, key and value projections have biases (always in Qwen2; ``attention_bias`` elsewhere)."""
    return config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))


def output_bias(config: PretrainedConfig) -> bool:
    """Whether the attention's output projection has a bias (``attention_bias``, except in Qwen2)."""
    return config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))


def head_norms(config: PretrainedConfig) -> bool:
    """Whether each query and key head is RMS-normalised before the rotary embedding (Qwen3)."""
    return config.model_type == "qwen3"


def routed_experts(config: PretrainedConfig) -> int:
    """How many experts each mixture-of-experts layer of ``config``'s model routes between (0: a dense model)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def attention_window(config: PretrainedConfig) -> int | None:
    """The tokens a query attends to at most (Mistral's ``sliding_window``), None for all of them."""
    return getattr(config, "sliding_window", None) if config.model_type == "mistral" else None


def window_refusal(config: PretrainedConfig, tokens: int) -> str | None:
    """Why sequences of ``tokens`` cannot run in the project's decoder (longer than the model's window)."""
    window = attention_window(config)
    if window is not None and tokens > window:
        return (f"sequences of up to {tokens} tokens are longer than the model's sliding window ({window}), which the "
                f"project's decoder does not apply")
    return None
