"""Remove padding (sequence packing): the packed forward and backward give the padded pass's numbers."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.algorithms.losses import ppo_policy_loss
from hybridflow_lab.config import LabConfig, OptimConfig
from hybridflow_lab.engines.forward import response_log_probs, response_packing, response_values
from hybridflow_lab.engines.torch_engine import TorchEngine
from hybridflow_lab.engines.torch_rollout import sequences_batch
from hybridflow_lab.models import create_model_dir, load_causal_lm
from hybridflow_lab.models.decoder import enable_gradient_checkpointing
from hybridflow_lab.models.heads import load_scalar_model
from hybridflow_lab.models.packing import Packing
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.workers.actor import policy_gradients

PROMPT_LENGTHS = [7, 3, 5, 1, 7, 2]
RESPONSE_LENGTHS = [9, 1, 4, 9, 6, 2]
LONG_RESPONSE_LENGTHS = [90, 1, 40, 100, 70, 2]  # rows of 97, 4, 45, 101, 77 and 4 tokens: two attention groups


def ragged_batch(vocab: int, seed: int = 0, response_lengths: list[int] = RESPONSE_LENGTHS) -> DataBatch:
    """Left-padded prompts and right-padded responses of different lengths, in the rollout's layout."""
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = torch.tensor(PROMPT_LENGTHS), torch.tensor(response_lengths)
    prompt_mask = (torch.arange(max(PROMPT_LENGTHS))[None] >= max(PROMPT_LENGTHS) - prompts[:, None]).long()
    response_mask = (torch.arange(max(response_lengths))[None] < responses[:, None]).long()
    out = {"prompt_ids": torch.randint(4, vocab, prompt_mask.shape, generator=generator) * prompt_mask,
           "prompt_mask": prompt_mask, "response_mask": response_mask,
           "responses": torch.randint(4, vocab, response_mask.shape, generator=generator) * response_mask,
           "log_probs": torch.zeros(response_mask.shape)}
    rows = len(PROMPT_LENGTHS)
    return DataBatch({**sequences_batch(out, pad_token_id=0), "advantages": torch.randn(rows, 1, generator=generator)
                      .expand_as(response_mask).contiguous(), "ref_log_probs": -torch.rand(response_mask.shape)})


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_same_gradients(padded: dict[str, torch.Tensor], packed: dict[str, torch.Tensor]) -> None:
    """Equal to float32 rounding: summation order differs, so an element is compared at its tensor's scale."""
    assert padded.keys() == packed.keys()
    for name, grad in padded.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((packed[name] - grad).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("response_lengths", [RESPONSE_LENGTHS, LONG_RESPONSE_LENGTHS], ids=["short", "long"])
def test_packed_log_probs_and_entropies_equal_the_padded_pass_and_are_zero_on_padding(tmp_path, arch,
                                                                                      response_lengths):
    model = load_causal_lm(create_model_dir(tmp_path / "m", "tiny", arch, seed=1))
    batch = ragged_batch(model.config.vocab_size, response_lengths=response_lengths)
    assert len(response_packing(batch).groups) == (1 if response_lengths == RESPONSE_LENGTHS else 2)
    mask = batch["response_mask"]
    with torch.no_grad():
        padded = response_log_probs(model, batch, 0.7, with_entropy=True)
        packed = response_log_probs(model, batch, 0.7, with_entropy=True, remove_padding=True)
    for ours, theirs in zip(packed, padded, strict=True):
        torch.testing.assert_close(ours, theirs * mask, rtol=1e-5, atol=1e-5)
        assert bool((ours[mask == 0] == 0).all())


@pytest.mark.parametrize(("checkpointing", "response_lengths"),
                         [(False, RESPONSE_LENGTHS), (True, RESPONSE_LENGTHS), (False, LONG_RESPONSE_LENGTHS)],
                         ids=["short", "short-checkpointing", "long"])
def test_packed_actor_loss_and_gradients_equal_the_padded_pass(tmp_path, checkpointing, response_lengths):
    """The actor's whole token loss (clipped policy loss, entropy, KL to the reference) aggregated as the update
    does: the same loss and the same gradient for every parameter."""
    path = create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=2)
    model = load_causal_lm(path)
    if checkpointing:
        enable_gradient_checkpointing(model)
    batch = ragged_batch(model.config.vocab_size, seed=3, response_lengths=response_lengths)
    results = {}
    for remove_padding in (False, True):
        config = LabConfig()
        config.actor.engine.remove_padding = remove_padding
        config.algorithm.entropy_coef = 0.01
        metrics, _ = policy_gradients(TorchEngine(model, OptimConfig()), [batch], config, ppo_policy_loss, kl_coef=0.1)
        results[remove_padding] = (metrics.sums["loss"], gradients(model))
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    assert_same_gradients(results[False][1], results[True][1])


