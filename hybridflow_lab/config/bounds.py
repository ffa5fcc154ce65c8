"""The settings' allowed values, one table row each: numeric bounds, and the choices of the ``Literal`` settings
with what each choice means. Every error names the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from functools import reduce
from typing import Any, NamedTuple

from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.schema import LabConfig


class Bound(NamedTuple):
    """A setting's allowed values: its dotted key, the rule in words, the test, and what to set instead."""

    key: str
    rule: str
    holds: Callable[[Any], bool]
    fix: str


def _at_least(n: int) -> Callable[[Any], bool]:
    return lambda value: value >= n


def _positive(value: float) -> bool:
    return value > 0


def _fraction(value: float) -> bool:
    return 0 < value <= 1


def _probability(value: float) -> bool:
    return 0 <= value <= 1


WHOLE_NUMBER = "use a whole number >= 1"
BOUNDS = (
    *(Bound(f"batch.{key}", ">= 1", _at_least(1), WHOLE_NUMBER)
      for key in ("rollout_batch_prompts", "samples_per_prompt", "update_minibatch_sequences",
                  "micro_batch_sequences_per_rank", "update_epochs")),
    *(Bound(f"rollout.{key}", ">= 1", _at_least(1), WHOLE_NUMBER)
      for key in ("max_prompt_tokens", "max_new_tokens", "tensor_parallel", "kv_cache_gib")),
    Bound("batch.micro_batch_tokens_per_rank", ">= 0", _at_least(0), "use 0 to size micro-batches by sequences, "
          "or a token count that holds a few sequences"),
    Bound("rollout.temperature", "> 0", _positive, "sampling divides the logits by it; use 1.0 (greedy decoding "
          "is lab.generate(prompts, greedy=True))"),
    Bound("rollout.top_p", "in (0, 1]", _fraction, "use 1.0 to turn nucleus sampling off"),
    Bound("rollout.top_k", ">= 0", _at_least(0), "use 0 to turn top-k sampling off"),
    Bound("rollout.gpu_memory_utilization", "in (0, 1]", _fraction, "it is vLLM's share of GPU memory; use e.g. "
          "0.5"),
    Bound("algorithm.clip_low", "in (0, 1)", lambda v: 0 < v < 1, "the ratio is clipped to [1 - clip_low, "
          "1 + clip_high]; use e.g. 0.2"),
    Bound("algorithm.clip_high", "> 0", _positive, "use e.g. 0.2, or 0.28 for DAPO's clip-higher"),
    Bound("algorithm.dual_clip", "0 (off) or > 1", lambda v: v == 0 or v > 1, "use e.g. 3.0, or 0 to turn dual "
          "clip off"),
    Bound("algorithm.gamma", "in [0, 1]", _probability, "use 1.0 (no discount)"),
    Bound("algorithm.lam", "in [0, 1]", _probability, "use 1.0, or e.g. 0.95 for GAE"),
    Bound("algorithm.kl_loss_coef", ">= 0", _at_least(0), "use 0 for no KL loss term (e.g. 0.001 for one)"),
    Bound("algorithm.kl_reward_coef", ">= 0", _at_least(0), "use 0 for no KL penalty in the rewards (e.g. 0.05 "
          "for one)"),
    Bound("algorithm.kl_target", ">= 0", _at_least(0), "use 0 for a fixed KL coefficient"),
    Bound("algorithm.gspo_clip_low", "in (0, 1)", lambda v: 0 < v < 1, "GSPO's sequence ratio is clipped to "
          "[1 - low, 1 + high]; use the paper's 3e-4"),
    Bound("algorithm.gspo_clip_high", "> 0", _positive, "use the paper's 4e-4"),
    Bound("algorithm.cispo_clip_low", "in [0, 1]", _probability, "CISPO's weights are clipped to [1 - low, "
          "1 + high]; use 1.0 for no lower bound"),
    Bound("algorithm.cispo_clip_high", "> 0", _positive, "use 4.0 (weights capped at 5, ScaleRL's choice)"),
    Bound("rollout.max_staleness", ">= 0", _at_least(0), "use 0 (on-policy), or 1 to generate the next step's "
          "rollouts while this step trains"),
    Bound("rollout.ranks", ">= 1", _at_least(1), "use e.g. 1"),
    Bound("agent.max_turns", ">= 1", _at_least(1), "use 1 for single-turn answers, e.g. 4 for a few tool calls"),
    Bound("agent.max_tokens", ">= 1", _at_least(1), "it bounds each trajectory after its prompt; use e.g. 128"),
    Bound("agent.tool_timeout_s", "> 0", _positive, "use e.g. 10"),
    Bound("agent.max_result_chars", ">= 1", _at_least(1), "use e.g. 2000"),
    Bound("agent.tool_workers", ">= 0", _at_least(0), "use 0 to run tools on the controller, e.g. 4 for a pool"),
    Bound("agent.retry_discount", "in (0, 1]", lambda v: 0 < v <= 1, "use 1 for no discount, e.g. 0.8 to favour "
          "solving at the first try"),
    Bound("algorithm.rollout_is_cap", ">= 1", _at_least(1), "use e.g. 2.0 (weights above it are capped)"),
    Bound("algorithm.rollout_mask_low", "in (0, 1]", _fraction, "use e.g. 0.5"),
    Bound("algorithm.rollout_mask_high", ">= 1", _at_least(1), "use e.g. 2.0"),
    Bound("algorithm.kl_horizon", ">= 1", _at_least(1), "use e.g. 10000"),
    Bound("algorithm.max_sampling_rounds", ">= 1", _at_least(1), "use e.g. 4 (rounds of prompts dynamic sampling "
          "may draw per step)"),
    Bound("algorithm.overlong_buffer", ">= 0", _at_least(0), "use 0 for no overlong penalty"),
    Bound("algorithm.overlong_factor", ">= 0", _at_least(0), "use e.g. 1.0"),
    Bound("algorithm.lagrange_lr", ">= 0", _at_least(0), "use e.g. 0.1"),
    Bound("task.eval_size", ">= 1", _at_least(1), "use e.g. 64 held-out examples"),
    *(Bound(f"trainer.{key}", ">= 0", _at_least(0), "use 0 to turn it off") for key in ("save_every", "eval_every")),
    Bound("trainer.steps", ">= 0", _at_least(0), "use e.g. 20"),
    Bound("trainer.keep_checkpoints", ">= 0", _at_least(0), "use 0 to keep every checkpoint, or e.g. 2 for the "
          "newest two"),
    Bound("trainer.logged_samples", ">= 0", _at_least(0), "use e.g. 8"),
    Bound("trainer.capture_steps", ">= 0", _at_least(0), "use 0 to keep every step's captures"),
    Bound("trainer.stage_timeout_s", "> 0", _positive, "use e.g. 1800 (seconds a stage may run before its silent "
          "ranks are named)"),
    Bound("task.reward_timeout_s", ">= 0", _at_least(0), "use 0 for no timeout, or the seconds one row may take"),
)
OPTIM_BOUNDS = (
    Bound("optim.lr", "> 0", _positive, "use e.g. 1e-5 (1e-6 for larger models)"),
    Bound("optim.weight_decay", ">= 0", _at_least(0), "use 0.0 or e.g. 0.01"),
    Bound("optim.eps", "> 0", _positive, "use e.g. 1e-8"),
    Bound("optim.betas", "in [0, 1) each", lambda betas: all(0 <= b < 1 for b in betas), "use e.g. [0.9, 0.999]"),
    Bound("optim.warmup_steps", ">= 0", _at_least(0), "use 0 for no warm-up"),
    Bound("optim.min_lr_ratio", "in [0, 1]", _probability, "use e.g. 0.1 (cosine decays to lr * min_lr_ratio)"),
    Bound("optim.grad_clip", ">= 0", _at_least(0), "use e.g. 1.0, or 0 to turn clipping off"),
)


