"""The built-in generation engine: matches transformers, reports honest log-probs, stops correctly."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow_lab import DataBatch
from hybridflow_lab.engines import SamplingParams
from hybridflow_lab.engines.forward import response_log_probs, response_logits
from hybridflow_lab.engines.torch_rollout import TorchRollout, generate
from hybridflow_lab.models import char_tokenizer, create_model_dir, load_causal_lm
from hybridflow_lab.models.decode_step import missing_cpp_compiler
from hybridflow_lab.models.onednn_decode import missing_onednn

TOKENIZER = char_tokenizer()
PROMPTS = ["1+1=", "23+4=", "100+250=", "7+8="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_model_dir(tmp_path_factory.mktemp("rollout") / "m", "tiny", "qwen2", seed=7)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_causal_lm(model_dir).eval()


def encode(prompts=PROMPTS):
    batch = TOKENIZER(prompts, padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def run(model, params, prompts=PROMPTS):
    ids, mask = encode(prompts)
    return generate(model, ids, mask, params, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id)


def test_greedy_equals_transformers_generate(model_dir, model):
    ids, mask = encode()
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                   do_sample=False, pad_token_id=TOKENIZER.pad_token_id)[:, ids.shape[1]:]
    out = run(model, SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True))
    assert torch.equal(out["responses"], expected)


def test_log_probs_equal_a_teacher_forced_forward(model):
    params = SamplingParams(max_new_tokens=10, temperature=0.7, seed=3, ignore_eos=True)
    rollout = TorchRollout(model, params, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id)
    batch = DataBatch(rollout.generate(*encode()))
    with torch.no_grad():
        forward, _ = response_log_probs(model, batch, temperature=0.7)
    torch.testing.assert_close(batch["rollout_log_probs"], forward, rtol=1e-5, atol=1e-5)


def test_samples_per_prompt_seeds_and_shapes(model):
    params = SamplingParams(max_new_tokens=8, n=3, seed=11)
    first, again = run(model, params), run(model, params)
    assert first["responses"].shape == (12, 8) and torch.equal(first["responses"], again["responses"])
    assert torch.equal(first["prompt_ids"][0], first["prompt_ids"][2])  # a prompt's samples are adjacent
    other = run(model, SamplingParams(max_new_tokens=8, n=3, seed=12))
    assert not torch.equal(first["responses"], other["responses"])


def test_samples_share_their_prompts_prefill_and_keep_honest_log_probs(model):
    params = SamplingParams(max_new_tokens=10, n=3, seed=5, temperature=0.8)
    batch = DataBatch(TorchRollout(model, params, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id).generate(*encode()))
    assert len(batch) == 12 and torch.equal(batch["prompts"][::3], encode()[0])
    with torch.no_grad():
        forward, _ = response_log_probs(model, batch, temperature=0.8)
    assert not batch["response_mask"].all()  # some samples stopped early: rows leave the shared cache too
    torch.testing.assert_close(batch["rollout_log_probs"], forward * batch["response_mask"], rtol=1e-5, atol=1e-5)
    shared = run(model, SamplingParams(max_new_tokens=8, n=2, greedy=True, ignore_eos=True))["responses"]
    alone = run(model, SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True))["responses"]
    assert torch.equal(shared[::2], alone) and torch.equal(shared[1::2], alone)


@pytest.mark.skipif(bool(missing_cpp_compiler()), reason=str(missing_cpp_compiler()))
@pytest.mark.parametrize("decoding", ["compiled", pytest.param("onednn", marks=pytest.mark.skipif(
    bool(missing_onednn()), reason=str(missing_onednn())))])
def test_a_fast_decoding_step_samples_from_the_models_own_distribution(model, decoding):
    """Compiled, a step attends over every cache slot under a mask; over oneDNN's packed weights, with its own
    attention loops over the written slots. Either way its log-probs are the teacher-forced forward's, through left
    padding, a shared prefill and rows leaving the batch (for the compiled step, a recompile for the new size)."""
    params = SamplingParams(max_new_tokens=10, n=3, seed=5, temperature=0.8)
    rollout = TorchRollout(model, params, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id, decoding=decoding)
    batch = DataBatch(rollout.generate(*encode()))
    assert not batch["response_mask"].all()  # some rows stopped and left the batch
    with torch.no_grad():
        forward, _ = response_log_probs(model, batch, temperature=0.8)
    torch.testing.assert_close(batch["rollout_log_probs"], forward * batch["response_mask"], rtol=1e-5, atol=1e-5)
    eager = TorchRollout(model, params, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id).generate(*encode())
    # the same uniform draws pick the same tokens unless a draw lands within float rounding of a boundary
    assert (batch["responses"] == eager["responses"]).float().mean() > 0.9


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = run(model, SamplingParams(max_new_tokens=6, greedy=True, ignore_eos=True))["responses"]
    for params in (SamplingParams(max_new_tokens=6, top_k=1, seed=0, ignore_eos=True),
                   SamplingParams(max_new_tokens=6, top_p=1e-6, seed=0, ignore_eos=True)):
        assert torch.equal(run(model, params)["responses"], greedy)


def test_stopping_masks_the_rest_and_leaves_other_rows_alone(model):
    free = run(model, SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True))["responses"]
    stop = int(free[0, 2])  # the token row 0 produces third
    out = run(model, SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True, stop_token_ids=(stop,)))
    for row in range(len(PROMPTS)):
        hits = (free[row] == stop).nonzero()
        length = int(hits[0]) + 1 if len(hits) else 10
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (10 - length)
        assert torch.equal(out["responses"][row, :length], free[row, :length])
        assert (out["responses"][row, length:] == TOKENIZER.pad_token_id).all()
        assert (out["log_probs"][row, length:] == 0).all()


def test_forced_lengths_end_each_row_with_eos_at_its_scheduled_length(model):
    """Row i stops after forced_lengths[i % len] tokens, the last one EOS and no EOS before, whatever it samples."""
    params = SamplingParams(max_new_tokens=9, n=3, seed=2, forced_lengths=(9, 1, 4))
    out = run(model, params)
    lengths = out["response_mask"].sum(1).tolist()
    assert lengths == [9, 1, 4] * len(PROMPTS)
    for row, length in enumerate(lengths):
        eos = (out["responses"][row] == TOKENIZER.eos_token_id).nonzero().squeeze(-1).tolist()
        assert eos == [length - 1]
    with pytest.raises(ValueError, match="ignore_eos=False"):
        SamplingParams(forced_lengths=(3,), ignore_eos=True)
    with pytest.raises(ValueError, match=r"forced_lengths must each be in \[1, max_new_tokens\]"):
        SamplingParams(max_new_tokens=4, forced_lengths=(5,))


def test_bad_sampling_parameters_are_named():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        SamplingParams(temperature=0)


def test_rollout_log_probs_are_those_of_the_truncated_distribution_tokens_were_drawn_from(model):
    params = SamplingParams(max_new_tokens=8, top_k=3, seed=5, ignore_eos=True)
    batch = DataBatch(TorchRollout(model, params, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id).generate(*encode()))
    with torch.no_grad():
        logits = response_logits(model, batch).float()
    top3 = logits.masked_fill(logits < logits.topk(3, dim=-1).values[..., -1:], float("-inf"))
    truncated = top3.log_softmax(-1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    torch.testing.assert_close(batch["rollout_log_probs"], truncated, rtol=1e-5, atol=1e-5)
    full, _ = response_log_probs(model, batch)
    assert (batch["rollout_log_probs"] > full).all()  # the renormalised top 3 give every drawn token more mass
    greedy_like = SamplingParams(max_new_tokens=8, top_k=1, seed=5, ignore_eos=True)
    assert (run(model, greedy_like)["log_probs"] == 0).all()  # a single candidate is drawn with probability 1


def test_log_probs_and_entropies_are_computed_a_chunk_of_positions_at_a_time(monkeypatch):
    """A 150k vocabulary's float32 scores for every position would not fit beside bf16 logits: the maths runs
    over chunks of positions and gives what one pass over all of them gives."""
    from hybridflow_lab.engines import sampling

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g).bfloat16()
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    scaled = logits.float() / 0.7
    expected = scaled.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    whole_entropy = -(scaled.log_softmax(-1).exp() * scaled.log_softmax(-1)).sum(-1)
    monkeypatch.setattr(sampling, "POSITIONS_PER_CHUNK", 4)  # 21 positions: 6 chunks, the last one short
    torch.testing.assert_close(sampling.log_probs_from_logits(logits, tokens, 0.7), expected, rtol=1e-5, atol=1e-5)
    assert sampling.log_probs_from_logits(logits, tokens, 0.7).dtype == torch.float32
    joint = sampling.log_probs_and_entropy(logits, tokens, 0.7)
    torch.testing.assert_close(joint, (expected, whole_entropy), rtol=1e-5, atol=1e-5)


def test_the_entropy_is_a_detached_metric_unless_a_loss_term_needs_its_gradient():
    """The update always reports the entropy, but only an entropy bonus needs autograd's graph for it; without one
    autograd saves none of its ``[positions, vocab]`` intermediates."""
    from hybridflow_lab.engines import sampling

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 40, generator=g, requires_grad=True)
    tokens = torch.randint(0, 40, (5,), generator=g)
    log_probs, metric = sampling.log_probs_and_entropy(logits, tokens, entropy_grad=False)
    assert log_probs.requires_grad and not metric.requires_grad
    log_p = logits.detach().log_softmax(-1)
    torch.testing.assert_close(metric, -(log_p.exp() * log_p).sum(-1))

    log_probs, entropy = sampling.log_probs_and_entropy(logits, tokens, entropy_grad=True)
    (log_probs.sum() - 0.1 * entropy.sum()).backward()
    expected = logits.detach().clone().requires_grad_(True)
    scores = expected.log_softmax(-1)
    (scores.gather(-1, tokens[:, None]).sum() + 0.1 * (scores.exp() * scores).sum()).backward()
    torch.testing.assert_close(logits.grad, expected.grad)


def test_a_generation_copy_takes_a_weight_stream_tensor_by_tensor_and_names_what_is_missing(model_dir):
    from hybridflow_lab.hybrid.engine import state_dict_sink

    source = load_causal_lm(model_dir)
    copy = load_causal_lm(  # other weights to start from
        create_model_dir(model_dir.parent / "other", "tiny", "qwen2", seed=8))
    sink = state_dict_sink(copy)
    stats = sink((name, tensor.bfloat16()) for name, tensor in source.state_dict().items())  # cast on the way
    assert stats["tensors"] == len(source.state_dict())
    for name, tensor in copy.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, source.state_dict()[name].bfloat16().float())
    weights = list(source.state_dict().items())
    with pytest.raises(KeyError, match=rf"did not send 1 tensor.*{re.escape(weights[-1][0])}"):
        sink(weights[:-1])
    with pytest.raises(KeyError, match=r"'lm_head\.bias', which the generation model does not have"):
        sink([("lm_head.bias", torch.zeros(3))])
