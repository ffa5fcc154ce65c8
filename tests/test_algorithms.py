"""Unit tests for hybridflow_lab.algorithms against hand-computed values."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridflow_lab.algorithms as alg
from hybridflow_lab.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    LagrangeMultiplier,
    aggregate,
    apply_kl_penalty,
    cispo_policy_loss,
    clipped_value_loss,
    combined_advantages,
    gae,
    get_advantage_estimator,
    get_policy_loss,
    group_centered,
    grpo,
    gspo_policy_loss,
    informative_groups,
    kl_estimate,
    kl_kind,
    masked_whiten,
    overlong_penalty,
    ppo_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
    rollout_correction,
)
from hybridflow_lab.algorithms.losses import loss_units


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-6)


def valid_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std over valid entries, by a plain loop."""
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten(), strict=True) if m]
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


# ---------------------------------------------------------------- GAE

GAE_MASK = t([[1, 1, 1], [1, 1, 0]])
# Row 1's padding holds garbage that must not leak into valid tokens.
GAE_REWARDS = t([[0, 0, 1], [0, 2, 9]])
GAE_VALUES = t([[1, 2, 3], [1, 1, 7]])
# gamma = lam = 0.5, so gamma * lam = 0.25. Row 0, backwards:
#   t2: delta = 1 + 0.5*0 - 3 = -2            A = -2
#   t1: delta = 0 + 0.5*3 - 2 = -0.5          A = -0.5 + 0.25*(-2) = -1
#   t0: delta = 0 + 0.5*2 - 1 = 0             A = 0 + 0.25*(-1) = -0.25
# Row 1 (last valid token t1 bootstraps with 0):
#   t1: delta = 2 + 0 - 1 = 1                  A = 1
#   t0: delta = 0 + 0.5*1 - 1 = -0.5           A = -0.5 + 0.25*1 = -0.25
GAE_ADV = [[-0.25, -1.0, -2.0], [-0.25, 1.0, 0.0]]
GAE_RET = [[0.75, 1.0, 1.0], [0.75, 2.0, 0.0]]


def test_gae_returns_and_raw_advantages_by_hand():
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5, whiten=False)
    close(adv, GAE_ADV)
    close(ret, GAE_RET)


def test_gae_whitening_gives_zero_mean_unit_std_over_valid_tokens():
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5)
    close(ret, GAE_RET)  # returns use the raw advantages
    # valid raw advantages -0.25, -1, -2, -0.25, 1: mean -0.5, squared deviations sum 4.875, unbiased var 4.875/4
    std = math.sqrt(4.875 / 4)
    close(adv, [[0.25 / std, -0.5 / std, -1.5 / std], [0.25 / std, 1.5 / std, 0.0]])
    mean, unbiased_std = valid_stats(adv, GAE_MASK)
    assert abs(mean) < 1e-6 and abs(unbiased_std - 1) < 1e-6


def test_gae_defaults_are_monte_carlo_returns():
    # gamma = lam = 1: the return of each valid token is the sum of the rewards from it to the end.
    _, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, whiten=False)
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


def test_masked_whiten_ignores_padding():
    out = masked_whiten(t([[1, 3, 100]]), t([[1, 1, 0]]))
    # mean 2, unbiased std sqrt(2)
    close(out, [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]])


# ---------------------------------------------------------------- group estimators

# Groups are not contiguous: group 0 = rows 0, 2, 3; group 1 = rows 1, 5; group 2 = row 4 alone.
SCORES = t([1, 3, 5, 2, 7, 4])
GROUPS = torch.tensor([0, 1, 0, 0, 2, 1])
GROUP_MASK = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])


def rows_to_tokens(per_row: list[float], mask: torch.Tensor) -> list[list[float]]:
    return [[v * float(m) for m in row] for v, row in zip(per_row, mask, strict=True)]


def test_grpo_normalises_by_unbiased_group_std():
    # group 0: mean 8/3, deviations -5/3, 7/3, -2/3, unbiased var (25 + 49 + 4)/9/2 = 13/3
    # group 1: mean 3.5, deviations -0.5, 0.5, unbiased var 0.5; group 2 has one sample -> 0
    s0, s1 = math.sqrt(13 / 3) + 1e-6, math.sqrt(0.5) + 1e-6
    expected = [-5 / 3 / s0, -0.5 / s1, 7 / 3 / s0, -2 / 3 / s0, 0.0, 0.5 / s1]
    close(grpo(SCORES, GROUPS, GROUP_MASK), rows_to_tokens(expected, GROUP_MASK))


