"""GSM8K-format data (``question``, ``answer`` ending in ``#### <number>``) and its answer-matching reward."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from hybridflow_lab.tasks.answers import NUMBER, extract_answer, same_number
from hybridflow_lab.tasks.base import Example

DATA_SOURCE = "gsm8k"
SUFFIXES = (".jsonl", ".parquet")
ROW_FORMAT = "each row needs a non-empty string 'question' and a string 'answer' ending in '#### <number>'"
_DATASET_ANSWER = re.compile(rf"####\s*({NUMBER})")  # a dataset row's answer field has one '#### n'


def gsm8k_reward(prompt: str, response: str, ground_truth: str, mode: str = "lenient") -> float:
    """1.0 if the answer extracted from ``response`` (``extract_answer`` in ``mode``) equals ``ground_truth``
    as a number ("42" == "42.0"), else 0.0."""
    return float(same_number(extract_answer(response, mode), ground_truth))


def load_gsm8k(path: str | Path) -> list[Example]:
    """Examples from a ``.jsonl`` or ``.parquet`` file; the ground truth is the number after ``####``.

    A malformed row raises ValueError naming the file, the 1-based row number and the problem.
    """
    return [example for _, example in load_gsm8k_rows(path)]


def load_gsm8k_rows(path: str | Path) -> list[tuple[int, Example]]:
    """``load_gsm8k`` with each example's 1-based row number in the file (for messages about a row)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file; give a .jsonl or .parquet file")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)} (pandas writes both: "
                         "DataFrame.to_json(path, orient='records', lines=True) or DataFrame.to_parquet(path))")
    return [(number, _example(row, path, number)) for number, row in _rows(path)]


def _rows(path: Path) -> Iterator[tuple[int, object]]:
    """(1-based row number, record) pairs; blank jsonl lines are skipped but keep the numbering."""
    if path.suffix == ".jsonl":
        with path.open("rb") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield number, _json(line, path, number)
    else:
        yield from enumerate(_parquet_records(path), start=1)


def _parquet_records(path: Path) -> list[dict[str, object]]:
    import pandas as pd

    try:
        return pd.read_parquet(path).to_dict("records")
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable parquet file ({error}); write it with DataFrame.to_parquet") from None


def _json(line: bytes, path: Path, number: int) -> object:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise _row_error(path, number, f"not UTF-8 text ({error}); save the file as UTF-8") from None
    except json.JSONDecodeError as error:
        raise _row_error(path, number, f"invalid JSON ({error})") from None


def _example(row: object, path: Path, number: int) -> Example:
    if not isinstance(row, dict):
        raise _row_error(path, number, f"expected an object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            problem = "missing" if key not in row else f"not a string ({type(row[key]).__name__})"
            raise _row_error(path, number, f"{key!r} is {problem}")
    if not row["question"].strip():
        raise _row_error(path, number, "'question' is empty")
    marked = _DATASET_ANSWER.search(row["answer"])
    if marked is None:
        raise _row_error(path, number, f"'answer' has no '#### <number>': {row['answer'][-60:]!r}")
    return Example(row["question"], marked.group(1).replace(",", ""), DATA_SOURCE)


def _row_error(path: Path, number: int, problem: str) -> ValueError:
    return ValueError(f"{path}, row {number}: {problem}; {ROW_FORMAT}")
