"""Final numeric answers in model text: a declared format (``#### n``, ``\\boxed{n}``, or the bare number as the
whole answer) or, leniently, the last number.

A text's final answer is its last marked one: a model that writes ``#### 5`` and later ``#### 7`` answered 7,
as a reader who takes the last word for the answer would. If that last mark holds no number (``\\boxed{x+1}``),
the text has no strict answer, even when an earlier mark held one.
"""

from __future__ import annotations

import re
from decimal import Decimal

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
    """Whether the extracted answer ``found`` equals ``truth`` as a number ("42" == "42.0" == "42.00")."""
    return found is not None and Decimal(found) == Decimal(truth.replace(",", ""))


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
    content = _AFTER_HASHES if last.group().startswith("#") else _BOXED_NUMBER
    match = content.match(text, last.end())
    return match.group(1) if match else None
