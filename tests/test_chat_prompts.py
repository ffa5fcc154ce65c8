"""Prompts through the tokenizer's chat template: what the model reads, what rewards and ``lab.show`` see."""

from __future__ import annotations

import pytest

from hybridflow_lab.config import ConfigError
from hybridflow_lab.models import create_model_dir
from hybridflow_lab.models.tokenizers import char_tokenizer
from hybridflow_lab.tasks.prompts import PromptFormat, encode_prompts
from hybridflow_lab.trainer.lab import Lab
from tests.test_lab import local_overrides

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny model whose (character) tokenizer has a chat template."""
    return str(create_model_dir(tmp_path_factory.mktemp("chat") / "m", "tiny", "qwen2", seed=2,
                                tokenizer=chat_tokenizer()))


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return str(create_model_dir(tmp_path_factory.mktemp("plain") / "m", "tiny", "qwen2", seed=2))


def test_the_prompt_format_renders_a_system_and_a_user_turn():
    tokenizer = chat_tokenizer()
    assert PromptFormat(chat=True).render(tokenizer, ["1+2="]) == ["<user>1+2=\n<assistant>"]
    assert PromptFormat(chat=True, system_prompt="Be brief.").render(tokenizer, ["1+2="]) == \
        ["<system>Be brief.\n<user>1+2=\n<assistant>"]
    assert PromptFormat(system_prompt="Be brief.").render(tokenizer, ["1+2="]) == ["Be brief.\n1+2="]
    batch = encode_prompts(tokenizer, ["1+2="], 32, ["3"], prompt_format=PromptFormat(chat=True))
    assert tokenizer.decode(batch["input_ids"][0]) == "<user>1+2=\n<assistant>"
    assert list(batch["prompt_text"]) == ["1+2="]  # what reward functions get: the task's own prompt


def test_worked_examples_become_earlier_turns_or_lines():
    tokenizer = chat_tokenizer()
    shots = (("1+1=", "2"), ("2+2=", "4"))
    assert PromptFormat(chat=True, shots=shots).render(tokenizer, ["3+3="]) == \
        ["<user>1+1=\n<assistant>2\n<user>2+2=\n<assistant>4\n<user>3+3=\n<assistant>"]
    assert PromptFormat(system_prompt="Add.", shots=shots).render(tokenizer, ["3+3="]) == ["Add.\n1+1=2\n2+2=4\n3+3="]


def test_tools_reach_a_template_that_renders_them_and_a_description_reaches_one_that_does_not(chat_model,
                                                                                              tmp_path):
    from hybridflow_lab.agents import CALL_FORMATS, as_tool
    from hybridflow_lab.tasks.calculator import calc

    schema = as_tool(calc).schema
    described = PromptFormat(chat=True, tools=(schema,), tools_text="Call [calc expression].")
    tokenizer = chat_tokenizer()  # its template ignores tools=: the description is the system turn
    assert described.render(tokenizer, ["2*3="]) == ["<system>Call [calc expression].\n<user>2*3=\n<assistant>"]
    tokenizer.chat_template = "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}\n" \
                              "{% endif %}" + TEMPLATE  # renders them, as Qwen's does
    assert described.render(tokenizer, ["2*3="]) == ["<tools>calc\n<user>2*3=\n<assistant>"]
    assert PromptFormat(tools=(schema,), tools_text="Call it.").render(tokenizer, ["2*3="]) == ["Call it.\n2*3="]
    # a Lab whose task has tools describes them in its call format's words, unless agent.describe_tools=false
    lab = Lab("calculator_grpo", overrides=local_overrides(chat_model, tmp_path / "run", "task.digits=1",
                                                           "agent.describe_tools=true", "rollout.max_prompt_tokens=400",
                                                           "agent.max_tokens=48", "task.eval_size=2"), start=False)
    assert lab.task.prompt_format.tools_text == CALL_FORMATS["plain"].describe([schema])
    assert "[calc expression]: Evaluate an arithmetic expression" in lab.task.prompt_format.render(
        lab.tokenizer, ["2*3="])[0]


def test_few_shot_prompts_show_the_tasks_demonstrations_from_their_own_seed(chat_model, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(chat_model, tmp_path / "run", "task.few_shot=2",
                                                          "rollout.max_prompt_tokens=100"), start=False)
    shots = lab.task.prompt_format.shots
    assert len(shots) == 2 and all(lab.task.task.reward(p, a, a) == 1.0 for p, a in shots)  # demonstrations
    assert not {p for p, _ in shots} & {e.prompt for e in lab.task.eval_examples[:2]}
    batch = lab.next_prompts()
    assert lab.show(batch)["prompt"][0].startswith(f"<user>{shots[0][0]}\n<assistant>{shots[0][1]}\n")
    with pytest.raises(ConfigError, match=r"task\.few_shot: is 2; worked examples come from a bundled task's"):
        Lab("arithmetic_grpo", start=False, overrides=local_overrides(
            chat_model, tmp_path, "task.few_shot=2", "task.name=gsm8k",
            "task.dataset_path=tests/data/gsm8k_sample.jsonl"))


def test_a_lab_renders_prompts_with_the_template_by_default_and_shows_them(chat_model, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(chat_model, tmp_path / "run", "rollout.max_prompt_tokens=40",
                                                          "task.system_prompt=Answer."))
    try:
        assert lab.task.prompt_format == PromptFormat(chat=True, system_prompt="Answer.")
        batch = lab.reward(lab.generate(lab.next_prompts()))
        question = batch["prompt_text"][0]
        assert "<" not in question and question.endswith("=")  # the task's text, untouched
        frame = lab.show(batch, rows=2)
        assert frame["prompt"][0] == f"<system>Answer.\n<user>{question}\n<assistant>"
        assert all("<assistant>" not in text for text in batch["response_text"])  # the response alone
        assert lab.evaluate()["eval/accuracy"] >= 0.0
    finally:
        lab.shutdown()


def test_chat_template_false_keeps_the_raw_prompt(chat_model, tmp_path):
    lab = Lab("arithmetic_grpo", overrides=local_overrides(chat_model, tmp_path / "run", "task.chat_template=false"),
              start=False)
    assert lab.task.prompt_format == PromptFormat(chat=False)
    batch = lab.next_prompts()
    assert lab.show(batch)["prompt"].tolist() == list(batch["prompt_text"])


def test_forcing_a_chat_template_the_tokenizer_lacks_fails_before_start(plain_model, tmp_path):
    with pytest.raises(ConfigError, match=r"task\.chat_template: is true, but the tokenizer of .* has no chat "
                                          r"template .*set task\.chat_template=false"):
        Lab("arithmetic_grpo", overrides=local_overrides(plain_model, tmp_path, "task.chat_template=true"),
            start=False)


def test_a_prompt_too_long_once_templated_fails_before_start_naming_the_key(chat_model, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.max_prompt_tokens: .* tokens once rendered with the chat "
                                          r"template, more than rollout\.max_prompt_tokens=16 .*or shorten "
                                          r"task\.system_prompt"):
        Lab("arithmetic_grpo", overrides=local_overrides(chat_model, tmp_path, "rollout.max_prompt_tokens=16",
                                                         "task.system_prompt=Answer with the number."), start=False)


def test_prompt_and_response_budgets_beyond_the_models_context_fail_before_start(plain_model, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.max_prompt_tokens: rollout\.max_prompt_tokens \+ "
                                          r"rollout\.max_new_tokens \(8 \+ 2041\) is more than the 2048 positions"):
        Lab("arithmetic_grpo", overrides=local_overrides(plain_model, tmp_path, "rollout.max_new_tokens=2041"),
            start=False)
