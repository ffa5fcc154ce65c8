"""The vLLM adapter's translation layers and config checks, without starting vLLM (tests/test_vllm.py runs it)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hybridflow_lab.config import ConfigError, LabConfig, load_config
from hybridflow_lab.dataflows import check_config
from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.engines.vllm_rollout import (
    engine_arguments,
    pack_outputs,
    unpadded_prompts,
    vllm_sampling_kwargs,
)
from hybridflow_lab.engines.weight_fingerprint import (
    WeightSyncError,
    check_fingerprints,
    fingerprints,
    matrix_fingerprint,
    probe,
)
from hybridflow_lab.models import create_model_dir


def test_sampling_parameters_translate():
    kwargs = vllm_sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.8, top_k=0, n=3,
                                                 stop_token_ids=(5,), seed=1), eos_token_id=2)
    assert kwargs == {"n": 3, "temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_tokens": 7, "min_tokens": 0,
                      "ignore_eos": False, "stop_token_ids": [5, 2], "seed": 1, "logprobs": 0, "detokenize": False}
    greedy = vllm_sampling_kwargs(SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=4, n=4), 2)
    assert greedy["temperature"] == 0.0 and greedy["min_tokens"] == 4
    assert greedy["stop_token_ids"] == [] and greedy["n"] == 1  # EOS ignored; vLLM refuses n > 1 greedy samples


def test_completions_become_the_training_layout():
    prompt_ids = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert unpadded_prompts(prompt_ids, prompt_mask) == [[7, 8], [5, 6, 7, 8]]
    out = pack_outputs(prompt_ids, prompt_mask, [[9, 2], [9, 9, 9], [4], [4, 4]],
                       [[-0.1, -0.2], [-1.0, -1.0, -1.0], [-0.5], [-0.5, -0.6]], n=2, max_new_tokens=3,
                       pad_token_id=0)
    assert out["responses"].tolist() == [[9, 2, 0], [9, 9, 9], [4, 0, 0], [4, 4, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out["prompts"].tolist() == [[0, 0, 7, 8], [0, 0, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]]
    assert out["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 3]
    torch.testing.assert_close(out["rollout_log_probs"][0], torch.tensor([-0.1, -0.2, 0.0]))


def test_vllm_runs_eagerly_on_the_cpu_compiled_on_cuda_unless_set_and_without_its_custom_all_reduce(tmp_path):
    """``rollout.enforce_eager`` reaches the engine; unset, CUDA keeps vLLM's CUDA graphs and torch.compile. The
    custom all-reduce is off everywhere (it cannot map its TP peers where Ray shows each rank one GPU), and only
    a CUDA engine beside a trainer sleeps (the CPU build refuses sleep mode)."""
    from hybridflow_lab.workers.actor import vllm_settings

    model = create_model_dir(tmp_path / "m", "tiny", "qwen2")
    config = load_config(LabConfig, overrides=[f"actor.model_path={model}", "rollout.engine=vllm"])
    settings = vllm_settings(config, replica=0)
    on_cpu, on_cuda = engine_arguments(model, settings, on_cuda=False), engine_arguments(model, settings, on_cuda=True)
    assert (on_cpu["enforce_eager"], on_cuda["enforce_eager"]) == (True, False)
    assert on_cpu["disable_custom_all_reduce"] and on_cuda["disable_custom_all_reduce"]
    assert (on_cpu["enable_sleep_mode"], on_cuda["enable_sleep_mode"]) == (False, True)
    eager = vllm_settings(load_config(LabConfig, overrides=[f"actor.model_path={model}", "rollout.engine=vllm",
                                                             "rollout.enforce_eager=true"]), replica=0)
    assert engine_arguments(model, eager, on_cuda=True)["enforce_eager"]
    own_pool = vllm_settings(config, replica=0, sleeps=False)  # a rollout group of its own keeps its weights
    assert not engine_arguments(model, own_pool, on_cuda=True)["enable_sleep_mode"]
    assert engine_arguments(model, dataclasses.replace(settings, enforce_eager=False), False)["enforce_eager"] is False


def test_vllm_is_refused_before_start_in_a_kernel_without_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "vllm" else real_find_spec(name, *args))
    model = create_model_dir(tmp_path / "m", "tiny", "qwen2")
    config = load_config(LabConfig, overrides=[f"actor.model_path={model}", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"vllm is not installed in this environment; on the CPU `make lab`") as info:
        check_config(config)
    assert info.value.key == "rollout.engine"


def test_fingerprints_move_with_any_single_element_and_name_the_tensor():
    torch.manual_seed(0)
    state = {"w": torch.randn(6, 5), "b": torch.randn(6)}
    expected = fingerprints(state)
    check_fingerprints(expected, fingerprints({k: v.clone() for k, v in state.items()}), rtol=1e-9)
    for row, column in ((0, 0), (5, 4)):  # one element moved by 1e-5 of its size
        moved = state["w"].clone()
        moved[row, column] *= 1 + 1e-5
        with pytest.raises(WeightSyncError, match="the rollout engine's w is not the trainer's") as info:
            check_fingerprints(expected, fingerprints({**state, "w": moved}), rtol=1e-9)
        assert info.value.tensor == "w"


def test_a_matrix_fingerprint_is_computed_in_blocks_of_at_most_the_chunk_size_and_equals_the_whole_product():
    torch.manual_seed(0)
    matrix = torch.randn(4096, 64, dtype=torch.bfloat16)  # 2 MiB as float64 (a 150k vocabulary's would be GBs)
    whole = matrix.double() @ probe(64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        blocked = matrix_fingerprint(matrix, probe(64), dtype=torch.float32, chunk_bytes=64 * 2**10)
    assert max(event.cpu_memory_usage for event in profiled.events()) <= 64 * 2**10
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-12 * float(whole.abs().max()))


def test_fingerprint_checks_name_unsent_and_missing_tensors():
    state = {"a": torch.ones(3, 2), "b": torch.ones(3)}
    with pytest.raises(WeightSyncError, match="the sync did not send it") as info:
        check_fingerprints(fingerprints({"a": state["a"]}), fingerprints(state), rtol=1e-9)
    assert info.value.tensor == "b"
    with pytest.raises(WeightSyncError, match="the engine has no such tensor"):
        check_fingerprints(fingerprints(state), fingerprints({"a": state["a"]}), rtol=1e-9)
    padded = {"a": torch.cat([state["a"], torch.zeros(2, 2)]), "b": state["b"]}  # vocabulary rows padded
    check_fingerprints(fingerprints(state), fingerprints(padded), rtol=1e-9)
