"""The multi-turn loop: generate a turn for every live trajectory, let each environment answer, append the answer's
tokens, and go on until every trajectory has ended.

A turn ends at EOS, at the call format's stop string (kept), or after ``max_new_tokens``. A trajectory ends when its
environment says so or its turn ended with EOS (``answer``), after ``max_turns`` turns (``turns``), when the next
observation would not fit in ``max_tokens`` (``tokens``), or when its environment raised (``error``, reward 0).
The loop knows no engine: ``generate`` samples one turn for a list of contexts (token ids).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridflow_lab.agents.environment import Environment, StepResult
from hybridflow_lab.agents.observations import ObservationRenderer
from hybridflow_lab.agents.trajectory import Trajectory, Turn
from hybridflow_lab.tasks.base import Example

Sampled = tuple[list[int], list[float]]  # a turn's token ids and their log-probs
# (contexts, max_new_tokens, turn index) -> one sampled turn per context
GenerateTurn = Callable[[list[list[int]], int, int], list[Sampled]]


@dataclass(frozen=True)
class AgentLimits:
    """``max_turns`` policy turns, ``max_tokens`` after the prompt (the policy's and the observations'),
    ``max_new_tokens`` per turn."""

    max_turns: int = 4
    max_tokens: int = 256
    max_new_tokens: int = 64


def run_episodes(generate: GenerateTurn, envs: Sequence[Environment], examples: Sequence[Example],
                 encode_prompt: Callable[[str], list[int]], renderer: ObservationRenderer,
                 eos_token_id: int | None, limits: AgentLimits,
                 on_step: Callable[[Trajectory, StepResult, float], None] | None = None) -> list[Trajectory]:
    """One trajectory per (environment, example); ``on_step(trajectory, result, seconds)`` hears each environment
    step (the Lab's spans and metrics)."""
    decode = renderer.tokenizer.decode
    trajectories = [Trajectory(example, env, encode_prompt(env.reset(example)))
                    for env, example in zip(envs, examples, strict=True)]
    live = list(trajectories)
    for turn_index in range(limits.max_turns):
        budgets = [min(limits.max_new_tokens, limits.max_tokens - t.length) for t in live]
        sampled = generate([t.context() for t in live], max(budgets), turn_index)
        for trajectory, (ids, log_probs), budget in zip(live, sampled, budgets, strict=True):
            ids, log_probs = ids[:budget], log_probs[:budget]
            text = decode(ids, skip_special_tokens=True)
            start = time.perf_counter()
            try:
                result = trajectory.env.step(text)
            except Exception as exc:  # the environment's own failure: the trajectory ends, scored 0
                result = StepResult(f"{type(exc).__name__}: {exc}", done=True, counts={"env_errors": 1.0})
                trajectory.ended = "error"
            if on_step is not None:
                on_step(trajectory, result, time.perf_counter() - start)
            turn = Turn(ids, log_probs, text, 0.0 if trajectory.ended else result.reward, counts=dict(result.counts))
            trajectory.turns.append(turn)
            if trajectory.ended:
                continue
            if result.done or (ids and ids[-1] == eos_token_id):
                trajectory.ended = "answer"
            elif turn_index == limits.max_turns - 1:
                trajectory.ended = "turns"
            else:
                rendered, observation_ids = renderer.render(result.observation or "", result.role)
                if trajectory.length + len(observation_ids) >= limits.max_tokens:
                    trajectory.ended = "tokens"  # no room for the observation and a reply to it
                else:
                    turn.observation, turn.role = result.observation, result.role
                    turn.observation_ids, turn.observation_text = observation_ids, rendered
        live = [t for t in live if t.ended is None]
        if not live:
            break
    return trajectories