ROLES = ("actor", "critic")
CHOICE_FIXES = {  # what each choice means, for the error naming a value outside a Literal setting's choices
    "backend": "'ray' runs every rank as a Ray actor; 'local' runs every role in this process, one rank each",
    "device": "use auto (cuda where the cluster has GPUs, else cpu)",
    "role.model_impl": "auto runs qwen2, llama, qwen3 and mistral on the project's decoder and every other causal LM "
                       "on transformers' own model (docs/models-and-engines.md); native or transformers forces one",
    "role.engine.backend": "torch is DDP, deepspeed is ZeRO, fsdp is FSDP2 (docs/models-and-engines.md)",
    "role.engine.zero_stage": "use 2 (ZeRO-2), or 3 to shard the parameters too",
    "role.engine.pipeline_schedule": "1f1b interleaves each micro-batch's backward with the next ones' forwards "
                                     "(activations of at most p micro-batches held); gpipe runs every forward, then "
                                     "every backward",
    "role.optim.schedule": "use constant, or cosine with optim.total_steps",
    "rollout.engine": "torch is the built-in engine; vllm needs vLLM installed (docs/vllm.md)",
    "rollout.decoding": "eager is the plain decoding step; compiled runs it through torch.compile; onednn runs it in "
                        "C++ over weights packed for oneDNN (CPU, float32)",
    "rollout.reshard": "use hybridflow (the paper's zero-redundancy transition)",
    "rollout.dtype": "leave it empty for the actor's training dtype",
    "algorithm.rollout_is": "'' turns truncated importance sampling off; 'token' (TIS) weights each token by "
                            "min(pi_train / pi_rollout, rollout_is_cap); 'auto' is 'token' when generation runs ahead "
                            "(rollout.max_staleness > 0) and rollout_mask is off, else off",
    "algorithm.rollout_mask": "'' turns masked importance sampling off; 'token' drops the tokens whose pi_train / "
                              "pi_rollout leaves [rollout_mask_low, rollout_mask_high]",
    "trainer.on_nonfinite": "a NaN/inf loss or gradient norm either stops the run or drops that optimizer step; "
                            "nothing is applied either way",
    "agent.call_format": "plain writes a call as [name arg1, arg2] (the bundled tiny models); hermes as "
                         "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Qwen's and Hermes' chat "
                         "templates)",
    "agent.credit": "episode puts a trajectory's score on its last token; turn puts each turn's reward on that "
                    "turn's last token (per-turn credit through GAE)",
    "task.reward_on_error": "a row the reward function cannot score either stops the step, showing the row, or "
                            "scores 0 and is counted",
}


