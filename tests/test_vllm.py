"""vLLM for real, one engine in this process (its CPU build, which ``make lab`` and ``make test`` install; ``make
test`` runs the ``vllm`` tests in a pass of their own, ``make test-vllm`` alone; tests/test_vllm_lab.py feeds it
from the actor's Ray ranks).

Same weights, same prompts: vLLM's greedy tokens are the built-in engine's, its log-probs the trainer's; a synced
engine generates with the trainer's weights, and a sync that misses or changes a tensor names it.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from hybridflow_lab.agents import (
    CALL_FORMATS,
    AgentLimits,
    ObservationRenderer,
    StepResult,
    Trajectory,
    run_episodes,
)
from hybridflow_lab.agents.environments import LocalEnvironments
from hybridflow_lab.agents.trajectory import left_padded
from hybridflow_lab.config import ConfigError, LabConfig, load_config
from hybridflow_lab.dataflows import check_config
from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.engines.torch_rollout import TorchRollout
from hybridflow_lab.engines.weight_fingerprint import WeightSyncError, fingerprints
from hybridflow_lab.models import char_tokenizer, create_model_dir, load_causal_lm
from hybridflow_lab.models.causal_lm import checkpoint_weights
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks.base import Example
from tests.test_workers import prompts

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: `make lab` or `make test` installs it")
from hybridflow_lab.engines.vllm_rollout import VllmRollout, VllmSettings

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm_engine")]  # one engine for the module
TOKENIZER = char_tokenizer()
NEW_TOKENS = 12
AGENT_TOKENS = 40  # a multi-turn trajectory after its prompt: turns and observations


MODEL_SEED = 3  # conftest's model_dir builds this module's tiny model with it


@pytest.fixture(scope="module")
def engine(model_dir):
    """One in-process vLLM engine for the module (it takes ~10-20 s to start)."""
    return VllmRollout(model_dir, SamplingParams(max_new_tokens=NEW_TOKENS), TOKENIZER.eos_token_id,
                       TOKENIZER.pad_token_id, VllmSettings(dtype=torch.float32, max_model_len=8 + AGENT_TOKENS))


@pytest.fixture
def model(model_dir, engine):
    """The checkpoint's weights, synced into the engine again after each test."""
    model = load_causal_lm(model_dir).eval()
    yield model
    engine.update_weights(load_causal_lm(model_dir).state_dict().items())


def built_in(model, params: SamplingParams, eos_token_id: int | None = TOKENIZER.eos_token_id) -> dict:
    batch = prompts()
    return TorchRollout(model, params, eos_token_id, TOKENIZER.pad_token_id).generate(batch["input_ids"],
                                                                                      batch["attention_mask"])


def generated(engine, params: SamplingParams) -> dict:
    batch = prompts()
    return engine.generate(batch["input_ids"], batch["attention_mask"], params)


def test_greedy_tokens_and_log_probs_equal_the_built_in_engines(engine, model):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True, n=2)
    ours, theirs = built_in(model, params), generated(engine, params)
    assert torch.equal(theirs["responses"], ours["responses"])
    assert torch.equal(theirs["response_mask"], ours["response_mask"])
    torch.testing.assert_close(theirs["rollout_log_probs"], ours["rollout_log_probs"], rtol=0, atol=1e-5)


