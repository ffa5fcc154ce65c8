"""What an RL algorithm is, declared in one object: its dataflow, its advantage estimator and what it needs.

Everything that asks "does this run need X" (the Lab building worker groups, the workload and memory model,
the placement plan, the config checks) reads the ``Algorithm`` registered under ``algorithm.name`` through
``RunNeeds``, computed once from a config. A notebook declares its own with ``register_algorithm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridflow_lab.algorithms.registry import ADVANTAGE_ESTIMATORS

if TYPE_CHECKING:
    from hybridflow_lab.config import LabConfig

Dataflow = Callable[..., Any]  # (lab: Stages, step: StepContext) -> (DataBatch, metrics); see dataflows.stages


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm.

    ``dataflow`` is the function that runs one iteration; ``estimator`` the registered advantage estimator
    its ``lab.advantages`` stage uses. ``critic``: it trains a value model. ``reference``: it needs the frozen
    reference policy's log-probs (None: only when a KL term is configured). ``reward_model``: it needs a
    learned reward model (None: when ``reward_model_path`` is set; otherwise the task's rule scores).
    ``group_relative``: its advantages compare the samples of one prompt, so a group needs two or more.
    ``dynamic_sampling``: its dataflow can drop groups whose rewards are all equal (DAPO). ``cost``: it needs a
    cost signal (``task.cost``) besides the reward. ``asynchronous_rollout``: its dataflow draws its responses
    with ``lab.rollout()`` and its update takes a batch from an older policy version (importance-weighted
    against the rollout's log-probs), so generation may run ahead of training (``rollout.max_staleness``).
    """

    name: str
    dataflow: Dataflow
    estimator: str
    critic: bool = False
    reference: bool | None = None
    reward_model: bool | None = None
    group_relative: bool = False
    dynamic_sampling: bool = False
    cost: bool = False
    asynchronous_rollout: bool = False
    description: str = ""


ALGORITHMS: dict[str, Algorithm] = {}


class AlgorithmError(ValueError):
    """A declared algorithm that cannot run; ``field`` names what is wrong."""

    def __init__(self, name: str, field: str, message: str) -> None:
        super().__init__(f"algorithm {name!r}: {field}: {message}")
        self.field = field


def register_algorithm(name: str, dataflow: Dataflow, estimator: str, **declared: Any) -> Algorithm:
    """Declare ``algorithm.name=<name>``: ``dataflow`` with advantage estimator ``estimator`` and the ``Algorithm``
    fields in ``declared`` (``critic=True``, ``group_relative=True``...). Replaces an algorithm of that name.
    An estimator that is not registered, a dataflow that is not a function or an unknown field fails here."""
    unknown = sorted(set(declared) - set(Algorithm.__dataclass_fields__) - {"name", "dataflow", "estimator"})
    if unknown:
        known = ", ".join(f for f in Algorithm.__dataclass_fields__ if f not in ("name", "dataflow", "estimator"))
        raise AlgorithmError(name, unknown[0], f"is not something an algorithm declares; declare {known}")
    if not callable(dataflow):
        raise AlgorithmError(name, "dataflow", f"{dataflow!r} is not a function of (lab, step)")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise AlgorithmError(name, "estimator", f"{estimator!r} is not a registered advantage estimator; register "
                             "it with @register_advantage_estimator first, or use one of "
                             f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    algorithm = Algorithm(name, dataflow, estimator, **declared)
    ALGORITHMS[name] = algorithm
    return algorithm


def algorithm_of(config: LabConfig) -> Algorithm:
    """The algorithm ``config.algorithm.name`` names; ``KeyError`` listing the known ones otherwise."""
    name = config.algorithm.name
    if name not in ALGORITHMS:
        raise KeyError(f"{name!r} is not one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


@dataclass(frozen=True)
class RunNeeds:
    """What one run (an algorithm under a config) needs: which models are built and which stages run."""

    algorithm: Algorithm
    critic: bool
    reference: bool  # the reference policy's log-probs are computed (a KL term, or the algorithm asks)
    reference_model: bool  # a frozen copy of the policy is built for them (not under LoRA: the adapters go off)
    reward_model: bool
    old_log_probs: bool  # a separate pass computes them (the update takes several optimizer steps per batch)
    rollout_group: bool = False  # generation on a pool of its own (``rollout.pool``), not the actor's ranks

    @property
    def trained_roles(self) -> tuple[str, ...]:
        """The roles with their own ``RoleConfig`` (model, pool, ranks, engine): the actor, and the critic if used."""
        return ("actor", "critic") if self.critic else ("actor",)

    @property
    def pooled_roles(self) -> tuple[str, ...]:
        """The roles given resource pools: the trained ones, and the rollout group when it has its own."""
        return (*self.trained_roles, *(("rollout",) if self.rollout_group else ()))

    @property
    def models(self) -> list[str]:
        """The models the run's stages run on, as the dataflow graph names its rows."""
        return ["rollout", "actor", *(["reference"] if self.reference else []), *(["critic"] if self.critic else []),
                "reward model" if self.reward_model else "reward function", "controller"]

    @classmethod
    def of(cls, config: LabConfig) -> RunNeeds:
        """What ``config``'s run needs (``KeyError`` for an unknown algorithm)."""
        algorithm = algorithm_of(config)
        reference = config.algorithm.uses_reference if algorithm.reference is None else algorithm.reference
        reward_model = bool(config.reward_model_path) if algorithm.reward_model is None else algorithm.reward_model
        return cls(algorithm, algorithm.critic, reference, reference and not config.actor.lora.enabled,
                   reward_model, needs_old_log_probs(config), bool(config.rollout.pool))


def needs_old_log_probs(config: LabConfig) -> bool:
    """Whether the update needs ``old_log_probs`` from a separate pass: it does when a batch gets more than
    one optimizer step (or KL enters the rewards); with exactly one, the update's own forward pass gives the
    same numbers and the pass is skipped."""
    batch = config.batch
    one_step = batch.update_epochs == 1 and batch.update_minibatch_sequences >= batch.step_sequences
    return not one_step or config.algorithm.kl_reward_coef > 0