def test_dr_grpo_only_subtracts_the_group_mean():
    expected = [-5 / 3, -0.5, 7 / 3, -2 / 3, 0.0, 0.5]
    close(grpo(SCORES, GROUPS, GROUP_MASK, norm_by_std=False), rows_to_tokens(expected, GROUP_MASK))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # row 0: 1 - (5+2)/2, row 1: 3 - 4, row 2: 5 - (1+2)/2, row 3: 2 - (1+5)/2, row 4 alone, row 5: 4 - 3
    expected = [-2.5, -1.0, 3.5, -1.0, 0.0, 1.0]
    close(rloo(SCORES, GROUPS, GROUP_MASK), rows_to_tokens(expected, GROUP_MASK))


def test_remax_subtracts_the_greedy_baseline():
    mask = t([[1, 1, 0], [1, 1, 1]])
    close(remax(t([1.0, 0.5]), t([0.25, 1.0]), mask), [[0.75, 0.75, 0.0], [-0.5, -0.5, -0.5]])


def test_reinforce_plus_plus_discounted_return_to_go_then_whitened():
    rewards = t([[0, 0, 1], [1, 0, 2]])  # row 1's last reward is padding
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: 0 + 0.5*(0 + 0.5*1) = 0.25, 0 + 0.5*1 = 0.5, 1; row 1: 1 + 0.5*0 = 1, 0
    close(ret, [[0.25, 0.5, 1.0], [1.0, 0.0, 0.0]])
    # valid returns: mean 0.55, squared deviations .09 + .0025 + .2025 + .2025 + .3025 = .8, unbiased var .2
    std = math.sqrt(0.2)
    close(adv, [[-0.3 / std, -0.05 / std, 0.45 / std], [0.45 / std, -0.55 / std, 0.0]])


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    scores = t([1, 3, 2, 6])
    groups = torch.tensor([0, 0, 1, 1])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 0]])
    # centered per row: -1, 1, -2, 2; valid tokens -1, -1, 1, -2, -2, 2: mean -0.5
    # deviations -.5, -.5, 1.5, -1.5, -1.5, 2.5: squares sum 13.5, unbiased var 13.5/5
    std = math.sqrt(13.5 / 5)
    expected = [[-0.5 / std, -0.5 / std], [1.5 / std, 0.0], [-1.5 / std, -1.5 / std], [2.5 / std, 0.0]]
    close(reinforce_plus_plus_baseline(scores, groups, mask), expected)


# ---------------------------------------------------------------- KL

KL_LOGP = t([[0.0, -1.0]])
KL_REF = t([[-1.0, 0.0]])  # log p - log q = 1, -1


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [[1.0, -1.0]]),
        ("k2", [[0.5, 0.5]]),
        # log q - log p = -1, 1: exp(-1) - (-1) - 1 = exp(-1); exp(1) - 1 - 1 = e - 2
        ("k3", [[math.exp(-1), math.e - 2]]),
        ("abs", [[1.0, 1.0]]),
    ],
)
def test_kl_estimate_kinds(kind, expected):
    close(kl_estimate(KL_LOGP, KL_REF, kind), expected)


def test_k3_is_clamped_and_unknown_kind_lists_the_kinds():
    close(kl_estimate(t([[0.0]]), t([[20.0]]), "k3"), [[10.0]])  # exp(20) - 21 would be huge
    with pytest.raises(ValueError, match="k1, k2, k3, abs"):
        kl_estimate(KL_LOGP, KL_REF, "k9")


def test_apply_kl_penalty_and_per_sequence_mean_kl():
    scores = t([[0, 0, 1], [0, 2, 0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    ref = t([[0, 0, 0], [0, 0, 0]])
    logp = t([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])  # the 9.0 is padding
    rewards, mean_kl = apply_kl_penalty(scores, logp, ref, mask, coef=0.5)
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])
    # per-sequence means 0.6/3 = 0.2 and 0.9/2 = 0.45 -> 0.325 (a token mean would give 1.5/5 = 0.3)
    assert isinstance(mean_kl, float) and mean_kl == pytest.approx(0.325)


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.3)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.3 and ctl.state_dict() == {"value": 0.3}


