"""The batch sizes checked together: every conflict among them in one error, with one set of values that satisfies
every rule at once (fixing one size at a time used to reveal the next conflict only on the next run)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from hybridflow_lab.config.loading import ConfigError
from hybridflow_lab.config.schema import BatchConfig, LabConfig
from hybridflow_lab.config.sequence_length import longest_sequence

MINIBATCH, MICRO_BATCH = "batch.update_minibatch_sequences", "batch.micro_batch_sequences_per_rank"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_conflicts(batch: BatchConfig, data_parallel: Mapping[str, int]) -> list[tuple[str, str]]:
    """Each rule between the batch sizes that ``batch`` breaks, as (key, problem and fix), given each trained
    role's data-parallel size."""
    step, minibatch = batch.step_sequences, batch.update_minibatch_sequences
    micro = batch.micro_batch_sequences_per_rank
    conflicts = []
    if step % minibatch:
        conflicts.append((MINIBATCH, f"{minibatch} does not divide the {step} sequences of a step "
                                     f"(rollout_batch_prompts {batch.rollout_batch_prompts} x samples_per_prompt "
                                     f"{batch.samples_per_prompt}); use one of {divisors(step)}"))
    for name, dp in data_parallel.items():
        if minibatch % dp:
            conflicts.append((MINIBATCH, f"{minibatch} is not divisible by the {dp} data-parallel ranks of the {name} "
                                         f"({name}.ranks / {name}.engine.tensor_parallel); use a multiple of {dp}"))
        elif (minibatch // dp) % micro:
            per_rank = minibatch // dp
            conflicts.append((MICRO_BATCH, f"{micro} does not divide the {per_rank} sequences each {name} rank gets "
                                           f"per optimizer step (update_minibatch_sequences {minibatch} / {dp} "
                                           f"data-parallel ranks); use one of {divisors(per_rank)}"))
    return conflicts


def consistent_batch(batch: BatchConfig, data_parallel: Mapping[str, int]) -> dict[str, int]:
    """The batch sizes to change (dotted key: value) so that every rule holds, each as close to its value as the
    others allow: the prompts per step rise until the ranks can share a step; the minibatch is the divisor of the
    step, shared evenly by every role's ranks, nearest below (else above) its value; the micro-batch the largest
    that divides each rank's share, up to its value."""
    ranks = math.lcm(*data_parallel.values()) if data_parallel else 1
    per_prompt = ranks // math.gcd(ranks, batch.samples_per_prompt)  # prompts per step must be a multiple of this
    prompts = math.ceil(batch.rollout_batch_prompts / per_prompt) * per_prompt
    step = prompts * batch.samples_per_prompt
    shared = [size for size in divisors(step) if size % ranks == 0]
    below = [size for size in shared if size <= batch.update_minibatch_sequences]
    minibatch = below[-1] if below else shared[0]
    each_rank = math.gcd(*(minibatch // dp for dp in data_parallel.values())) if data_parallel else minibatch
    micro = max(size for size in divisors(each_rank) if size <= batch.micro_batch_sequences_per_rank)
    proposal = {"batch.rollout_batch_prompts": prompts, MINIBATCH: minibatch, MICRO_BATCH: micro}
    return {key: value for key, value in proposal.items() if value != _current(batch, key)}


def _current(batch: BatchConfig, key: str) -> int:
    return getattr(batch, key.removeprefix("batch."))


def check_batch_sizes(config: LabConfig, data_parallel: Mapping[str, int]) -> None:
    """Raise one ``ConfigError`` naming every conflict among the batch sizes and the values that resolve them all;
    the token budget of a micro-batch must hold the longest sequence."""
    batch = config.batch
    conflicts = batch_conflicts(batch, data_parallel)
    if conflicts:
        together = " ".join(f"{key}={value}" for key, value in consistent_batch(batch, data_parallel).items())
        if len(conflicts) == 1:
            key, problem = conflicts[0]
            raise ConfigError(key, f"{problem}; or set together, so that every batch-size rule holds: {together}")
        listed = "\n".join(f"  {key}: {problem}" for key, problem in conflicts)
        raise ConfigError(conflicts[0][0], f"{len(conflicts)} batch-size conflicts:\n{listed}\nset together, so "
                          f"that every batch-size rule holds: {together}")
    budget, (longest, bound) = batch.micro_batch_tokens_per_rank, longest_sequence(config)
    if 0 < budget < longest:
        raise ConfigError(
            "batch.micro_batch_tokens_per_rank",
            f"{budget} tokens cannot hold one sequence of up to {longest} = {bound}; use at least {longest} "
            f"(a few sequences' worth, e.g. {4 * longest}), or 0 to size micro-batches by sequences",
        )