def test_the_eos_token_stops_a_response_and_is_kept(engine, model):
    """vLLM has no tokenizer here: EOS must reach it as a stop token, and the response keeps it (mask 1)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    eos = int(built_in(model, params)["responses"][0, 3])  # a token greedy decoding emits early in row 0
    stopping = copy.copy(engine)  # the same vLLM engine, another EOS id
    stopping.eos_token_id = eos
    ours, theirs = built_in(model, params, eos), generated(stopping, params)
    length = int(theirs["response_mask"][0].sum())
    assert length <= 4 and theirs["responses"][0, length - 1] == eos
    assert torch.equal(theirs["response_mask"], ours["response_mask"])
    assert torch.equal(theirs["responses"], ours["responses"])


class Replying:
    """An environment that answers every turn with a user message, so every trajectory is multi-turn."""

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, action: str) -> StepResult:
        return StepResult("ok", role="user")


def episodes(generate_turn, stop: tuple[str, ...]) -> list[Trajectory]:
    batch = prompts()

    def turn(contexts: list[list[int]], max_new_tokens: int, _: int) -> list[tuple[list[int], list[float]]]:
        ids, mask = left_padded(contexts, TOKENIZER.pad_token_id)
        out = generate_turn(ids, mask, SamplingParams(max_new_tokens=max_new_tokens, greedy=True, stop=stop))
        real = out["response_mask"].bool()
        return [(row[keep].tolist(), logp[keep].tolist())
                for row, keep, logp in zip(out["responses"], real, out["rollout_log_probs"], strict=True)]

    examples = [Example(text, "", "test") for text in batch["prompt_text"]]
    renderer = ObservationRenderer(TOKENIZER, CALL_FORMATS["plain"], chat=False)
    return run_episodes(turn, LocalEnvironments([Replying() for _ in examples]), examples,
                        lambda text: TOKENIZER(text, add_special_tokens=False)["input_ids"], renderer,
                        AgentLimits(max_turns=3, max_tokens=AGENT_TOKENS, max_new_tokens=8))


def test_multi_turn_trajectories_are_the_built_in_engines_greedily_stop_strings_and_observations_included(engine,
                                                                                                        model):
    """The agent loop on each engine: the same turns (tokens, where a stop string ended them) and log-probs."""
    torch_engine = TorchRollout(model, SamplingParams(), TOKENIZER.eos_token_id, TOKENIZER.pad_token_id,
                                tokenizer=TOKENIZER)
    written = [turn.text for t in episodes(torch_engine.generate, ()) for turn in t.turns]
    stop = (next(text for text in written if len(text) >= 4)[2],)  # written mid-turn: turns now end at it
    ours, theirs = episodes(torch_engine.generate, stop), episodes(engine.generate, stop)
    assert any(turn.text.endswith(stop[0]) for t in ours for turn in t.turns)  # some turns ended at the stop
    assert all(len(t.turns) > 1 for t in ours)  # and every trajectory went on after an observation
    for mine, vllm_s in zip(ours, theirs, strict=True):
        assert [turn.ids for turn in vllm_s.turns] == [turn.ids for turn in mine.turns]
        assert [turn.observation_ids for turn in vllm_s.turns] == [turn.observation_ids for turn in mine.turns]
        assert vllm_s.ended == mine.ended
        torch.testing.assert_close([p for turn in vllm_s.turns for p in turn.log_probs],
                                   [p for turn in mine.turns for p in turn.log_probs], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 5)])
def test_sampled_log_probs_are_those_of_the_distribution_sampled_from(engine, model, temperature, top_k):
    """At temperature 1 without truncation they equal the trainer's; with T and top-k, the built-in engine's
    definition (softmax(logits / T) renormalised over the kept tokens), recomputed on vLLM's tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, top_k=top_k, n=4, seed=1)
    out = DataBatch(generated(engine, params))
    mask = out["response_mask"].bool()
    with torch.no_grad():
        logits = model(out["input_ids"], out["attention_mask"], out["position_ids"],
                       keep_last=NEW_TOKENS + 1)[:, :-1].float() / temperature
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        expected = logits.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"][mask], expected[mask], rtol=0, atol=1e-4)
    if not top_k:
        trainer, _ = response_log_probs(model, out, temperature)
        torch.testing.assert_close(out["rollout_log_probs"][mask], trainer[mask], rtol=0, atol=1e-4)


def perturbed(model) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_synced_engine_generates_with_the_new_weights(engine, model):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    before = generated(engine, params)
    stats = engine.update_weights(perturbed(model).items())
    assert stats["tensors"] == len(model.state_dict()) and stats["copied_bytes"] == sum(
        t.numel() * t.element_size() for t in model.state_dict().values())
    ours, theirs = built_in(model, params), generated(engine, params)
    assert torch.equal(theirs["responses"], ours["responses"])
    assert not torch.equal(theirs["responses"], before["responses"])
    # the CPU backend has no sleep mode, so nothing sleeps or wakes; the load comes before the generation
    assert list(engine.transitions)[-3:] == ["generate", "load_weights", "generate"]


def test_a_sync_that_skips_a_tensor_fails_naming_it(engine, model):
    skipped = "model.layers.1.self_attn.q_proj.weight"
    weights = [(name, tensor) for name, tensor in perturbed(model).items() if name != skipped]
    with pytest.raises(WeightSyncError, match=r"trainer's \(the sync did not send it") as info:
        engine.update_weights(weights)
    assert info.value.tensor == skipped


def test_a_trainer_tensor_the_engine_lacks_is_named(engine, model):
    expected = fingerprints(model.state_dict(), torch.float32)
    with pytest.raises(WeightSyncError, match="the engine has no such tensor") as info:
        engine.check_weights({**expected, "model.layers.9.mlp.up_proj.weight": torch.ones(4)})
    assert info.value.tensor == "model.layers.9.mlp.up_proj.weight"


@pytest.mark.parametrize("tensor", ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.bias",
                                    "model.norm.weight", "lm_head.weight"])
