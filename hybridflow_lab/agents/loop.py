"""The multi-turn loop: generate a turn for every live trajectory, let each environment answer, append the answer's
tokens, and go on until every trajectory has ended.

A turn ends at EOS, at the call format's stop string (kept), or after ``max_new_tokens``. A trajectory ends when its
environment says so (``answer``; a tool environment does at a turn without a call, a user-like one may answer a
turn that ended with EOS), after ``max_turns`` turns (``turns``), when the next observation would not fit in
``max_tokens`` (``tokens``), or when its environment raised (``error``, reward 0).
The loop knows no engine: ``generate`` samples one turn for a list of contexts (token ids), and ``environments``
answer each turn's live trajectories together (in this process, or on a pool of workers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridflow_lab.agents.environments import Environments, EnvStep
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


def run_episodes(generate: GenerateTurn, environments: Environments, examples: Sequence[Example],
                 encode_prompt: Callable[[str], list[int]], renderer: ObservationRenderer, limits: AgentLimits,
                 on_step: Callable[[Trajectory, EnvStep], None] | None = None) -> list[Trajectory]:
    """One trajectory per example (``environments``' ``i``-th takes example ``i``); ``on_step(trajectory, step)``
    hears each environment step (the Lab's spans and metrics)."""
    decode = renderer.tokenizer.decode
    trajectories = [Trajectory(example, encode_prompt(prompt))
                    for example, prompt in zip(examples, environments.reset(examples), strict=True)]
    live = list(range(len(trajectories)))
    for turn_index in range(limits.max_turns):
        budgets = [min(limits.max_new_tokens, limits.max_tokens - trajectories[i].length) for i in live]
        sampled = generate([trajectories[i].context() for i in live], max(budgets), turn_index)
        turns = {}
        for index, (ids, log_probs), budget in zip(live, sampled, budgets, strict=True):
            ids, log_probs = ids[:budget], log_probs[:budget]
            turns[index] = Turn(ids, log_probs, decode(ids, skip_special_tokens=True))
        answered = environments.step({index: turn.text for index, turn in turns.items()})
        for index, turn in turns.items():
            trajectory, step = trajectories[index], answered[index]
            result = step.result
            if step.failed:
                trajectory.ended = "error"
            if on_step is not None:
                on_step(trajectory, step)
            turn.reward, turn.counts = 0.0 if trajectory.ended else result.reward, dict(result.counts)
            trajectory.turns.append(turn)
            if trajectory.ended:
                continue
            if result.done:  # the environment decides: a chat turn ends with EOS and a user may answer it
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
        live = [i for i in live if trajectories[i].ended is None]
        if not live:
            break
    return trajectories
