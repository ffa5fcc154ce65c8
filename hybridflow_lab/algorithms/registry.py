"""Name -> function registries for advantage estimators and policy losses, extendable from a notebook cell.

Advantage estimators are called by the trainer with keyword arguments only, always the same superset::

    estimator(token_rewards=, scores=, values=, group_ids=, baseline_scores=, mask=, gamma=, lam=)

``token_rewards``/``values``/``mask`` are ``[B, T]``, ``scores``/``group_ids``/``baseline_scores`` are ``[B]``
(``values`` and ``baseline_scores`` may be None when no critic or greedy baseline was run). An estimator takes
the arguments it needs and swallows the rest with ``**_``, and returns ``(advantages, returns)``, both ``[B, T]``
and 0 at masked positions; estimators without separate returns return the advantages twice. For example::

    @register_advantage_estimator("my_estimator")
    def my_estimator(*, scores, group_ids, mask, **_):
        advantages = grpo(scores, group_ids, mask)
        return advantages, advantages

Policy losses are called as ``loss(log_probs=, old_log_probs=, advantages=, mask=, **config)`` where the config
keywords are always the superset ``POLICY_LOSS_KEYWORDS`` (the ``algorithm`` config keys of the same names). A
loss takes those it needs and swallows the rest with ``**_``, and returns ``(loss [B, T], metrics)`` like
``ppo_policy_loss``: metrics are per-token tensors, reported as token means. Registering an existing name
replaces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from .advantages import gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo
from .losses import cispo_policy_loss, gspo_policy_loss, ppo_policy_loss

Pair = tuple[Tensor, Tensor]
Estimator = Callable[..., Pair]
PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSS_KEYWORDS = ("clip_low", "clip_high", "dual_clip",  # PPO
                        "gspo_clip_low", "gspo_clip_high", "cispo_clip_low", "cispo_clip_high")

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def _register(table: dict[str, Any], name: str) -> Callable[[Any], Any]:
    def decorator(fn: Any) -> Any:
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict[str, Any], name: str, what: str) -> Any:
    if name not in table:
        raise KeyError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


def register_advantage_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator adding an estimator under ``name`` (replacing any previous one)."""
    return _register(ADVANTAGE_ESTIMATORS, name)


def get_advantage_estimator(name: str) -> Estimator:
    """The estimator registered under ``name``; KeyError listing the known names otherwise."""
    return _lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a policy loss under ``name`` (replacing any previous one)."""
    return _register(POLICY_LOSSES, name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered under ``name``; KeyError listing the known names otherwise."""
    return _lookup(POLICY_LOSSES, name, "policy loss")


@register_advantage_estimator("gae")
def _gae(
    *, token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0, **_: object
) -> Pair:
    return gae(token_rewards, values, mask, gamma=gamma, lam=lam)


@register_advantage_estimator("grpo")
def _grpo(*, scores: Tensor, group_ids: Tensor, mask: Tensor, **_: object) -> Pair:
    advantages = grpo(scores, group_ids, mask)
    return advantages, advantages


@register_advantage_estimator("dr_grpo")
def _dr_grpo(*, scores: Tensor, group_ids: Tensor, mask: Tensor, **_: object) -> Pair:
    advantages = grpo(scores, group_ids, mask, norm_by_std=False)
    return advantages, advantages


@register_advantage_estimator("rloo")
def _rloo(*, scores: Tensor, group_ids: Tensor, mask: Tensor, **_: object) -> Pair:
    advantages = rloo(scores, group_ids, mask)
    return advantages, advantages


@register_advantage_estimator("remax")
def _remax(*, scores: Tensor, baseline_scores: Tensor, mask: Tensor, **_: object) -> Pair:
    advantages = remax(scores, baseline_scores, mask)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(*, token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, **_: object) -> Pair:
    return reinforce_plus_plus(token_rewards, mask, gamma=gamma)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(*, scores: Tensor, group_ids: Tensor, mask: Tensor, **_: object) -> Pair:
    advantages = reinforce_plus_plus_baseline(scores, group_ids, mask)
    return advantages, advantages


register_policy_loss("ppo")(ppo_policy_loss)
register_policy_loss("gspo")(gspo_policy_loss)
register_policy_loss("cispo")(cispo_policy_loss)