def choices(cls: type[Any] = LabConfig, prefix: str = "") -> dict[str, tuple[Any, ...]]:
    """Every ``Literal`` setting of dataclass ``cls`` and its sections, by dotted key, with its choices."""
    hints = typing.get_type_hints(cls)
    found: dict[str, tuple[Any, ...]] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if typing.get_origin(hint) is typing.Literal:
            found[f"{prefix}{field.name}"] = typing.get_args(hint)
        elif dataclasses.is_dataclass(hint):
            found.update(choices(hint, f"{prefix}{field.name}."))
    return found


def _choice_fix(key: str) -> str:
    role, _, rest = key.partition(".")
    return CHOICE_FIXES[f"role.{rest}"] if role in ROLES else CHOICE_FIXES[key]


CHOICES = tuple(Bound(key, f"one of {allowed}", lambda value, allowed=allowed: value in allowed, _choice_fix(key))
                for key, allowed in choices().items())


def setting(config: LabConfig, key: str) -> Any:
    """The value of dotted ``key`` in ``config``."""
    return reduce(getattr, key.split("."), config)


def check_bounds(config: LabConfig, roles: Iterable[str]) -> None:
    """Raise ``ConfigError`` for the first setting outside its bounds or choices (the roles' optimizers: ``roles``)."""
    role_bounds = [bound._replace(key=f"{name}.{bound.key}") for name in roles for bound in OPTIM_BOUNDS]
    for bound in CHOICES:
        value = setting(config, bound.key)
        if not bound.holds(value):
            raise ConfigError(bound.key, f"{value!r} is not {bound.rule}; {bound.fix}")
    for bound in (*BOUNDS, *role_bounds):
        value = setting(config, bound.key)
        if not bound.holds(value):
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(bound.key, f"must be {bound.rule}, got {shown}; {bound.fix}")
