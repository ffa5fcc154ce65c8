"""Bundled tasks and their rewards, the GSM8K loader and extraction, the cost rule, and PromptSource resume."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest

from hybridflow_lab.models.tokenizers import CHARACTERS
from hybridflow_lab.tasks import (
    ANSWER_MODES,
    TASKS,
    ArithmeticTask,
    CountdownTask,
    Example,
    PromptSource,
    SortingTask,
    WordProblemTask,
    answer_score,
    digit_cost,
    evaluation_side,
    exact_match,
    extract_answer,
    gsm8k_reward,
    held_out,
    integer_format_score,
    load_gsm8k,
    make_task,
    parse_expression,
    split_examples,
    worked_examples,
)
from hybridflow_lab.tasks.calculator import CalculatorTask
from hybridflow_lab.tasks.countdown import BadExpression, parse_prompt, solve

DATA = Path(__file__).parent / "data"


class ScriptedRandom(random.Random):
    """An rng whose ``randrange`` and ``choice`` return scripted values, for examples worked out by hand."""

    def __init__(self, numbers: list[int], choices: str) -> None:
        super().__init__(0)
        self.numbers, self.choices = list(numbers), list(choices)

    def randrange(self, stop: int) -> int:  # type: ignore[override]
        value = self.numbers.pop(0)
        assert 0 <= value < stop
        return value

    def choice(self, seq: str) -> str:  # type: ignore[override]
        value = self.choices.pop(0)
        assert value in seq
        return value


# ---- arithmetic ----

@pytest.mark.parametrize(("numbers", "op", "prompt", "answer"), [
    ([12, 34], "+", "12+34=", "46"),
    ([7, 25], "-", "7-25=", "-18"),
    ([40, 8], "-", "40-8=", "32"),
    ([99, 99], "*", "99*99=", "9801"),
    ([0, 63], "*", "0*63=", "0"),
])
def test_arithmetic_examples_by_hand(numbers, op, prompt, answer):
    example = ArithmeticTask(operators="+-*").sample(ScriptedRandom(numbers, op))
    assert example == Example(prompt, answer, "arithmetic")
    assert ArithmeticTask().demonstration(example) == answer


def test_arithmetic_seeded_samples_are_fixed_and_correct():
    task = ArithmeticTask(operators="+-*")
    assert [task.sample(random.Random(i)).prompt for i in range(3)] == ["49-97=", "17+72=", "7+11="]
    for i in range(300):
        example = task.sample(random.Random(i))
        left, op, right = re.fullmatch(r"(\d{1,2})([-+*])(\d{1,2})=", example.prompt).groups()
        expected = {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}[op]
        assert example.answer == str(expected)
        assert example == task.sample(random.Random(i))


def test_arithmetic_operands_cover_the_digit_range_and_only_the_given_operators():
    task = ArithmeticTask(digits=1, operators="-")
    rng = random.Random(3)
    prompts = [task.sample(rng).prompt for _ in range(500)]
    operands = {int(p[0]) for p in prompts} | {int(p[2]) for p in prompts}
    assert operands == set(range(10))
    assert all(p[1] == "-" for p in prompts)
    assert any(task.sample(random.Random(i)).answer.startswith("-") for i in range(50))


@pytest.mark.parametrize("kwargs", [{"digits": 0}, {"operators": ""}, {"operators": "+/"}])
def test_arithmetic_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)


@pytest.mark.parametrize(("response", "score"), [
    ("46", 1.0), ("46 ", 1.0), ("\n46", 1.0), ("47", 0.1), ("-46", 0.1), ("4x", 0.0), ("", 0.0), ("4 6", 0.0),
])
def test_arithmetic_reward(response, score):
    assert ArithmeticTask().reward("12+34=", response, "46") == score
    assert integer_format_score(response, "46") == score


def test_exact_match_and_format_credit():
    assert exact_match(" 46\n", "46") == 1.0
    assert exact_match("047", "47") == 0.0
    assert integer_format_score("5", "-5", format_credit=0.25) == 0.25


# ---- sorting ----

def test_sorting_examples():
    task = SortingTask()
    example = task.sample(ScriptedRandom([], "3142"))
    assert example == Example("sort:3142=", "1234", "sorting")
    assert task.demonstration(example) == "1234"
    for i in range(100):
        example = task.sample(random.Random(i))
        text = example.prompt.removeprefix("sort:").removesuffix("=")
        assert len(text) == 4 and example.answer == "".join(sorted(text))
    letters = SortingTask(length=6, alphabet="abc").sample(random.Random(1))
    assert re.fullmatch(r"sort:[abc]{6}=", letters.prompt) and len(letters.answer) == 6


@pytest.mark.parametrize(("response", "score"), [
    ("1234", 1.0), (" 1234\n", 1.0),
    ("1243", 0.25),  # a rearrangement with 2 of 4 places right: 0.5 * 2/4
    ("2134", 0.25), ("1324", 0.25), ("3142", 0.0),  # no place right
    ("1233", 0.0), ("123", 0.0), ("12345", 0.0), ("abcd", 0.0),
])
def test_sorting_reward_and_partial_credit(response, score):
    assert SortingTask().reward("sort:3142=", response, "1234") == score


def test_sorting_partial_credit_with_repeated_characters():
    assert SortingTask().reward("sort:2101=", "1102", "0112") == pytest.approx(0.5 * 2 / 4)


@pytest.mark.parametrize(("response", "score"), [
    ("13449999", 1.0),
    ("13444999", 0.5 * 7 / 8),  # one 9 too few, one 4 too many: not a rearrangement, most places right
    ("99999999", 0.5 * 4 / 8), ("1344999", 0.0), ("134499999", 0.0),  # the wrong length earns nothing
])
def test_sorting_digit_credit_counts_matching_places_of_any_answer_of_the_right_length(response, score):
    task = SortingTask(length=8, partial_credit="digits")
    assert task.reward("sort:99914394=", response, "13449999") == pytest.approx(score)
    assert SortingTask(length=8).reward("sort:99914394=", "13444999", "13449999") == 0.0  # "format" credit: none


@pytest.mark.parametrize("kwargs", [{"length": 0}, {"alphabet": ""}, {"partial_credit": "half"}])
def test_sorting_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        SortingTask(**kwargs)


# ---- countdown ----

@pytest.mark.parametrize(("text", "value", "numbers"), [
    ("3*5+7", 22, [3, 5, 7]), ("3+5*7", 38, [3, 5, 7]), ("(3+5)*7", 56, [3, 5, 7]), ("7-(5-3)", 5, [7, 5, 3]),
    ("8/3*3", 8, [8, 3, 3]), ("10 - 2 / 4", Fraction(19, 2), [10, 2, 4]), ("((2))", 2, [2]),
])
def test_countdown_expressions_follow_the_usual_precedence_exactly(text, value, numbers):
    assert parse_expression(text) == (value, numbers)


@pytest.mark.parametrize(("text", "problem"), [
    ("3*(5+7", "unclosed parenthesis"), ("3+", "ends too early"), ("-3+5", "'-' where a number belongs"),
    ("3 5", "'5' after a complete expression"), ("__import__('os')", "'_' where a number belongs"),
    ("2**10", "'*' where a number belongs"), ("7/(3-3)", "divides by zero"), ("", "ends too early"),
    ("1e9", "'e' after a complete expression"),
])
def test_countdown_rejects_what_is_not_an_expression_without_evaluating_it(text, problem):
    with pytest.raises(BadExpression, match=re.escape(problem)):
        parse_expression(text)


@pytest.mark.parametrize(("response", "score"), [
    ("3*5+7", 1.0), ("7+5*3", 1.0), (" 5*3+7 ", 1.0),  # any order, spaces
    ("3+5+7", 0.1), ("(3+5)*7", 0.1),  # the right numbers, the wrong value: format credit
    ("3*5+7+0", 0.0), ("15+7", 0.0), ("3*5", 0.0), ("3*5+7=22", 0.0), ("22", 0.0),  # other numbers or text
    ("7/(5-5)+3", 0.0), ("import os", 0.0),
])
def test_countdown_reward(response, score):
    assert CountdownTask().reward("cd:3,5,7>22=", response, "22") == score


def test_countdown_puzzles_are_seeded_solvable_and_their_demonstrations_score_one():
    task = CountdownTask(numbers=3, digits=1, operators="+-*/")
    examples = [task.sample(random.Random(f"0:{i}")) for i in range(100)]
    assert examples == [task.sample(random.Random(f"0:{i}")) for i in range(100)]
    for example in examples:
        numbers, target = parse_prompt(example.prompt)
        assert len(numbers) == 3 and all(1 <= n <= 9 for n in numbers) and target > 0
        assert example.answer == str(target)
        assert task.reward(example.prompt, task.demonstration(example), example.answer) == 1.0
    assert solve([3, 5, 7], 22) == "3*5+7" and solve([2, 2], 5) is None


@pytest.mark.parametrize("kwargs", [{"numbers": 1}, {"digits": 0}, {"operators": "+%"}, {"operators": ""}])
def test_countdown_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CountdownTask(**kwargs)


# ---- registry and tokenizer characters ----

def test_registry():
    assert set(TASKS) == {"arithmetic", "calculator", "countdown", "reasoning_gym", "sorting", "word_problems"}
    assert make_task("arithmetic", operators="+-") == ArithmeticTask(operators="+-")
    assert make_task("sorting", length=3) == SortingTask(length=3)
    assert make_task("countdown", numbers=4) == CountdownTask(numbers=4)
    assert make_task("word_problems", operations=3) == WordProblemTask(operations=3)
    assert make_task("calculator", digits=2) == CalculatorTask(digits=2)
    with pytest.raises(ValueError, match="known tasks: arithmetic, calculator, countdown, reasoning_gym, sorting, wo"):
        make_task("chess")


@pytest.mark.parametrize("task", [
    ArithmeticTask(digits=3, operators="+-*"), SortingTask(), SortingTask(length=5, alphabet="zyxabc"),
    CountdownTask(numbers=4, digits=2, operators="+-*/"), WordProblemTask(operations=3),
])
def test_prompts_and_answers_use_only_tokenizer_characters(task):
    allowed = set(CHARACTERS)
    rng = random.Random(0)
    for _ in range(200):
        example = task.sample(rng)
        assert set(example.prompt + task.demonstration(example)) <= allowed, example


# ---- GSM8K ----

SAMPLE_TRUTHS = ["12", "1234", "6", "33", "21", "-5"]


def test_load_gsm8k_jsonl():
    examples = load_gsm8k(DATA / "gsm8k_sample.jsonl")
    assert [e.answer for e in examples] == SAMPLE_TRUTHS
    assert examples[0] == Example(
        "Tom has 3 bags with 4 apples in each bag. How many apples does Tom have?", "12", "gsm8k")


def test_load_gsm8k_parquet_matches_jsonl(tmp_path):
    parquet = tmp_path / "gsm8k_sample.parquet"
    pd.read_json(DATA / "gsm8k_sample.jsonl", lines=True).to_parquet(parquet)
    assert load_gsm8k(parquet) == load_gsm8k(str(DATA / "gsm8k_sample.jsonl"))


def test_load_gsm8k_bad_row_names_file_and_row():
    with pytest.raises(ValueError, match=r"gsm8k_bad\.jsonl, row 3: 'answer' has no '#### <number>'"):
        load_gsm8k(DATA / "gsm8k_bad.jsonl")


@pytest.mark.parametrize(("line", "problem"), [
    ('{"question": "q", "answer": "#### 4"', "invalid JSON"),
    ('{"question": "q"}', "'answer' is missing"),
    ('{"question": 3, "answer": "#### 4"}', "'question' is not a string"),
    ('["q", "#### 4"]', "expected an object"),
    ('{"question": "q", "answer": "#### four"}', "'answer' has no '#### <number>'"),
    ('{"question": "q", "answer": "\\\\boxed{4}"}', "'answer' has no '#### <number>'"),  # models' format, not data's
])
def test_load_gsm8k_malformed_rows(tmp_path, line, problem):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "x\n#### 1"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"rows\.jsonl, row 3: {re.escape(problem)}"):
        load_gsm8k(path)


def test_load_gsm8k_parquet_missing_column(tmp_path):
    path = tmp_path / "noanswer.parquet"
    pd.DataFrame({"question": ["q1", "q2"]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"noanswer\.parquet, row 1: 'answer' is missing"):
        load_gsm8k(path)


def test_load_gsm8k_unsupported_suffix(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"data\.csv.*\.jsonl, \.parquet"):
        load_gsm8k(path)


def test_load_gsm8k_reads_the_first_hashes_of_the_answer_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": "q", "answer": "48/2 = <<48/2=24>>24 clips\n48+24 = <<48+24=72>>72\n#### 72"},
            {"question": "q", "answer": "so \\boxed{5}\n#### 1,250\n#### 9"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [e.answer for e in load_gsm8k(path)] == ["72", "1250"]


@pytest.mark.parametrize(("text", "strict", "lenient"), [
    ("so 5 + 7 = 12\n#### 12", "12", "12"),
    ("#### 1,234", "1234", "1234"),
    ("The answer is 1,234.", None, "1234"),
    ("#### 8\nbut then 9", "8", "8"),  # a marked answer wins over later numbers
    ("4-9=-5 degrees", None, "-5"),
    ("####-3.50", "-3.50", "-3.50"),
    ("##### 9", "9", "9"),
    ("no number here", None, None),
    ("", None, None),
    ("#### twelve", None, None),
    ("so the answer is $\\boxed{42}$.", "42", "42"),
    ("\\boxed{ 1,234 }", "1234", "1234"),
    ("\\boxed{-3.5} and then 7", "-3.5", "-3.5"),
    ("Adding 3 gives \\boxed{x+1}", None, "1"),  # not a number: no strict answer
    ("\\boxed{\\frac{1}{2}}", "1/2", "1/2"),  # math-verify reads the LaTeX value (was: no strict answer)
    ("\\boxed{} 4", None, "4"),
    (" 42.\n", "42", "42"),  # the bare number as the whole answer ("answer with the number only")
    ("-7", "-7", "-7"),
    ("42 apples", None, "42"),
])
def test_extract_answer_strict_and_lenient(text, strict, lenient):
    assert extract_answer(text) == strict
    assert extract_answer(text, mode="strict") == strict
    assert extract_answer(text, mode="lenient") == lenient


@pytest.mark.parametrize(("text", "strict", "lenient"), [
    ("#### 5 ... no wait\n#### 7", "7", "7"),
    ("\\boxed{5}, or rather #### 7", "7", "7"),
    ("#### 5, so \\boxed{7} in all", "7", "7"),
    ("#### 5, so \\boxed{n}", None, "5"),  # the last mark decides, and it holds no number
    ("\\boxed{5} then #### six", None, "5"),
])
def test_extract_answer_takes_the_last_marked_answer(text, strict, lenient):
    assert (extract_answer(text, "strict"), extract_answer(text, "lenient")) == (strict, lenient)


def test_math_verify_scores_a_boxed_latex_value_and_compares_answers_as_values():
    assert gsm8k_reward("q", "so \\boxed{\\frac{84}{2}}", "42", mode="strict") == 1.0
    assert gsm8k_reward("q", "\\boxed{\\dfrac{1}{2}}", "0.5", mode="strict") == 1.0
    assert gsm8k_reward("q", "#### 0.50", "0.5", mode="strict") == 1.0
    assert gsm8k_reward("q", "\\boxed{\\frac{1}{3}}", "0.33", mode="strict") == 0.0


def test_extract_answer_rejects_unknown_mode():
    assert ANSWER_MODES == ("strict", "lenient")
    with pytest.raises(ValueError, match="'strict', 'lenient', got 'flexible'"):
        extract_answer("#### 1", mode="flexible")


def test_gsm8k_reward():
    assert gsm8k_reward("q", "It is 42.", "42") == 1.0
    assert gsm8k_reward("q", "#### 42.0", "42") == 1.0
    assert gsm8k_reward("q", "#### 1,234", "1234") == 1.0
    assert gsm8k_reward("q", "\\boxed{42}", "42", mode="strict") == 1.0
    assert gsm8k_reward("q", "It is 42.", "42", mode="strict") == 0.0
    assert gsm8k_reward("q", "#### 42 and later 7", "42", mode="strict") == 1.0
    assert gsm8k_reward("q", "#### 42 and later 7", "42") == 1.0
    assert gsm8k_reward("q", "#### 7 and later 42", "42") == 0.0
    assert gsm8k_reward("q", "no idea", "42") == 0.0


@pytest.mark.parametrize(("response", "score"), [
    ("#### 42", 1.0), ("so \\boxed{42.0}", 1.0), ("#### 41\n#### 42", 1.0),
    ("It is 42.", 0.3), ("\\boxed{x} so 42", 0.3),  # the right number without a declared format
    ("#### 41", 0.1), ("\\boxed{41}, not 42", 0.1),  # a wrong answer in a declared format
    ("It is 41.", 0.0), ("no idea", 0.0), ("", 0.0),
])
def test_answer_score_credits_format_and_number_apart(response, score):
    assert answer_score(response, "42", unformatted_credit=0.3, format_credit=0.1) == score
    assert answer_score(response, "42.00") == (1.0 if score == 1.0 else 0.0)


# ---- word problems ----

WORD_PROBLEM_TASK = WordProblemTask(operations=3)
EQUATION = re.compile(r"(\d+(?: [-+*/] \d+)+) = (\d+)\.")
STEP_OPERATORS = {"more": ["+"], "away": ["-"], "loses": ["-"], "eats": ["-"], "buys": ["+", "*"], "shares": ["/"]}


def _equations(demonstration: str) -> list[tuple[str, int]]:
    return [(m[1], int(m[2])) for line in demonstration.splitlines() if (m := EQUATION.search(line))]


def test_word_problems_are_seeded():
    examples = [WORD_PROBLEM_TASK.sample(random.Random(f"0:{i}")) for i in range(50)]
    assert examples == [WORD_PROBLEM_TASK.sample(random.Random(f"0:{i}")) for i in range(50)]
    assert WordProblemTask().sample(random.Random(2)) == Example(
        "Mia has 4 marbles. A friend gives Mia 10 more. Mia gives 10 away. How many marbles does Mia have now?",
        "4", "word_problems")


@pytest.mark.parametrize("operations", [1, 2, 3])
def test_word_problems_vary_and_use_every_step_count(operations):
    rng = random.Random(operations)
    examples = [WordProblemTask(operations=operations).sample(rng) for _ in range(200)]
    assert len({e.prompt for e in examples}) >= 150
    demonstrations = [WordProblemTask().demonstration(e) for e in examples]
    assert {len(_equations(d)) for d in demonstrations} == set(range(1, operations + 1))
    assert {w for d in demonstrations for w in STEP_OPERATORS if w in d} == set(STEP_OPERATORS)


def test_word_problem_answers_follow_from_the_prompts_by_the_demonstrations_equations():
    rng = random.Random(7)
    for _ in range(500):
        example = WORD_PROBLEM_TASK.sample(rng)
        demonstration = WORD_PROBLEM_TASK.demonstration(example)
        sentences = example.prompt.split(". ")
        equations = _equations(demonstration)
        assert re.fullmatch(r"\d+", example.answer) and len(example.prompt.split()) < 60, example
        assert example.prompt.endswith("?") and sentences[-1].startswith("How many")
        assert len(equations) == len(sentences) - 2  # one per sentence between the start and the question
        count, given = int(re.findall(r"\d+", example.prompt)[0]), []
        for sentence, (left, right) in zip(sentences[1:-1], equations, strict=True):
            value, operands = parse_expression(left)
            assert value == right >= 0 and operands[0] == count
            assert re.findall(r"[-+*/]", left) == next(ops for word, ops in STEP_OPERATORS.items() if word in sentence)
            count, given = right, given + operands[1:]
        assert [int(n) for n in re.findall(r"\d+", example.prompt)[1:]] == given  # every number from the prompt
        assert str(count) == example.answer
        assert demonstration.endswith(f"\n#### {example.answer}")
        assert extract_answer(demonstration, "strict") == example.answer
        assert WORD_PROBLEM_TASK.reward(example.prompt, demonstration, example.answer) == 1.0


@pytest.mark.parametrize(("response", "plain", "credited"), [
    ("#### 4", 1.0, 1.0), ("The answer is \\boxed{4}.", 1.0, 1.0),
    ("Mia has 4 marbles now.", 0.0, 0.25), ("#### 5", 0.0, 0.05), ("I do not know.", 0.0, 0.0),
])
def test_word_problem_reward_credits(response, plain, credited):
    example = WordProblemTask().sample(random.Random(2))
    assert example.answer == "4"
    assert WordProblemTask().reward(example.prompt, response, example.answer) == plain
    credits = WordProblemTask(unformatted_credit=0.25, format_credit=0.05)
    assert credits.reward(example.prompt, response, example.answer) == credited


@pytest.mark.parametrize("prompt", [
    "Tom has 3 bags with 4 apples in each bag. How many apples does Tom have?",
    "Mia has 4 marbles. How many marbles does Mia have now?",
    "Mia has 4 marbles. Noah gets 2 more. How many marbles does Mia have now?",
    "Mia has 04 marbles. Mia gets 2 more. How many marbles does Mia have now?",
    "Mia has 4 marbles. Mia gives 9 away. How many marbles does Mia have now?",
    "Mia has 4 marbles. Mia shares them equally among 3 friends. How many marbles does each friend get?",
])
def test_word_problem_demonstration_rejects_prompts_the_task_does_not_write(prompt):
    with pytest.raises(ValueError):
        WordProblemTask().demonstration(Example(prompt, "0", "word_problems"))


@pytest.mark.parametrize(("kwargs", "setting"), [
    ({"operations": 0}, "operations"), ({"operations": 4}, "operations"), ({"max_value": 1}, "max_value"),
    ({"unformatted_credit": -0.1}, "unformatted_credit"), ({"format_credit": 1.5}, "format_credit"),
])
def test_word_problems_reject_bad_settings_naming_the_setting_first(kwargs, setting):
    with pytest.raises(ValueError, match=rf"^{setting} must be"):
        WordProblemTask(**kwargs)


# ---- cost ----

def test_digit_cost():
    assert digit_cost("3+4=", "7", "7") == 1.0
    assert digit_cost("50+20=", "70", "70") == 1.0
    assert digit_cost("3+3=", "6", "6") == 0.0
    assert digit_cost("3+3=", "", "6") == 0.0
    assert digit_cost("3+3=", "68", "6", forbidden="89") == 1.0


# ---- PromptSource ----

def test_task_source_is_a_function_of_seed_and_index():
    task = ArithmeticTask(operators="+-*")
    source = PromptSource(task, seed=5)
    batches = [source.next_batch(4) for _ in range(3)]
    assert [e for batch in batches for e in batch] == [task.sample(random.Random(f"5:{i}")) for i in range(12)]
    assert PromptSource(task, seed=5).next_batch(12) == [e for batch in batches for e in batch]
    assert PromptSource(task, seed=6).next_batch(12) != PromptSource(task, seed=5).next_batch(12)
    assert source.next_batch(0) == []
    with pytest.raises(ValueError):
        source.next_batch(-1)


@pytest.mark.parametrize("make", [
    lambda: SortingTask(),
    lambda: [Example(f"q{i}", str(i), "toy") for i in range(7)],  # batches of 3 cross epoch ends
])
def test_source_resumes_from_state(make):
    original = PromptSource(make(), seed=11)
    original.next_batch(3)
    state = original.state_dict()
    expected = [original.next_batch(3), original.next_batch(3)]

    assert all(isinstance(v, int | str) for v in state.values())
    resumed = PromptSource(make(), seed=999)  # the saved seed wins
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [resumed.next_batch(3), resumed.next_batch(3)] == expected
    assert PromptSource(make(), seed=11).next_batch(9)[3:] == expected[0] + expected[1]


def test_source_rejects_a_state_from_another_source():
    examples = [Example(f"q{i}", str(i), "toy") for i in range(5)]
    with pytest.raises(ValueError, match="different source"):
        PromptSource(examples, seed=0).load_state_dict(PromptSource(SortingTask(), seed=0).state_dict())
    with pytest.raises(ValueError, match="different source"):
        PromptSource(examples[:4], seed=0).load_state_dict(PromptSource(examples, seed=0).state_dict())


def test_dataset_source_reshuffles_each_epoch():
    examples = [Example(f"q{i}", str(i), "toy") for i in range(20)]
    source = PromptSource(examples, seed=3)
    epochs = [source.next_batch(20) for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch, key=lambda e: int(e.answer)) == examples  # every example once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != examples
    assert PromptSource(examples, seed=4).next_batch(20) != epochs[0]
    with pytest.raises(ValueError):
        PromptSource([], seed=0)


def test_held_out_is_fixed_and_apart_from_training():
    task = ArithmeticTask(digits=6, operators="+-*")  # 3e12 problems: only a shared seed would repeat one
    evaluation = held_out(task, 200, seed=0)
    assert evaluation == held_out(task, 200, seed=0)
    assert len({e.prompt for e in evaluation}) == 200
    training = {e.prompt for e in PromptSource(task, seed=0).next_batch(1000)}
    assert training.isdisjoint(e.prompt for e in evaluation)


def test_word_problems_hold_out_computations_that_training_never_sees():
    task = WordProblemTask(operations=1, max_value=10)  # the real-model demo's: a few hundred computations
    evaluation = held_out(task, 64, seed=0)
    assert evaluation == held_out(task, 64, seed=0)
    held = {task.computation(e) for e in evaluation}
    training = PromptSource(task, seed=0).next_batch(3000)
    trained = {task.computation(e) for e in training}
    assert held.isdisjoint(trained) and len(trained) > 100  # told in other words or not, never trained on
    assert {(e.prompt, e.answer) for e in evaluation}.isdisjoint((e.prompt, e.answer) for e in training)
    stories = [e for e in training if task.computation(e) == task.computation(training[0])]
    assert len({e.prompt for e in stories}) > 1  # one computation, many ways of telling it, all on one side
    assert all(evaluation_side(task, e) is False for e in training[:200])
    shots = worked_examples(task, 4, seed=0)
    assert held.isdisjoint(task.computation(Example(prompt, "", task.name)) for prompt, _ in shots)
    arithmetic = ArithmeticTask()
    assert evaluation_side(arithmetic, arithmetic.sample(random.Random(0))) is None  # no computations, no split


def test_split_examples():
    examples = [Example(f"q{i}", str(i), "toy") for i in range(10)]
    train, evaluation = split_examples(examples, 0.3, seed=1)
    assert len(train) == 7 and len(evaluation) == 3
    assert sorted(train + evaluation, key=lambda e: int(e.answer)) == examples
    assert train == sorted(train, key=lambda e: int(e.answer))
    assert (train, evaluation) == split_examples(examples, 0.3, seed=1)
    assert split_examples(examples, 0.3, seed=2) != (train, evaluation)
    for fraction in (0.0, 0.01, 1.0):
        with pytest.raises(ValueError, match="empty split"):
            split_examples(examples, fraction, seed=1)


def test_digit_score_credits_matching_columns():
    from hybridflow_lab.tasks.rewards import digit_score

    assert digit_score("46", "46") == 1.0
    assert digit_score("47", "46") == pytest.approx(0.1 + 0.5 * 0.5)  # tens digit right
    assert digit_score("146", "46") == pytest.approx(0.1 + 0.5 * 2 / 3)  # aligned from the right
    assert digit_score("4x", "46") == 0.0
    task = ArithmeticTask(partial_credit="digits")
    assert task.reward("12+34=", "47", "46") == pytest.approx(0.35)
    with pytest.raises(ValueError, match="partial_credit"):
        ArithmeticTask(partial_credit="half")


def test_a_reasoning_gym_generator_is_scored_by_reasoning_gyms_own_scorer():
    import reasoning_gym

    task = make_task("reasoning_gym", dataset="countdown")
    example = task.sample(random.Random(3))
    entry = task.entry(json.loads(example.answer)["index"])
    assert example.prompt.startswith(entry["question"]) and "<answer>" in example.prompt
    assert task.reward(example.prompt, "think... " + task.demonstration(example), example.answer) == 1.0
    scorer = reasoning_gym.create_dataset("countdown", seed=0, size=10)
    for guess in ("1 + 2", "", "not an expression"):  # partial credit and none, as reasoning-gym grants it
        expected = scorer.score_answer(guess, entry)
        assert task.reward(example.prompt, f"<answer>{guess}</answer>", example.answer) == expected
    assert task.reward(example.prompt, "no tags", example.answer) == scorer.score_answer(None, entry)


def test_reasoning_gym_held_out_questions_come_from_their_own_seed_and_are_never_trained_on():
    task = make_task("reasoning_gym", dataset="chain_sum", options={"min_terms": 2, "max_terms": 2,
                                                                     "min_digits": 1, "max_digits": 1})
    training = {example.prompt for example in PromptSource(task, seed=0).next_batch(400)}
    evaluation = held_out(task, 40, seed=0)
    assert len({example.prompt for example in evaluation}) > 20  # a small space (1-digit pairs), still varied
    assert not training & {example.prompt for example in evaluation}
