"""The tutorials and notebooks are committed clean: no outputs, no widget state, papermill parameters."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("tutorials/*.ipynb"), *ROOT.glob("notebooks/*.ipynb")])


def test_the_five_tutorials_are_numbered():
    numbers = sorted(int(p.name[:2]) for p in ROOT.glob("tutorials/[0-9][0-9]_*.ipynb"))
    assert numbers[:5] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_without_outputs_and_with_parameters(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), "clear the outputs"
    assert "widgets" not in notebook.metadata, "saved widget state: clear it before committing"
    assert any("parameters" in cell.metadata.get("tags", []) for cell in code), "no papermill `parameters` cell"
