"""The tutorials and notebooks as tests (``pytest --nbval-lax tutorials notebooks``): each cell is an nbval item,
marked ``notebook``; a notebook's cells share one kernel, so each notebook is one ``xdist_group`` that a single
pytest-xdist worker runs in order (``--dist loadgroup``)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
