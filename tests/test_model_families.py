"""Any Hugging Face causal LM: which path runs each family, and the transformers path behind the decoder's interface
(logits, packed passes, generation over its own cache, saved directories, scalar heads)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from hybridflow_lab.engines.forward import response_log_probs
from hybridflow_lab.engines.sampling import SamplingParams
from hybridflow_lab.engines.torch_rollout import generate, sequences_batch
from hybridflow_lab.models import build_model, char_tokenizer, load_causal_lm, save_model_dir, tiny_config
from hybridflow_lab.models.decoder import DecoderLM
from hybridflow_lab.models.families import model_impl
from hybridflow_lab.models.heads import last_token_scores, load_scalar_model
from hybridflow_lab.models.routing import RouteLog, routing_mismatch, scored_routes
from hybridflow_lab.models.transformers_lm import TransformersLM, TransformersScalarModel
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.trainer.lab import Lab
from tests.test_lab import assert_resume_takes_the_same_next_step, local_overrides

TRANSFORMERS_FAMILIES = ["gemma3_text", "phi3", "qwen3_moe"]


@pytest.fixture(scope="module", params=TRANSFORMERS_FAMILIES)
def family_dir(request, tmp_path_factory):
    """A tiny random model of each family the project's decoder does not run, saved as an HF directory."""
    tokenizer = char_tokenizer()
    model = build_model(tiny_config("tiny", request.param, tokenizer), seed=2)
    return save_model_dir(model, tmp_path_factory.mktemp(request.param) / "m", tokenizer)


