"""Tutorial exercises: the reader's attempt is checked when there is one, the collapsed solution otherwise.

A notebook runs top to bottom under ``pytest --nbval-lax`` before anyone has written an answer, so each
checker falls back to the notebook's solution and says so; once the reader fills in the attempt, the same
asserts judge it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _unanswered(attempt: Any) -> bool:
    if attempt is None or attempt is Ellipsis:
        return True
    if callable(attempt):
        return getattr(attempt, "__exercise_stub__", False)
    return False


def stub(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as an exercise's empty slot (its body is the reader's to write)."""
    function.__exercise_stub__ = True  # type: ignore[attr-defined]
    return function


def check_exercise(name: str, attempt: Any, solution: Any, check: Callable[[Any], None]) -> Any:
    """Run ``check`` (asserts) on ``attempt``, or on ``solution`` while ``attempt`` is ``None``, ``...`` or a
    function marked with :func:`stub`; print which one passed and return it."""
    answered = not _unanswered(attempt)
    check(attempt if answered else solution)
    print(f"{name}: {'your answer passes' if answered else 'no answer yet; the solution passes the same check'}")
    return attempt if answered else solution
