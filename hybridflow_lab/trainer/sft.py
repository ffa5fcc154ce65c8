"""Supervised warm start: train a model on a task's demonstrations so RL starts from non-zero reward."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from hybridflow_lab.agents import ObservationRenderer, Trajectory, Turn, trajectories_batch
from hybridflow_lab.agents.call_formats import CALL_FORMATS, CallFormat
from hybridflow_lab.config import OptimConfig
from hybridflow_lab.engines.forward import count_response_tokens, response_nll
from hybridflow_lab.engines.torch_engine import TorchEngine
from hybridflow_lab.engines.torch_rollout import sequences_batch
from hybridflow_lab.models import load_causal_lm, save_model_dir
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.protocol import DataBatch
from hybridflow_lab.tasks import Example, PromptSource, Task
from hybridflow_lab.tasks.prompts import RAW, PromptFormat, encode_prompts, has_chat_template

PLAIN = CALL_FORMATS["plain"]


def demonstration_batch(tokenizer: PreTrainedTokenizerBase, task: Task, examples: list[Example],
                        prompt_format: PromptFormat = RAW, call_format: CallFormat = PLAIN) -> DataBatch:
    """Prompts rendered by ``prompt_format`` and left-padded, demonstrations + EOS (a chat model's end of turn)
    right-padded, in the layout training reads. A task with tools demonstrates whole exchanges (``episode``): the
    tool's answers, in ``call_format``, are context the loss does not train on."""
    if hasattr(task, "episode"):
        return episode_batch(tokenizer, task, examples, prompt_format, call_format)
    prompts = encode_prompts(tokenizer, [e.prompt for e in examples], max_tokens=10_000, prompt_format=prompt_format)
    targets = [tokenizer(task.demonstration(e), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for e in examples]
    length = max(len(t) for t in targets)
    responses = torch.full((len(targets), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(targets), length, dtype=torch.long)
    for row, target in enumerate(targets):
        responses[row, : len(target)] = torch.tensor(target)
        mask[row, : len(target)] = 1
    out = {"prompt_ids": prompts["input_ids"], "prompt_mask": prompts["attention_mask"], "responses": responses,
           "response_mask": mask, "log_probs": torch.zeros(mask.shape)}
    return DataBatch(sequences_batch(out, tokenizer.pad_token_id))


def episode_batch(tokenizer: PreTrainedTokenizerBase, task: Task, examples: list[Example],
                  prompt_format: PromptFormat, call_format: CallFormat) -> DataBatch:
    """``task.episode(example)`` of each example as a trajectory: the policy's turns trained on, the answers between
    them rendered as a rollout renders them, in the voice of ``task.episode_role`` (default ``tool``). The last
    turn ends with EOS, and so does every turn a user answers (a whole answer, as in a feedback rollout); a turn a
    tool answers ends with its call."""
    renderer = ObservationRenderer(tokenizer, call_format, prompt_format.chat)
    role = getattr(task, "episode_role", "tool")
    trajectories = []
    for example in examples:
        prompt = prompt_format.render(tokenizer, [example.prompt])[0]
        trajectory = Trajectory(example, tokenizer(prompt, add_special_tokens=False)["input_ids"])
        for text, answer in task.episode(example):
            ends = answer is None or role == "user"
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if ends else [])
            turn = Turn(ids, [0.0] * len(ids), text)
            if answer is not None:
                turn.observation_text, turn.observation_ids = renderer.render(answer, role)
            trajectory.turns.append(turn)
        trajectories.append(trajectory)
    tensors, _ = trajectories_batch(trajectories, tokenizer.pad_token_id)
    return DataBatch(tensors)


LOSS_WINDOW = 10  # steps the final loss (and the early stop) averages over


def sft(model_dir: str | os.PathLike[str], task: Task, out_dir: str | os.PathLike[str], steps: int = 200,
        batch_size: int = 64, lr: float = 1e-3, seed: int = 0, target_loss: float = 0.0,
        prompt_format: PromptFormat | None = None, call_format: CallFormat = PLAIN) -> dict[str, float]:
    """Train on at most ``steps`` batches of fresh demonstrations, stopping early once the mean loss of the last
    ``LOSS_WINDOW`` steps is at most ``target_loss`` (> 0); save the model (and tokenizer) to ``out_dir``.

    Prompts are rendered as RL will render them: by ``prompt_format``, by default through the tokenizer's chat
    template when it has one (a Lab's default, ``task.chat_template``), so the model learns to answer the prompts
    it will be trained on next.

    The stop makes the start of RL the same whatever the seed or the CPU's float32 rounding: a fixed step count
    lands at different losses on different machines, a target loss at the same one.
    """
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    prompt_format = prompt_format or PromptFormat(chat=has_chat_template(tokenizer))
    engine = TorchEngine(model, OptimConfig(lr=lr, warmup_steps=min(20, steps // 10), schedule="cosine",
                                            total_steps=steps, min_lr_ratio=0.1))
    source = PromptSource(task, seed + 7919)  # a stream apart from the RL run's (same seed) prompts
    losses: list[float] = []
    while len(losses) < steps and not (target_loss > 0 and len(losses) >= LOSS_WINDOW
                                       and _recent_loss(losses) <= target_loss):
        batch = demonstration_batch(tokenizer, task, source.next_batch(batch_size), prompt_format, call_format)
        losses.append(engine.train_step([batch], response_nll, count_response_tokens)["loss"])
    save_model_dir(model, Path(out_dir), tokenizer)
    return {"sft/first_loss": losses[0], "sft/final_loss": _recent_loss(losses), "sft/steps": len(losses)}


def _recent_loss(losses: list[float]) -> float:
    return sum(losses[-LOSS_WINDOW:]) / len(losses[-LOSS_WINDOW:])
