"""The oneDNN decoding step (``rollout.decoding=onednn``): the eager step's logits from weights packed for oneDNN."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridflow_lab.models import char_tokenizer
from hybridflow_lab.models.decode_step import decode_step, missing_cpp_compiler
from hybridflow_lab.models.factory import build_model, tiny_config
from hybridflow_lab.models.kv_cache import KVCache
from hybridflow_lab.models.lora import LoraConfig, adapters_disabled, apply_lora
from hybridflow_lab.models.onednn_decode import PackedDecoder, missing_onednn
from hybridflow_lab.models.tensor_parallel import TensorParallel

pytestmark = pytest.mark.skipif(bool(missing_cpp_compiler() or missing_onednn()),
                                reason=str(missing_cpp_compiler() or missing_onednn()))

TOKENIZER = char_tokenizer()
PROMPTS = ["1+1=", "23+4=", "100+250=", "7+8="]
STEPS = 6


def with_random_norms_and_biases(model: nn.Module) -> nn.Module:
    """The factory zeroes biases and sets norms to one; random ones make every term count."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.copy_(parameter + 0.1 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def qwen2() -> nn.Module:
    """q/k/v biases, untied head."""
    return with_random_norms_and_biases(build_model(tiny_config("tiny", "qwen2", TOKENIZER), seed=3))


def llama() -> nn.Module:
    """Every bias, a head tied to the embeddings, a head size apart from hidden / heads and llama3's rope scaling."""
    config = tiny_config("tiny", "llama", TOKENIZER)
    config.tie_word_embeddings, config.attention_bias, config.mlp_bias, config.head_dim = True, True, True, 48
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    return with_random_norms_and_biases(build_model(config, seed=4))


def qwen3() -> nn.Module:
    """An RMS norm over each query and key head (random weights)."""
    return with_random_norms_and_biases(build_model(tiny_config("tiny", "qwen3", TOKENIZER), seed=5))


def logits_each_step(model: nn.Module, step) -> list[torch.Tensor]:
    """Each decoding step's logits for left-padded prompts, two samples sharing each prompt's prefill, the same
    tokens fed every time, and half the rows leaving halfway."""
    batch = TOKENIZER(PROMPTS, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert not mask.all()  # left padding, hidden by the step's mask
    cache = KVCache(model.config, len(PROMPTS), ids.shape[1] + STEPS, torch.float32)
    with torch.no_grad():
        model(ids, mask, cache=cache, keep_last=1)
    cache.keep_rows(torch.arange(len(PROMPTS)).repeat_interleave(2))
    tokens = torch.randint(3, len(TOKENIZER), (STEPS, 2 * len(PROMPTS)), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(2 * len(PROMPTS))
    out = []
    with torch.no_grad():
        for index in range(STEPS):
            if index == STEPS // 2:
                rows = rows[1::2]
                cache.keep_rows(torch.arange(1, 2 * len(PROMPTS), 2))
            out.append(step(tokens[index, rows], cache))
    return out


def assert_same_logits(model: nn.Module, reference: nn.Module | None = None) -> None:
    reference = reference or model
    expected = logits_each_step(reference, lambda tokens, cache: decode_step(reference, tokens, cache))
    packed = PackedDecoder(model, rows=2 * len(PROMPTS))
    for got, want in zip(logits_each_step(model, packed.step), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", [qwen2, llama, qwen3])
def test_the_onednn_step_gives_the_eager_steps_logits(build):
    assert_same_logits(build())


def test_the_onednn_step_packs_lora_layers_merged_with_their_adapters_while_they_are_on():
    model = apply_lora(qwen2(), LoraConfig(rank=4))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(0, 0.05)  # trained adapters (they start at zero)
    assert_same_logits(model)
    base = qwen2()
    with adapters_disabled(model):  # the reference policy: the base weights alone
        assert_same_logits(model, reference=base)


def test_the_onednn_step_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        PackedDecoder(qwen2().to(torch.bfloat16), rows=4)
    sharded = build_model(tiny_config("tiny", "qwen2", TOKENIZER))
    sharded.tp = TensorParallel(rank=0, size=2)
    with pytest.raises(ValueError, match="without tensor parallelism"):
        PackedDecoder(sharded, rows=4)


def test_the_onednn_step_refuses_an_architecture_it_does_not_mirror_by_name():
    model = qwen2()
    model.config.model_type = "phi3"  # a decoder the C++ step was not written for
    with pytest.raises(ValueError, match="mirrors the qwen2, llama, qwen3, mistral decoders only, and this model's "
                                         "model_type is 'phi3'"):
        PackedDecoder(model, rows=4)