def test_an_engine_weight_that_differs_from_the_trainers_fails_naming_it(engine, model, model_dir, tensor):
    """vLLM keeps one stale tensor (a packed CPU matrix, a fused bias, a norm, the head): the check names it."""
    expected = perturbed(model)
    stale = dict(expected, **{tensor: load_causal_lm(model_dir).state_dict()[tensor]})
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(stale.items())})  # unchecked
    with pytest.raises(WeightSyncError, match="fingerprints differ") as info:
        engine.check_weights(fingerprints(expected, torch.float32))
    assert info.value.tensor == tensor


def test_a_bf16_engine_generates_like_the_built_in_one_and_its_syncs_are_checked(model_dir):
    """rollout.dtype=bfloat16 under an fp32 trainer: vLLM's greedy tokens are the built-in engine's on the same
    bf16 weights; the check compares with the trainer's weights cast to bf16, so a correct sync passes and a
    stale packed matrix (the kernel-computed fingerprint, looser in bf16) is named."""
    engine = VllmRollout(model_dir, SamplingParams(max_new_tokens=NEW_TOKENS), TOKENIZER.eos_token_id,
                         TOKENIZER.pad_token_id, VllmSettings(dtype=torch.bfloat16, max_model_len=8 + NEW_TOKENS))
    model = load_causal_lm(model_dir)
    expected = perturbed(model)
    stats = engine.update_weights(expected.items())
    assert stats["copied_bytes"] == sum(t.numel() * 2 for t in expected.values())  # cast to bf16 on the way
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    ours, theirs = built_in(model.to(torch.bfloat16).eval(), params), generated(engine, params)
    assert torch.equal(theirs["responses"], ours["responses"])
    torch.testing.assert_close(theirs["rollout_log_probs"], ours["rollout_log_probs"], rtol=0, atol=2e-2)
    stale = "model.layers.0.mlp.down_proj.weight"
    state = dict(expected, **{stale: load_causal_lm(model_dir).state_dict()[stale]})
    # cast as the sync casts: on an AMX CPU vLLM holds a bf16 engine's biases in float32, unrounded
    state = {name: tensor.to(torch.bfloat16) for name, tensor in state.items()}
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
    with pytest.raises(WeightSyncError, match="fingerprints differ") as info:
        engine.check_weights(fingerprints(expected, torch.bfloat16))
    assert info.value.tensor == stale


def test_bench_rollouts_vllm_row_times_the_same_work_and_agrees_with_the_built_in_greedy_tokens(model_dir, model):
    """``bench rollout``'s vLLM row (``--quick`` leaves it out; tests/test_bench_cli.py runs the rest of that bench)."""
    from hybridflow_lab.bench.rollout import vllm_row

    batch, params = prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=0)
    greedy = built_in(model, dataclasses.replace(params, greedy=True))["responses"]
    row = vllm_row(model_dir, batch["input_ids"], batch["attention_mask"], params, greedy, TOKENIZER.pad_token_id,
                   repeats=1)
    assert row["greedy_match"] == 1.0 and row["tok_s"] > 0 and row["init_s"] > 0


# ---------------------------------------------------------------- settings vLLM cannot run, refused before start
def vllm_overrides(model_dir: str, *extra: str) -> list[str]:
    return [f"actor.model_path={model_dir}", "rollout.engine=vllm", *extra]


def test_a_model_vllm_cannot_load_is_refused_before_start(tmp_path):
    path = create_model_dir(tmp_path / "m", "tiny", "qwen2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForTinyToyLM"]}))
    with pytest.raises(ConfigError, match="vLLM cannot load Qwen2ForTinyToyLM") as info:
        check_config(load_config(LabConfig, overrides=vllm_overrides(str(path))))
    assert info.value.key == "actor.model_path"


@pytest.mark.parametrize(("extra", "key", "message"), [
    (("rollout.kv_cache_gib=4096",), "rollout.kv_cache_gib", r"2 vLLM engines x 4096 GiB of KV cache is more than 50% "
                                                             r"of the .* GiB this machine has free; use at most"),
    (("actor.ranks=4", "critic.ranks=4", "rollout.tensor_parallel=2"), "rollout.tensor_parallel",
     r"one engine tensor-parallel over all 4 actor ranks \(4\); 2 would need vLLM's data parallel"),
])
def test_vllm_settings_this_machine_cannot_run_fail_before_start(model_dir, extra, key, message):
    config = load_config(LabConfig, overrides=vllm_overrides(model_dir, "actor.ranks=2", *extra))
    with pytest.raises(ConfigError, match=message) as info:
        check_config(config)
    assert info.value.key == key