def padded_batch(length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, 90, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    return ids, mask


def test_each_family_takes_the_decoder_that_runs_it_and_a_forced_path_says_why_it_cannot():
    tokenizer = char_tokenizer()
    paths = {arch: model_impl(tiny_config("tiny", arch, tokenizer))
             for arch in ("qwen2", "llama", "qwen3", "mistral", *TRANSFORMERS_FAMILIES)}
    assert paths == {"qwen2": "native", "llama": "native", "qwen3": "native", "mistral": "native",
                     "gemma3_text": "transformers", "phi3": "transformers", "qwen3_moe": "transformers"}
    assert model_impl(tiny_config("tiny", "qwen3", tokenizer), "transformers") == "transformers"
    with pytest.raises(ValueError, match=r"model_type 'phi3' is not one the project's decoder runs .*; the "
                                         r"transformers path runs it \(model_impl=transformers, or auto\)"):
        model_impl(tiny_config("tiny", "phi3", tokenizer), "native")
    with pytest.raises(ValueError, match=r"model_type 't5' is neither a family the project's decoder runs"):
        model_impl(AutoConfig.for_model("t5"))


def test_the_transformers_path_gives_transformers_logits_and_keeps_the_checkpoints_names(family_dir):
    ours = load_causal_lm(family_dir).eval()
    theirs = AutoModelForCausalLM.from_pretrained(family_dir, local_files_only=True, dtype=torch.float32).eval()
    assert isinstance(ours, TransformersLM)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ids, mask = padded_batch()
    with torch.no_grad():
        mine = ours(ids, mask)
        hf = theirs(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(mine[mask.bool()], hf[mask.bool()], rtol=1e-5, atol=1e-5)


def test_generation_over_transformers_cache_gives_the_full_passs_greedy_tokens_and_log_probs(family_dir):
    model = load_causal_lm(family_dir).eval()
    ids, mask = padded_batch(length=6)
    mask[1] = 1  # prompts are left-padded only
    eos = int(ids[2, 0])  # a token some rows are likely to produce: rows leave the batch as they finish
    params = SamplingParams(n=2, greedy=True, max_new_tokens=7)
    out = generate(model, ids, mask, params, eos_token_id=eos, pad_token_id=0)
    batch = DataBatch(sequences_batch(out, pad_token_id=0))
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        padded, _ = response_log_probs(model, batch)
        packed, _ = response_log_probs(model, batch, remove_padding=True)
    predicted = logits[:, ids.shape[1] - 1:-1].argmax(-1)
    response_mask = batch["response_mask"].bool()
    assert torch.equal(predicted[response_mask], batch["responses"][response_mask])
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, batch["rollout_log_probs"], rtol=1e-4, atol=1e-4)


def test_the_routing_mismatch_is_zero_where_both_engines_route_alike_and_counts_every_token_that_moved(tiny_models):
    """The built-in engine records the experts behind each response token; the trainer's pass over the same tokens
    compares. Swapping layer 0's experts (its router's rows rolled by one) moves every token's top-2 of 4."""
    model = load_causal_lm(tiny_models(2, arch="qwen3_moe")).eval()
    ids, mask = padded_batch(length=6)
    mask[1] = 1
    out = generate(model, ids, mask, SamplingParams(n=2, greedy=True, max_new_tokens=7), int(ids[2, 0]), 0)
    batch = DataBatch(sequences_batch(out, pad_token_id=0))
    response = batch["response_mask"].bool()
    assert batch["routed_experts"].shape == (6, 7, 4, 2)  # rows, tokens, MoE layers, experts a token
    assert bool((batch["routed_experts"][response] >= 0).all()) and bool((batch["routed_experts"][~response] < 0).all())

    def mismatch() -> torch.Tensor:
        with torch.no_grad(), RouteLog(model) as routes:
            model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        return routing_mismatch(scored_routes(routes.passes()[0], len(batch), response.shape[1]),
                                batch["routed_experts"])[response]

    assert float(mismatch().sum()) == 0
    with torch.no_grad():
        router = model.model.layers[0].mlp.gate.weight
        router.copy_(router.roll(1, dims=0))
    assert float(mismatch().mean()) == 1.0


def test_a_directory_saved_from_the_transformers_path_loads_in_transformers(family_dir, tmp_path):
    model = load_causal_lm(family_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)  # a trained model differs from the one loaded
    saved = save_model_dir(model, tmp_path / "saved", char_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(saved, local_files_only=True, dtype=torch.float32).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids, mask)[mask.bool()],
                                   reloaded(input_ids=ids, attention_mask=mask,
                                            position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[mask.bool()])


def test_a_sequence_classifier_directory_scores_as_transformers_does_and_a_causal_lm_makes_a_zero_critic(
        family_dir, tmp_path):
    config = AutoConfig.from_pretrained(family_dir)
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(3)
    classifier = AutoModelForSequenceClassification.from_config(config).eval()
    classifier.save_pretrained(tmp_path / "rm")
    reward = load_scalar_model(tmp_path / "rm", trained_head=True).eval()
    assert isinstance(reward, TransformersScalarModel)
    ids, mask = padded_batch()
    ids, mask = ids[[0, 2]], mask[[0, 2]]  # left padding only: transformers pools the last non-pad token
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        expected = classifier(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        scores = last_token_scores(reward(ids, mask), mask)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    critic = load_scalar_model(family_dir)
    assert isinstance(critic, TransformersScalarModel) and not bool(critic.score.weight.any())
    with pytest.raises(ValueError, match="has no scalar head"):
        load_scalar_model(family_dir, trained_head=True)


def test_the_native_families_stay_on_the_projects_decoder_unless_forced(tmp_path):
    tokenizer = char_tokenizer()
    path = save_model_dir(build_model(tiny_config("tiny", "qwen3", tokenizer), seed=1), tmp_path / "q3", tokenizer)
    assert isinstance(load_causal_lm(path), DecoderLM)
    forced = load_causal_lm(path, impl="transformers").eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(forced(ids, mask)[mask.bool()], load_causal_lm(path).eval()(ids, mask)[mask.bool()],
                                   rtol=1e-5, atol=1e-5)


ENGINE_OF = {"gemma3_text": ("deepspeed", "actor.engine.zero_stage=2"), "phi3": ("fsdp",),
             "qwen3_moe": ("torch", "actor.engine.gradient_checkpointing=true")}


@pytest.mark.ray
@pytest.mark.slow
def test_ppo_on_two_ray_ranks_trains_a_transformers_family_with_its_critic(ray_cluster, family_dir, tmp_path):
    """Each family with another engine (ZeRO-2, FSDP2, DDP with activation checkpointing): the reference is the
    actor before its first update, generation over transformers' cache gives the trainer's log-probs, the critic
    (the family's backbone under a value head) trains."""
    family = AutoConfig.from_pretrained(family_dir).model_type
    backend, *engine = ENGINE_OF[family]
    lab = Lab("arithmetic_grpo", overrides=(
        f"actor.model_path={family_dir}", "algorithm.name=ppo", "actor.ranks=2", "critic.ranks=2",
        f"actor.engine.backend={backend}", f"critic.engine.backend={backend}", *engine, "actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3", "algorithm.kl_loss_coef=0.05", "algorithm.entropy_coef=0.01",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress=false", "batch.rollout_batch_prompts=4",
        "batch.samples_per_prompt=4", "batch.update_minibatch_sequences=16", "batch.micro_batch_sequences_per_rank=4",
        "task.eval_size=8", "rollout.max_new_tokens=5"))
    try:
        assert f"model: {family} on transformers" in repr(lab)
        first, second = lab.run(2)
        assert first["actor/kl"] == pytest.approx(0, abs=1e-6)  # one optimizer step a step: measured before it
        assert second["actor/kl"] != 0  # the policy moved away from the reference (the entropy bonus moves it)
        assert first["actor/rollout_mismatch"] < 1e-4 and second["actor/rollout_mismatch"] < 1e-4
        if family == "qwen3_moe":  # float32 on both sides: the same experts behind every token
            assert first["actor/routing_mismatch"] == 0 and second["actor/routing_mismatch"] == 0
        assert all(math.isfinite(m[key]) for m in (first, second) for key in ("actor/pg_loss", "critic/vf_loss"))
    finally:
        lab.shutdown()


def test_grpo_on_a_transformers_family_resumes_to_the_same_next_step(family_dir, tmp_path):
    """The checkpoint holds what the family's next step needs (the saved weights in the checkpoint's layout, for
    Qwen3-MoE one tensor per expert): a resumed run takes the step the straight run took."""
    assert_resume_takes_the_same_next_step(local_overrides(family_dir, tmp_path / "a"))
