"""Compiled layers (``engine.torch_compile``): the training and scoring passes give the eager passes' numbers."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from hybridflow_lab.algorithms.losses import ppo_policy_loss
from hybridflow_lab.config import LabConfig, OptimConfig
from hybridflow_lab.engines.forward import response_log_probs, response_values
from hybridflow_lab.engines.torch_engine import TorchEngine
from hybridflow_lab.models import create_model_dir, decoder, load_causal_lm
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.decoder import compile_layers, enable_gradient_checkpointing
from hybridflow_lab.models.heads import load_scalar_model
from hybridflow_lab.models.lora import LoraConfig, adapters_disabled, apply_lora
from hybridflow_lab.workers.actor import policy_gradients
from tests.test_packing import LONG_RESPONSE_LENGTHS, assert_same_gradients, gradients, ragged_batch

pytestmark = pytest.mark.skipif(bool(missing_cpp_compiler()), reason=str(missing_cpp_compiler()))


@pytest.fixture
def compiled_calls(monkeypatch) -> list[int]:
    """How many layer calls took the compiled parts (one entry per call)."""
    calls: list[int] = []
    parts = decoder._compiled_layer_parts

    def counted() -> object:
        calls.append(1)
        return parts()

    monkeypatch.setattr(decoder, "_compiled_layer_parts", counted)
    return calls


@pytest.mark.parametrize(("remove_padding", "checkpointing", "lora"), [(True, False, False), (False, True, False),
                                                                      (True, False, True)],
                         ids=["packed", "padded-checkpointing", "packed-lora"])
def test_compiled_layers_give_the_eager_actor_loss_gradients_and_log_probs(tmp_path, remove_padding, checkpointing,
                                                                           lora, compiled_calls):
    """The actor's whole token loss, its gradients and the no-grad log-probs, with two attention groups (under LoRA:
    the adapters' gradients, and the log-probs with the adapters switched off, the reference policy's)."""
    eager = load_causal_lm(create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=2))
    if lora:
        apply_lora(eager, LoraConfig(rank=4))
        for name, parameter in eager.named_parameters():
            if name.endswith("lora_B"):  # nonzero, so that the adapters' A matrices get gradients too
                torch.nn.init.normal_(parameter, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    if checkpointing:
        enable_gradient_checkpointing(eager)
        enable_gradient_checkpointing(compiled)
    batch = ragged_batch(eager.config.vocab_size, seed=3, response_lengths=LONG_RESPONSE_LENGTHS)
    config = LabConfig()
    config.actor.engine.remove_padding = remove_padding
    results = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        metrics, _ = policy_gradients(TorchEngine(model, OptimConfig()), [batch], config, ppo_policy_loss, kl_coef=0.1)
        with torch.no_grad(), adapters_disabled(model) if lora else contextlib.nullcontext():
            log_probs, _ = response_log_probs(model, batch, remove_padding=remove_padding)
        results[name] = (metrics.sums["loss"], gradients(model), log_probs)
    layers = eager.config.num_hidden_layers  # forward, recomputed forward under checkpointing, no-grad forward
    assert len(compiled_calls) == layers * (3 if checkpointing else 2)
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=1e-5, atol=1e-6)
    assert_same_gradients(results["eager"][1], results["compiled"][1])
    torch.testing.assert_close(results["compiled"][2], results["eager"][2], rtol=1e-5, atol=1e-5)


def test_compiled_layers_give_the_eager_critic_values_and_gradients(tmp_path, compiled_calls):
    eager = load_scalar_model(create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=4))
    torch.nn.init.normal_(eager.score.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    batch = ragged_batch(eager.config.vocab_size, seed=5)
    results = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        values = response_values(model, batch, remove_padding=True)
        (values**2).sum().backward()
        results[name] = (values.detach(), gradients(model))
    assert len(compiled_calls) == eager.config.num_hidden_layers
    assert bool((results["eager"][0] != 0).any())
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=1e-5, atol=1e-6)
    assert_same_gradients(results["eager"][1], results["compiled"][1])