# ---------------------------------------------------------------- a real pretrained model, its chat template, LoRA
@pytest.mark.slow
def test_vllm_on_the_real_model_generates_like_the_built_in_engine_and_syncs_merged_lora_weights(tmp_path):
    """SmolLM2-135M-Instruct from its package, prompted through its chat template: vLLM's greedy tokens are the
    built-in engine's, and after LoRA updates the merged weights reach vLLM, every tensor's fingerprint checked."""
    from hybridflow_lab.models.gguf_import import import_gguf, packaged_model_file
    from hybridflow_lab.trainer.lab import Lab

    path = import_gguf(packaged_model_file("smollm2"), tmp_path / "smollm2").path
    lab = Lab(overrides=(
        "backend=local", f"actor.model_path={path}", "actor.ranks=1", "actor.engine.backend=torch", "actor.lora.rank=8",
        "actor.optim.lr=2e-2", "rollout.engine=vllm", "task.name=word_problems", "task.few_shot=1", "task.eval_size=4",
        "rollout.max_prompt_tokens=192", "rollout.max_new_tokens=12", "batch.rollout_batch_prompts=2",
        "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=8", "batch.micro_batch_sequences_per_rank=8",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress=false"))
    try:
        prompts = lab.next_prompts(3)
        ours = TorchRollout(load_causal_lm(path).eval(), SamplingParams(max_new_tokens=12, greedy=True),
                            lab.tokenizer.eos_token_id, lab.tokenizer.pad_token_id).generate(
                                prompts["input_ids"], prompts["attention_mask"])
        theirs = lab.generate(prompts, greedy=True, n=1)
        assert torch.equal(theirs["responses"][:, :8], ours["responses"][:, :8])  # fp32 both, same argmax
        assert not any("<|im_" in text for text in theirs["response_text"])
        for _ in range(2):
            batch = lab.reward(lab.generate(lab.next_prompts()))
            batch["advantages"] = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None] * batch["response_mask"]
            lab.update_actor(batch)
        after = lab.generate(prompts, greedy=True, n=1)  # syncs, and checks, the merged weights
        (actor,) = lab.actor._backend.hosts[0].roles.values()  # the local backend's actor: the trained LoRA model
        trained = TorchRollout(actor.engine.model.eval(), SamplingParams(max_new_tokens=12, greedy=True),
                               lab.tokenizer.eos_token_id, lab.tokenizer.pad_token_id).generate(
                                   prompts["input_ids"], prompts["attention_mask"])
        assert not torch.equal(after["responses"], theirs["responses"])  # the updates changed the policy
        assert torch.equal(after["responses"][:, :8], trained["responses"][:, :8])  # and vLLM generates with it
        syncs = [s for s in lab.telemetry.spans() if s.name == "weight_sync"]
        plain = len(load_causal_lm(path).state_dict())
        assert syncs and all(s.attrs["tensors"] == plain for s in syncs)  # merged: no lora_A/lora_B tensor sent
    finally:
        lab.shutdown()


# ---------------------------------------------------------------- the other families, on either path
@pytest.fixture(scope="module", params=["qwen3", "mistral", "gemma3_text", "phi3", "qwen3_moe"])
def family(request, tmp_path_factory):
    """A tiny random model of another family (Qwen3 and Mistral on the project's decoder, the rest on the
    transformers path), and a vLLM engine on its directory."""
    path = str(create_model_dir(tmp_path_factory.mktemp(request.param) / "m", "tiny", request.param, seed=3))
    engine = VllmRollout(path, SamplingParams(max_new_tokens=NEW_TOKENS), TOKENIZER.eos_token_id,
                         TOKENIZER.pad_token_id, VllmSettings(dtype=torch.float32, max_model_len=8 + NEW_TOKENS))
    yield path, engine
    del engine.llm  # one engine's KV cache at a time


def test_vllm_samples_each_family_with_the_trainers_log_probs(family):
    path, engine = family
    model = load_causal_lm(path).eval()
    out = DataBatch(generated(engine, SamplingParams(max_new_tokens=NEW_TOKENS, n=2, seed=1)))
    mask = out["response_mask"].bool()
    trainer, _ = response_log_probs(model, out, 1.0)
    torch.testing.assert_close(out["rollout_log_probs"][mask], trainer[mask], rtol=0, atol=1e-4)


def test_a_familys_update_reaches_vllm_in_the_checkpoints_layout_and_is_checked(family):
    """Qwen3's head norms, Phi-3's fused qkv and gate_up, Gemma's norms, Qwen3-MoE's experts (fused in the trainer,
    one tensor each in the checkpoint, stacked again in vLLM): every tensor is checked, and the engine generates
    with the update."""
    path, engine = family
    model = load_causal_lm(path).eval()
    new = perturbed(model)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    stats = engine.update_weights(checkpoint_weights(model, new.items()))
    with safe_open(f"{path}/model.safetensors", "pt") as saved:
        assert stats["tensors"] == len(saved.keys())  # vLLM got the checkpoint's tensors, one per expert
    assert torch.equal(generated(engine, params)["responses"], built_in(model, params)["responses"])
