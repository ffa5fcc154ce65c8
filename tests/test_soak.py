"""The soak bench's arithmetic (the bench itself runs in tests/test_cli.py)."""

from __future__ import annotations

import pytest

from hybridflow_lab.bench.soak import slope_per_100


def test_soak_growth_is_the_least_squares_slope_per_100_steps():
    assert slope_per_100([10 + 0.5 * step for step in range(40)]) == pytest.approx(50.0)
    assert slope_per_100([3.0] * 10) == 0.0
    assert slope_per_100([5.0]) == 0.0
