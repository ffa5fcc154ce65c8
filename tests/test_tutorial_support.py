"""The tutorials' support code: exercise checkers and the cached warm start."""

from __future__ import annotations

import pytest

from hybridflow_lab.demos import warm_cache
from hybridflow_lab.demos.exercises import check_exercise, stub


def square_check(function):
    assert function(3) == 9


def test_an_unanswered_exercise_checks_the_solution_and_an_answer_is_checked_itself(capsys):
    @stub
    def attempt(x):
        ...

    assert check_exercise("square", attempt, lambda x: x * x, square_check)(4) == 16
    assert "no answer yet" in capsys.readouterr().out
    assert check_exercise("square", lambda x: x**2, None, square_check)(5) == 25
    assert "your answer passes" in capsys.readouterr().out
    with pytest.raises(AssertionError):
        check_exercise("square", lambda x: x + x, lambda x: x * x, square_check)
    assert check_exercise("number", None, 0.5, lambda value: None) == 0.5


def test_a_warm_start_is_trained_once_and_keyed_by_its_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(warm_cache.CACHE_ENV, str(tmp_path))
    trained = []
    real_warm_start = warm_cache.warm_start
    monkeypatch.setattr(warm_cache, "warm_start", lambda *args: trained.append(args) or real_warm_start(*args))
    model_dir, metrics = warm_cache.cached_warm_start("arithmetic", seed=3, max_steps=2)
    again, metrics_again = warm_cache.cached_warm_start("arithmetic", seed=3, max_steps=2)
    assert again == model_dir and metrics_again == metrics and metrics["sft/steps"] == 2 and len(trained) == 1
    assert (model_dir / "config.json").exists() and model_dir.is_relative_to(tmp_path)
    other, _ = warm_cache.cached_warm_start("arithmetic", seed=4, max_steps=2)
    assert other != model_dir and len(trained) == 2
    assert [p.name for p in (tmp_path / "warm_starts").iterdir() if p.name.startswith(".")] == []  # no staging left
    with pytest.raises(ValueError, match="unknown demo task 'sortin'"):
        warm_cache.cached_warm_start("sortin")


def test_the_warm_start_fingerprint_follows_the_demo_settings():
    sorting, arithmetic = warm_cache.DEMO_TASKS["sorting"], warm_cache.DEMO_TASKS["arithmetic"]
    assert warm_cache.fingerprint(sorting) == warm_cache.fingerprint(sorting) != warm_cache.fingerprint(arithmetic)
