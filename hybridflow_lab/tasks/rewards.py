"""Generic rule scores for short answers."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def exact_match(response: str, truth: str) -> float:
    """1.0 if ``response`` equals ``truth`` once surrounding whitespace is stripped, else 0.0."""
    return float(response.strip() == truth.strip())


def integer_format_score(response: str, truth: str, format_credit: float = 0.1) -> float:
    """1.0 for the right answer, ``format_credit`` for a wrong but well-formed integer, else 0.0."""
    if exact_match(response, truth):
        return 1.0
    return format_credit if _INTEGER.fullmatch(response.strip()) else 0.0


def digit_score(response: str, truth: str, scale: float = 0.5, format_credit: float = 0.1) -> float:
    """1.0 for the right answer; for a wrong integer, ``format_credit`` plus ``scale`` times the fraction
    of digit positions (aligned from the right, as in column arithmetic) that match ``truth``; else 0.0.

    A denser signal than exact match: a small model that gets the last digit right is rewarded
    more than one that does not, so its samples differ in reward more often.
    """
    if exact_match(response, truth):
        return 1.0
    response, truth = response.strip(), truth.strip()
    if not _INTEGER.fullmatch(response):
        return 0.0
    width = max(len(response), len(truth))
    matches = sum(a == b for a, b in zip(response.rjust(width), truth.rjust(width), strict=True))
    return format_credit + scale * matches / width


def permutation_score(response: str, truth: str, scale: float = 0.5) -> float:
    """1.0 for the right answer; for a rearrangement of ``truth``'s characters, ``scale`` times the
    fraction of positions that already match; anything else 0.0."""
    return position_score(response, truth, scale) if sorted(response.strip()) == sorted(truth.strip()) else 0.0


def position_score(response: str, truth: str, scale: float = 0.5) -> float:
    """1.0 for the right answer; for another answer of the same length, ``scale`` times the fraction of
    positions that match ``truth``; anything else 0.0. Denser than ``permutation_score``: a near miss that
    repeats one character too often (``"13444999"`` for ``"13449999"``) still earns most of the credit."""
    response, truth = response.strip(), truth.strip()
    if response == truth:
        return 1.0
    if len(response) != len(truth) or not truth:
        return 0.0
    return scale * sum(a == b for a, b in zip(response, truth, strict=True)) / len(truth)
