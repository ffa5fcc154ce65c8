"""Models: one Qwen2/Llama decoder definition, tiny-model factory, tokenizers, scalar heads."""

from hybridflow_lab.models.decoder import DecoderLM, describe
from hybridflow_lab.models.factory import (
    SIZES,
    build_model,
    convert_to_safetensors,
    create_model_dir,
    load_causal_lm,
    load_config,
    save_model_dir,
    tiny_config,
)
from hybridflow_lab.models.kv_cache import KVCache
from hybridflow_lab.models.tokenizers import char_tokenizer, train_bpe_tokenizer

__all__ = ["SIZES", "DecoderLM", "KVCache", "build_model", "char_tokenizer", "convert_to_safetensors",
           "create_model_dir", "describe", "load_causal_lm", "load_config", "save_model_dir", "tiny_config",
           "train_bpe_tokenizer"]
