"""GSM8K-format data (``question``, ``answer`` ending in ``#### <number>``) and its answer-matching reward."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

from hybridflow_lab.tasks.base import Example

DATA_SOURCE = "gsm8k"
SUFFIXES = (".jsonl", ".parquet")
_NUMBER = r"(?:(?<!\d)-)?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?"  # "4-9" is 4 and 9; "=-5" is -5
_STRICT = re.compile(rf"####\s*({_NUMBER})")
_ANY = re.compile(_NUMBER)


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer in ``text`` without thousands separators, or None if there is none.

    ``strict``: the number right after the first ``####``; ``flexible``: the last number anywhere.
    """
    if mode == "strict":
        match = _STRICT.search(text)
        found = match.group(1) if match else None
    elif mode == "flexible":
        numbers = _ANY.findall(text)
        found = numbers[-1] if numbers else None
    else:
        raise ValueError(f"mode must be 'strict' or 'flexible', got {mode!r}")
    return found.replace(",", "") if found is not None else None


def gsm8k_reward(prompt: str, response: str, ground_truth: str, mode: str = "flexible") -> float:
    """1.0 if the answer extracted from ``response`` equals ``ground_truth`` as a number ("42" == "42.0")."""
    found = extract_answer(response, mode)
    return float(found is not None and Decimal(found) == Decimal(ground_truth.replace(",", "")))


def load_gsm8k(path: str | Path) -> list[Example]:
    """Examples from a ``.jsonl`` or ``.parquet`` file; the ground truth is the number after ``####``.

    A malformed row raises ValueError naming the file, the 1-based row number and the problem.
    """
    path = Path(path)
    return [_example(row, path, number) for number, row in _rows(path)]


def _rows(path: Path) -> Iterator[tuple[int, object]]:
    """(1-based row number, record) pairs; blank jsonl lines are skipped but keep the numbering."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, _json(line, path, number)
    elif path.suffix == ".parquet":
        import pandas as pd

        yield from enumerate(pd.read_parquet(path).to_dict("records"), start=1)
    else:
        raise ValueError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}")


def _json(line: str, path: Path, number: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, row {number}: invalid JSON ({error})") from None


def _example(row: object, path: Path, number: int) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{path}, row {number}: expected an object with 'question' and 'answer', "
                         f"got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            problem = "missing" if key not in row else f"not a string ({type(row[key]).__name__})"
            raise ValueError(f"{path}, row {number}: {key!r} is {problem}")
    truth = extract_answer(row["answer"], "strict")
    if truth is None:
        raise ValueError(f"{path}, row {number}: 'answer' has no '#### <number>': {row['answer'][-60:]!r}")
    return Example(row["question"], truth, DATA_SOURCE)
