"""Tasks: prompts, ground truths and their reward rules."""

from hybridflow_lab.tasks.answers import ANSWER_MODES, answer_score, extract_answer
from hybridflow_lab.tasks.arithmetic import ArithmeticTask
from hybridflow_lab.tasks.base import Example, Task
from hybridflow_lab.tasks.cost import digit_cost
from hybridflow_lab.tasks.countdown import CountdownTask, parse_expression
from hybridflow_lab.tasks.gsm8k import gsm8k_reward, load_gsm8k, load_gsm8k_rows
from hybridflow_lab.tasks.registry import TASKS, make_task
from hybridflow_lab.tasks.rewards import exact_match, integer_format_score, permutation_score
from hybridflow_lab.tasks.sorting import SortingTask
from hybridflow_lab.tasks.source import PromptSource, evaluation_side, held_out, split_examples, worked_examples
from hybridflow_lab.tasks.word_problems import WordProblemTask

__all__ = [
    "ANSWER_MODES",
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "Example",
    "PromptSource",
    "SortingTask",
    "Task",
    "WordProblemTask",
    "answer_score",
    "digit_cost",
    "evaluation_side",
    "exact_match",
    "extract_answer",
    "gsm8k_reward",
    "held_out",
    "integer_format_score",
    "load_gsm8k",
    "load_gsm8k_rows",
    "make_task",
    "parse_expression",
    "permutation_score",
    "split_examples",
    "worked_examples",
]
