"""The supervised warm start: demonstrations in the training layout, the loss going down, the stop at a target."""

from __future__ import annotations

import pytest
import torch

from hybridflow_lab.engines.forward import response_nll
from hybridflow_lab.models import create_model_dir, load_causal_lm
from hybridflow_lab.models.tokenizers import load_tokenizer
from hybridflow_lab.tasks import PromptSource, SortingTask
from hybridflow_lab.tasks.prompts import PromptFormat
from hybridflow_lab.trainer.sft import LOSS_WINDOW, demonstration_batch, sft
from tests.test_chat_prompts import chat_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return create_model_dir(tmp_path_factory.mktemp("sft") / "base", "tiny", "qwen2", seed=0)


def test_sft_lowers_the_loss_and_saves_a_loadable_model(base, tmp_path):
    metrics = sft(base, SortingTask(length=4), tmp_path / "out", steps=30, batch_size=16, lr=3e-3)
    assert metrics["sft/steps"] == 30 and metrics["sft/final_loss"] < 0.8 * metrics["sft/first_loss"]
    assert load_causal_lm(tmp_path / "out").config.vocab_size == load_causal_lm(base).config.vocab_size


def test_sft_stops_once_the_recent_loss_reaches_the_target(base, tmp_path):
    free = sft(base, SortingTask(length=4), tmp_path / "free", steps=60, batch_size=16, lr=3e-3)
    target = (free["sft/first_loss"] + free["sft/final_loss"]) / 2  # reached somewhere inside the 60 steps
    stopped = sft(base, SortingTask(length=4), tmp_path / "stopped", steps=60, batch_size=16, lr=3e-3,
                  target_loss=target)
    assert LOSS_WINDOW <= stopped["sft/steps"] < 60
    assert stopped["sft/final_loss"] <= target < free["sft/first_loss"]


def test_sft_trains_on_the_prompts_rl_renders_through_the_chat_template(tmp_path):
    task = SortingTask(length=4)
    base = create_model_dir(tmp_path / "base", "tiny", "qwen2", seed=0, tokenizer=chat_tokenizer())
    sft(base, task, tmp_path / "out", steps=30, batch_size=16, lr=3e-3)  # the chat template by default, as a Lab
    tokenizer, model = load_tokenizer(tmp_path / "out"), load_causal_lm(tmp_path / "out").eval()
    examples = PromptSource(task, seed=123).next_batch(32)
    chat = demonstration_batch(tokenizer, task, examples, PromptFormat(chat=True))
    first = tokenizer.decode(chat["prompts"][0], skip_special_tokens=True)  # the padding dropped
    assert first == f"<user>{examples[0].prompt}\n<assistant>"
    with torch.no_grad():
        chat_loss, _ = response_nll(model, chat)
        raw_loss, _ = response_nll(model, demonstration_batch(tokenizer, task, examples))
    assert chat_loss < 0.8 * raw_loss  # it learned to answer the templated prompts, not the raw ones
