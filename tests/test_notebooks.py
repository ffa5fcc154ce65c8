"""The tutorials and notebooks are committed clean: no outputs, no widget state, papermill parameters."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("tutorials/*.ipynb"), *ROOT.glob("notebooks/*.ipynb")])


TUTORIALS = sorted(ROOT.glob("tutorials/[0-9][0-9]_*.ipynb"))


def test_the_tutorials_are_numbered_in_order_and_listed_in_the_learning_path():
    numbers = [int(p.name[:2]) for p in TUTORIALS]
    assert numbers == list(range(1, len(numbers) + 1))
    learning_path = (ROOT / "tutorials" / "README.md").read_text()
    assert [p.name for p in TUTORIALS if p.name not in learning_path] == []
    for path in TUTORIALS:
        title = nbformat.read(path, as_version=4).cells[0].source.splitlines()[0]
        assert title.startswith(f"# {int(path.name[:2])}. "), f"{path.name} starts with {title!r}"


def test_the_readmes_notebook_cell_is_tutorial_1s_which_the_browser_test_runs_and_the_tutorial_run_skips():
    """tests/test_first_look.py runs the cell and its shutdown as a newcomer does, in JupyterLab in a browser,
    and tests/test_vllm_lab.py in a kernel with vLLM generating: the tutorial's run under nbval skips the two."""
    readme = (ROOT / "README.md").read_text()
    cell = re.search(r"```python\n(.*?)\n```", readme, re.DOTALL).group(1)
    assert len(cell.splitlines()) <= 12
    code = [c for c in nbformat.read(TUTORIALS[0], as_version=4).cells if c.cell_type == "code"]
    index = [c.source for c in code].index(cell)
    assert code[index + 1].source.startswith("lab.shutdown()")
    assert [c.metadata.get("tags") for c in code[index:index + 2]] == [["nbval-skip"], ["nbval-skip"]]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_figures_shown_as_images_exist_and_come_from_a_tagged_cell(path):
    notebook = nbformat.read(path, as_version=4)
    tagged = {tag.removeprefix("figure:") for cell in notebook.cells for tag in cell.metadata.get("tags", [])
              if tag.startswith("figure:")}
    shown = {name for cell in notebook.cells if cell.cell_type == "markdown"
             for name in re.findall(r"\(\.\./docs/images/([\w.-]+)\.png\)", cell.source)}
    assert [name for name in tagged | shown if not (ROOT / "docs" / "images" / f"{name}.png").exists()] == [], \
        "run `make tutorials-html` to render the tagged figures"
    assert {name for name in shown if name.startswith("tutorial")} <= tagged, "a rendered figure without its cell"


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    cells = nbformat.read(path, as_version=4).cells
    links = {link for cell in cells if cell.cell_type == "markdown"
             for link in re.findall(r"\]\((\.\./[^)#]+)", cell.source)}
    assert [link for link in links if not (path.parent / link).exists()] == []


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_exercises_have_a_collapsed_solution_that_checks_the_readers_answer(path):
    cells = nbformat.read(path, as_version=4).cells
    exercises = [i for i, cell in enumerate(cells) if cell.cell_type == "markdown"
                 and cell.source.startswith("### Exercise")]
    for i in exercises:
        solution = next(cell for cell in cells[i + 1:] if "solution" in cell.metadata.get("tags", []))
        assert solution.metadata.get("jupyter", {}).get("source_hidden"), f"collapse the solution of cell {i}"
        assert "check_exercise(" in solution.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_without_outputs_and_with_parameters(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), "clear the outputs"
    assert "widgets" not in notebook.metadata, "saved widget state: clear it before committing"
    assert any("parameters" in cell.metadata.get("tags", []) for cell in code), "no papermill `parameters` cell"