def test_packed_critic_values_and_gradients_equal_the_padded_pass(tmp_path):
    critic = load_scalar_model(create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=4))
    torch.nn.init.normal_(critic.score.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    batch = ragged_batch(critic.config.vocab_size, seed=5)
    mask = batch["response_mask"]
    results = {}
    for remove_padding in (False, True):
        values = response_values(critic, batch, remove_padding) * mask
        (values**2).sum().backward()
        results[remove_padding] = (values.detach(), gradients(critic))
    assert bool((results[False][0] != 0).any())
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    assert_same_gradients(results[False][1], results[True][1])


def test_packed_rows_attend_only_to_their_own_sequence_and_positions_restart(tmp_path):
    """Each packed row's log-probs equal that row run alone without padding (positions from 0), and changing
    another row's tokens changes nothing in it."""
    model = load_causal_lm(create_model_dir(tmp_path / "m", "tiny", "qwen2", seed=6))
    batch = ragged_batch(model.config.vocab_size, seed=7)
    with torch.no_grad():
        packed, _ = response_log_probs(model, batch, remove_padding=True)
        for row, (prompt, response) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
            real = batch["input_ids"][row][batch["attention_mask"][row].bool()]
            alone = model(real[None]).log_softmax(-1)[0, prompt - 1 : prompt + response - 1]
            expected = alone.gather(-1, batch["responses"][row, :response, None]).squeeze(-1)
            torch.testing.assert_close(packed[row, :response], expected, rtol=1e-5, atol=1e-5)
        changed = batch["input_ids"].clone()
        changed[0] = torch.where(batch["attention_mask"][0].bool(), (changed[0] + 1) % model.config.vocab_size, 0)
        again, _ = response_log_probs(model, DataBatch({**batch.tensors, "input_ids": changed}), remove_padding=True)
    assert not torch.equal(again[0], packed[0])
    torch.testing.assert_close(again[1:], packed[1:], rtol=0, atol=0)


def test_packing_refuses_an_output_at_a_padding_position():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="padding"):
        Packing.of(mask, outputs=torch.tensor([[True, False, False], [False, False, True]]))
    packing = Packing.of(mask, outputs=torch.tensor([[False, False, True], [True, False, True]]))
    assert packing.tokens == 5 and packing.outputs.tolist() == [1, 2, 4]


def test_rows_of_very_different_lengths_are_laid_out_for_attention_in_separate_groups():
    """A 20-token row is not padded to a 160-token row's length: rows attend in groups of similar length, and
    rows shorter than 64 tokens share one group (their attention costs less than another call)."""
    lengths = torch.tensor([160, 140, 130, 90, 80, 40, 20])
    packing = Packing.of((torch.arange(160)[None] < lengths[:, None]).long())
    assert [(g.rows, g.longest) for g in packing.groups] == [(3, 160), (2, 90), (2, 40)]
    assert sum(g.members.numel() for g in packing.groups) == packing.tokens == int(lengths.sum())