def test_adaptive_kl_controller_update_and_state_round_trip():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=6.6, n_steps=100)  # error 0.1 (within the clip)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.1 * 100 / 10000))
    ctl.load_state_dict({"value": 0.1})
    ctl.update(current_kl=12.0, n_steps=100)  # error 1.0 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * 1.002)
    ctl.update(current_kl=0.0, n_steps=100)  # error -1.0 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.002 * 0.998)
    restored = AdaptiveKLController(init_coef=1.0, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


# ---------------------------------------------------------------- PPO losses

# clip_low 0.2, clip_high 0.3 -> ratios clipped to [0.8, 1.3]; old log-probs are 0 so ratio = exp(log_probs).
PPO_RATIO = t([[1.5, 0.5, 0.5], [1.5, 4.0, 3.0]])
PPO_ADV = t([[1.0, 1.0, -1.0], [-1.0, -1.0, 5.0]])
PPO_MASK = t([[1, 1, 1], [1, 1, 0]])
# per token: (unclipped -A*r, clipped -A*clip(r)) -> max
#   A=1,  r=1.5: (-1.5, -1.3) -> -1.3 clipped      A=1,  r=0.5: (-0.5, -0.8) -> -0.5
#   A=-1, r=0.5: ( 0.5,  0.8) ->  0.8 clipped      A=-1, r=1.5: ( 1.5,  1.3) ->  1.5
#   A=-1, r=4:   ( 4.0,  1.3) ->  4.0              last token is padding
PPO_LOSS = [[-1.3, -0.5, 0.8], [1.5, 4.0, 0.0]]
PPO_CLIPFRAC = [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]


def ppo(dual_clip=None):
    return ppo_policy_loss(PPO_RATIO.log(), torch.zeros_like(PPO_RATIO), PPO_ADV, PPO_MASK, 0.2, 0.3, dual_clip)


def test_ppo_loss_clip_low_high_and_clipfrac():
    loss, metrics = ppo()
    close(loss, PPO_LOSS)
    close(metrics["pg_clipfrac"], PPO_CLIPFRAC)
    close(metrics["ppo_kl"], [[-math.log(1.5), math.log(2), math.log(2)], [-math.log(1.5), -math.log(4), 0.0]])


def test_ppo_dual_clip_caps_only_negative_advantages():
    loss, _ = ppo(dual_clip=3.0)
    # A=-1, r=4: min(4, 3) = 3; A=-1 tokens below 3 unchanged; A>0 tokens unchanged even with r large
    close(loss, [[-1.3, -0.5, 0.8], [1.5, 3.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo(dual_clip=1.0)


def test_ppo_loss_gradient_is_zero_on_clipped_tokens():
    log_probs = PPO_RATIO.log().requires_grad_()
    loss, _ = ppo_policy_loss(log_probs, torch.zeros_like(PPO_RATIO), PPO_ADV, PPO_MASK, 0.2, 0.3)
    loss.sum().backward()
    # d(-A*r)/d(log p) = -A*r on unclipped tokens, 0 on clipped and padding tokens
    close(log_probs.grad, [[0.0, -0.5, 0.0], [1.5, 4.0, 0.0]])


def test_clipped_value_loss():
    values = t([[1.0, 1.0, 0.5], [0.0, 5.0, 5.0]])
    old = t([[0.5, 1.2, 0.5], [1.0, 0.0, 0.0]])
    returns = t([[2.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # (v-R)^2 vs (clipped v - R)^2:
    #   v=1,  old .5,  R=2: 1 vs (0.7-2)^2 = 1.69 -> 0.845, clipped chosen
    #   v=1,  old 1.2, R=0: 1 vs (1.0-0)^2 = 1    -> 0.5
    #   v=.5, old .5,  R=0: .25 vs .25            -> 0.125
    #   v=0,  old 1,   R=.5: .25 vs (0.8-.5)^2 = .09 -> 0.125
    close(loss, [[0.845, 0.5, 0.125], [0.125, 0.0, 0.0]])
    close(metrics["vf_clipfrac"], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- aggregation

AGG_LOSS = t([[1, 2, 3, 4], [5, 6, 100, 100], [7, 100, 100, 100], [9, 9, 9, 9]])
AGG_MASK = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
# valid tokens: 1+2+3+4 = 10, 5+6 = 11, 7; row 3 has none
AGG_NORM = 8  # seq-mean-token-sum-norm: every sequence's token sum over the same 8, whatever its length
AGG_EXPECTED = {
    "token-mean": (28.0, 7.0, 4.0),
    "seq-mean-token-sum": (28.0, 3.0, 28 / 3),
    "seq-mean-token-mean": (2.5 + 5.5 + 7.0, 3.0, 5.0),
    "seq-mean-token-sum-norm": (28.0, 3.0 * AGG_NORM, 28 / 24),
}


@pytest.mark.parametrize("mode", list(AGG_EXPECTED))
def test_aggregate_whole_batch(mode):
    loss_sum, units = aggregate(AGG_LOSS, AGG_MASK, mode, AGG_NORM)
    expected_sum, expected_units, _ = AGG_EXPECTED[mode]
    assert float(loss_sum) == pytest.approx(expected_sum)
    assert isinstance(units, float) and units == expected_units


@pytest.mark.parametrize("mode", list(AGG_EXPECTED))
def test_loss_units_are_the_units_aggregate_divides_by(mode):
    assert loss_units(AGG_MASK.long(), mode, AGG_NORM) == AGG_EXPECTED[mode][1]


@pytest.mark.parametrize("mode", list(AGG_EXPECTED))
def test_aggregate_sums_over_micro_batches_give_the_batch_mean(mode):
    halves = [aggregate(AGG_LOSS[rows], AGG_MASK[rows], mode, AGG_NORM) for rows in (slice(0, 2), slice(2, 4))]
    total_sum = sum(float(s) for s, _ in halves)
    total_units = sum(u for _, u in halves)
    assert total_sum / total_units == pytest.approx(AGG_EXPECTED[mode][2])


def test_aggregate_unknown_mode_lists_the_modes():
    with pytest.raises(ValueError, match=", ".join(AGG_EXPECTED)):
        aggregate(AGG_LOSS, AGG_MASK, "mean")
    with pytest.raises(ValueError, match="pass norm_tokens >= 1"):
        aggregate(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm")


def test_dr_grpo_aggregation_weighs_every_token_alike_whatever_its_sequence_length():
    # d(loss)/d(token) is 1 / (sequences * norm) for every valid token: short sequences get no extra weight
    loss = AGG_LOSS.clone().requires_grad_()
    loss_sum, units = aggregate(loss, AGG_MASK, "seq-mean-token-sum-norm", AGG_NORM)
    (loss_sum / units).backward()
    close(loss.grad, AGG_MASK / 24)


# ---------------------------------------------------------------- Safe-RLHF

def test_lagrange_multiplier_ascends_and_clamps_at_zero():
    lag = LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=0.2)
    assert lag.update(1.0) == pytest.approx(1.4)  # 1 + 0.5 * 0.8
    assert lag.update(-3.0) == 0.0  # 1.4 + 0.5 * (-3.2) = -0.2 -> 0
    assert lag.value == 0.0
    assert lag.update(0.4) == pytest.approx(0.1)  # 0 + 0.5 * 0.2
    restored = LagrangeMultiplier()
    restored.load_state_dict(lag.state_dict())
    assert restored.value == pytest.approx(0.1)


def test_lagrange_multiplier_max_value():
    lag = LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=0.2, max_value=1.2)
    assert lag.update(1.0) == 1.2  # 1.4 capped


def test_combined_advantages():
    # lambda 0.5: (1 - 0.5*3)/1.5 = -1/3, (2 + 0.5)/1.5 = 5/3
    close(combined_advantages(t([[1.0, 2.0]]), t([[3.0, -1.0]]), 0.5), [[-1 / 3, 5 / 3]])


# ---------------------------------------------------------------- DAPO

def test_informative_groups():
    scores = t([1, 0, 1, 0.5, 1, 2, 0.5])
    groups = torch.tensor([0, 1, 0, 2, 1, 3, 2])  # 0: all 1; 1: 0 and 1; 2: all 0.5; 3: alone
    assert informative_groups(scores, groups).tolist() == [False, True, False, False, True, False, False]


def test_overlong_penalty_boundaries():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # soft zone starts after 20 - 4 = 16 and reaches -factor at 20
    close(overlong_penalty(lengths, max_length=20, buffer=4, factor=0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


# ---------------------------------------------------------------- registry

FULL_KWARGS = {
    "token_rewards": t([[0, 0, 1], [0, 2, 0]]),
    "scores": t([1.0, 2.0]),
    "values": t([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]),
    "group_ids": torch.tensor([0, 0]),
    "baseline_scores": t([0.5, 0.5]),
    "mask": t([[1, 1, 1], [1, 1, 0]]),
    "gamma": 1.0,
    "lam": 1.0,
}


def test_builtin_names_are_registered():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "dr_grpo", "rloo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    assert get_policy_loss("ppo") is ppo_policy_loss
    assert get_policy_loss("gspo") is gspo_policy_loss and get_policy_loss("cispo") is cispo_policy_loss


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_accepts_the_trainer_keyword_superset(name):
    adv, ret = get_advantage_estimator(name)(**FULL_KWARGS)
    assert adv.shape == ret.shape == (2, 3)
    assert adv[1, 2] == 0 and ret[1, 2] == 0


def test_registered_estimators_compute_their_algorithm():
    # one group of two: mean 1.5; Dr.GRPO -0.5, 0.5; RLOO 1 - 2, 2 - 1; ReMax 0.5, 1.5
    expected = {"dr_grpo": [-0.5, 0.5], "rloo": [-1.0, 1.0], "remax": [0.5, 1.5]}
    for name, per_row in expected.items():
        adv, ret = get_advantage_estimator(name)(**FULL_KWARGS)
        close(adv, rows_to_tokens(per_row, FULL_KWARGS["mask"]))
        assert ret is adv


def test_registered_estimators_forward_gamma_and_lam():
    kwargs = {**FULL_KWARGS, "gamma": 0.5, "lam": 0.5}
    # GAE row 0: delta -> 0.5, -0.25, -0.25; A = 0.5, -0.25 + 0.25*0.5 = -0.125, -0.25 + 0.25*(-0.125) = -0.28125
    #     row 1: delta 1, -0.5; A = 1, -0.5 + 0.25 = -0.25. Returns = A + values.
    _, ret = get_advantage_estimator("gae")(**kwargs)
    close(ret, [[0.21875, 0.375, 1.0], [0.75, 2.0, 0.0]])
    # REINFORCE++ return-to-go with gamma 0.5: row 0: 0.25, 0.5, 1; row 1: 0 + 0.5*2 = 1, 2
    _, ret = get_advantage_estimator("reinforce_plus_plus")(**kwargs)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])


def test_register_an_estimator_from_user_code_and_replace_it():
    name = "test_only_constant"
    try:

        @register_advantage_estimator(name)
        def first(*, mask, **_):
            return mask * 2, mask

        assert get_advantage_estimator(name) is first
        adv, _ = get_advantage_estimator(name)(**FULL_KWARGS)
        close(adv, [[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]])

        @register_advantage_estimator(name)
        def second(*, mask, **_):
            return mask * 3, mask

        assert get_advantage_estimator(name) is second
    finally:
        ADVANTAGE_ESTIMATORS.pop(name, None)


def test_register_a_policy_loss_from_user_code():
    name = "test_only_loss"
    try:

        @register_policy_loss(name)
        def vanilla_pg(*, log_probs, advantages, mask, **_):
            return -advantages * log_probs * mask, {}

        loss, _ = get_policy_loss(name)(log_probs=t([[-1.0]]), old_log_probs=t([[0.0]]), advantages=t([[2.0]]),
                                        mask=t([[1]]), clip_low=0.2, clip_high=0.2, dual_clip=None)
        close(loss, [[2.0]])
    finally:
        POLICY_LOSSES.pop(name, None)


def test_unknown_names_raise_key_error_listing_known_names():
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'nope'; known: dr_grpo, gae, grpo"):
        get_advantage_estimator("nope")
    with pytest.raises(KeyError, match=r"unknown policy loss 'nope'; known: cispo, gspo, ppo"):
        get_policy_loss("nope")


# ---------------------------------------------------------------- package hygiene

def test_package_imports_only_torch_numpy_and_stdlib():
    allowed = {"torch", "numpy", "__future__", *sys.stdlib_module_names}
    for path in Path(alg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{path.name} imports {roots}"


# ---------------------------------------------------------------- numerical guards (issue 15)

def test_k3_gradient_is_finite_at_large_log_ratios():
    # a padding token whose log-ratio is 100: its KL is masked, and the gradient must not be poisoned by exp(100) * 0
    log_probs = torch.tensor([[-0.5, 100.0], [-100.0, -0.2]], requires_grad=True)  # float32, as the trainer's
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    kl = kl_estimate(log_probs, torch.zeros_like(log_probs), "k3")
    assert torch.isfinite(kl).all()
    (kl * mask).sum().backward()
    assert torch.isfinite(log_probs.grad).all()
    # valid tokens keep the exact k3 gradient 1 - exp(-x); the masked ones get none
    close(log_probs.grad, [[1 - math.exp(0.5), 0.0], [0.0, 1 - math.exp(0.2)]])


def test_ppo_ratio_is_clamped_so_a_zero_advantage_never_gives_nan():
    log_probs = torch.tensor([[100.0, 0.1], [-100.0, 0.0]], requires_grad=True)  # float32: exp(100) is inf
    advantages = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # a padding token / a constant-reward group
    mask = torch.tensor([[0, 1], [1, 1]])
    loss, metrics = ppo_policy_loss(log_probs, torch.zeros_like(log_probs), advantages, mask)
    assert torch.isfinite(loss).all() and torch.isfinite(metrics["pg_clipfrac"]).all()
    loss.sum().backward()
    assert torch.isfinite(log_probs.grad).all()
    close(loss, [[0.0, -math.exp(0.1)], [0.0, 0.0]])


EQUAL_REWARDS = [
    [3.1] * 64,  # not exactly representable: the computed mean is 3.1 plus rounding
    [0.1 + 0.5 * 2 / 3] * 8,  # a partial-credit reward (digit_score) shared by the whole group
]


@pytest.mark.parametrize("rewards", EQUAL_REWARDS, ids=["64x3.1", "partial_credit"])
def test_grpo_gives_exactly_zero_advantages_to_a_group_whose_rewards_are_all_equal(rewards):
    n = len(rewards)
    scores = torch.tensor([*rewards, *range(n)], dtype=torch.float32)  # the equal group, and one that varies
    groups = torch.tensor([0] * n + [1] * n)
    mask = torch.ones(2 * n, 3)
    for advantages in (grpo(scores, groups, mask), grpo(scores, groups, mask, norm_by_std=False),
                       rloo(scores, groups, mask)):
        assert torch.equal(advantages[:n], torch.zeros(n, 3))
        assert advantages[n:].abs().sum() > 0
    assert torch.equal(group_centered(scores, groups)[:n], torch.zeros(n))


def test_remax_advantages_keep_the_scores_dtype():
    scores = torch.tensor([1.0, 0.5])
    baseline = np.array([0.25, 1.0])  # float64, as a column built from Python floats arrives
    advantages = remax(scores, baseline, torch.ones(2, 2))
    assert advantages.dtype == torch.float32
    close(advantages, [[0.75, 0.75], [-0.5, -0.5]])


def test_verl_kl_names_map_to_the_estimators():
    assert [kl_kind(name) for name in ("kl", "mse", "low_var_kl", "abs", "k3")] == ["k1", "k2", "k3", "abs", "k3"]
    close(kl_estimate(KL_LOGP, KL_REF, "low_var_kl"), kl_estimate(KL_LOGP, KL_REF, "k3"))
    with pytest.raises(ValueError, match="low_var_kl=k3"):
        kl_kind("full")


# ---------------------------------------------------------------- GSPO and CISPO

SEQ_MASK = t([[1, 1, 1], [1, 1, 0]])


def test_gspo_clips_the_length_normalised_sequence_ratio():
    old = torch.zeros(2, 3, dtype=torch.float64)
    # row 0: token log-ratios 0.3, -0.1, 0.1 -> sequence ratio exp(0.1); row 1: 1e-4, 1e-4 (padding 9 ignored)
    log_probs = t([[0.3, -0.1, 0.1], [1e-4, 1e-4, 9.0]]).requires_grad_()
    advantages = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, metrics = gspo_policy_loss(log_probs, old, advantages, SEQ_MASK, gspo_clip_low=3e-4, gspo_clip_high=4e-4)
    ratio_1 = math.exp(1e-4)
    # row 0's ratio 1.105 is far above 1 + 4e-4: clipped (no gradient); row 1's is inside the range
    close(loss, [[-(1 + 4e-4)] * 3, [-ratio_1, -ratio_1, 0.0]])
    close(metrics["pg_clipfrac"], [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    (loss * SEQ_MASK).sum().backward()
    # GSPO-token: each token's gradient is -A * s through its own log-prob
    close(log_probs.grad, [[0.0, 0.0, 0.0], [-ratio_1, -ratio_1, 0.0]])


def test_gspo_on_policy_gradient_is_the_sequence_mean_of_the_token_gradients():
    # ratio 1 everywhere (on-policy): every token's gradient is -A, the same as PPO's; GSPO differs by the clip
    log_probs = t([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]]).requires_grad_()
    advantages = t([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]])
    loss, _ = gspo_policy_loss(log_probs, log_probs.detach(), advantages, SEQ_MASK)
    loss.sum().backward()
    close(log_probs.grad, [[-2.0, -2.0, -2.0], [1.0, 1.0, 0.0]])


def test_cispo_clips_the_weight_under_a_stop_gradient_and_keeps_every_tokens_gradient():
    old = torch.zeros(2, 3, dtype=torch.float64)
    log_probs = t([[math.log(8.0), math.log(0.5), 0.0], [math.log(2.0), 0.0, 0.0]]).requires_grad_()
    advantages = t([[1.0, 1.0, -1.0], [-2.0, 1.0, 0.0]])
    loss, metrics = cispo_policy_loss(log_probs, old, advantages, SEQ_MASK, cispo_clip_low=1.0, cispo_clip_high=4.0)
    # weights clip(r, 0, 5): 8 -> 5 (clipped), 0.5, 1 | 2, 1; loss = -w * A * log p
    close(loss, [[-5 * math.log(8.0), -0.5 * math.log(0.5), 0.0], [4 * math.log(2.0), 0.0, 0.0]])
    close(metrics["pg_clipfrac"], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss.sum().backward()
    # the clipped token still has a gradient (-w * A), unlike PPO's clip
    close(log_probs.grad, [[-5.0, -0.5, 1.0], [4.0, -1.0, 0.0]])


# ---------------------------------------------------------------- rollout correction

TRAIN_LP = t([[-1.0, -1.0, -1.0], [-2.0, -0.5, 0.0]])
ROLLOUT_LP = t([[-1.0, -2.0, -0.2], [-2.0, -0.5, -9.0]])  # row 1's last token is padding
# token ratios pi_train / pi_rollout: row 0: 1, e, exp(-0.8); row 1: 1, 1; sequence ratios exp(0.2), 1


def test_token_tis_caps_each_tokens_weight():
    weights, metrics = rollout_correction(TRAIN_LP, ROLLOUT_LP, SEQ_MASK, is_level="token", is_cap=2.0)
    close(weights, [[1.0, 2.0, math.exp(-0.8)], [1.0, 1.0, 0.0]])
    close(metrics["is_capped"], [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(metrics["mismatch"], [[0.0, 1.0, 0.8], [0.0, 0.0, 0.0]])


def test_sequence_tis_weights_every_token_by_the_sequences_ratio():
    weights, _ = rollout_correction(TRAIN_LP, ROLLOUT_LP, SEQ_MASK, is_level="sequence", is_cap=2.0)
    close(weights, [[math.exp(0.2)] * 3, [1.0, 1.0, 0.0]])


def test_masked_is_drops_the_tokens_and_sequences_outside_the_band():
    weights, metrics = rollout_correction(TRAIN_LP, ROLLOUT_LP, SEQ_MASK, mask_level="token", mask_low=0.5,
                                          mask_high=2.0)
    close(weights, [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # e > 2 and exp(-0.8) < 0.5 leave the band
    close(metrics["is_masked"], [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    weights, _ = rollout_correction(TRAIN_LP, ROLLOUT_LP, SEQ_MASK, mask_level="sequence", mask_low=0.9,
                                    mask_high=1.1)
    close(weights, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # row 0's sequence ratio exp(0.2) = 1.22 leaves it


def test_no_correction_weighs_every_valid_token_one_and_still_measures_the_mismatch():
    weights, metrics = rollout_correction(TRAIN_LP, ROLLOUT_LP, SEQ_MASK)
    close(weights, SEQ_MASK)
    assert float(metrics["mismatch"].max()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="is_level must be one of"):
        rollout_correction(TRAIN_LP, ROLLOUT_LP, SEQ_MASK, is_level="geometric")
