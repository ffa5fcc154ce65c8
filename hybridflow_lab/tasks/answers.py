"""Final numeric answers in model text: a declared format (``#### n``, ``\\boxed{n}``, or the bare number as the
whole answer) or, leniently, the last number.

A text's final answer is its last marked one: a model that writes ``#### 5`` and later ``#### 7`` answered 7,
as a reader who takes the last word for the answer would. If that last mark holds no number (``\\boxed{x+1}``),
the text has no strict answer, even when an earlier mark held one. A boxed LaTeX value (``\\boxed{\\frac{1}{2}}``)
is read by math-verify (the checker TRL and Open-R1 use), which also decides whether two answers are equal.
"""

from __future__ import annotations

import re

ANSWER_MODES = ("strict", "lenient")
NUMBER = r"(?:(?<!\d)-)?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?"  # "4-9" is 4 and 9; "=-5" is -5
_MARK = re.compile(r"#{4,}|\\boxed\{")
_AFTER_HASHES = re.compile(rf"\s*({NUMBER})")
_BOXED_NUMBER = re.compile(rf"\s*({NUMBER})\s*\}}")
_ANY_NUMBER = re.compile(NUMBER)
_BARE_NUMBER = re.compile(rf"\s*({NUMBER})\.?\s*")  # "Answer with the number only." answered: "42" or "42."


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer in ``text`` without thousands separators, or None if there is none.

    ``strict``: the number in the last marked answer (after ``####``, or alone in ``\\boxed{...}``), or the whole
    text when it is one number (a prompt that asks for the number only, answered so);
    ``lenient``: the strict answer if there is one, else the last number anywhere.
    """
    if mode not in ANSWER_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, ANSWER_MODES))}, got {mode!r}")
    bare = _BARE_NUMBER.fullmatch(text)
    found = bare.group(1) if bare else _marked_number(text)
    if found is None and mode == "lenient":
        numbers = _ANY_NUMBER.findall(text)
        found = numbers[-1] if numbers else None
    return found.replace(",", "") if found is not None else None


def same_number(found: str | None, truth: str) -> bool:
    """Whether the extracted answer ``found`` equals ``truth`` as a value, by math-verify ("42" == "42.0",
    "1/2" == "0.5")."""
    if found is None:
        return False
    from math_verify import verify

    return verify(_math_value(truth.replace(",", "")), _math_value(found), timeout_seconds=None)


def answer_score(response: str, truth: str, *, unformatted_credit: float = 0.0, format_credit: float = 0.0) -> float:
    """1.0 for the right answer in a declared format; ``unformatted_credit`` for the right number without one
    (the lenient answer is right); ``format_credit`` for a wrong answer in a declared format; else 0.0."""
    marked = extract_answer(response, "strict")
    if marked is not None:
        return 1.0 if same_number(marked, truth) else format_credit
    return unformatted_credit if same_number(extract_answer(response, "lenient"), truth) else 0.0


def _marked_number(text: str) -> str | None:
    """The number held by the last mark in ``text`` (with its separators), or None."""
    marks = list(_MARK.finditer(text))
    if not marks:
        return None
    last = marks[-1]
    if last.group().startswith("#"):
        match = _AFTER_HASHES.match(text, last.end())
        return match.group(1) if match else None
    number = _BOXED_NUMBER.match(text, last.end())
    return number.group(1) if number else _boxed_value(text, last.end())


def _boxed_value(text: str, start: int) -> str | None:
    """The number a ``\\boxed{...}`` whose content starts at ``start`` holds in LaTeX (``\\frac{1}{2}`` -> ``1/2``),
    read by math-verify; None when the braces do not close or the content is not a number."""
    depth = 1
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            break
    else:
        return None
    values = _math_value(f"${text[start:end]}$", latex=True)
    return str(values[0]) if values and getattr(values[0], "is_number", False) else None


def _math_value(text: str, latex: bool = False) -> list:
    """math-verify's parse of ``text``: a plain number or expression, or (``latex``) LaTeX math. Its signal-based
    timeout is off: rewards may run outside the main thread (task.reward_timeout_s bounds a slow rule)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig()] if latex else [ExprExtractionConfig()]
    return parse(text, extraction_config=config, parsing_timeout=None)
