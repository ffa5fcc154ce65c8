"""Execute the tutorials and keep rendered copies: HTML pages with every output, and the tagged figures as PNGs.

``make tutorials-html`` runs this. Each notebook runs on its default parameters in a fresh kernel; its executed
copy is written as ``<html-dir>/<name>.html`` (plotly figures stay interactive). A code cell tagged
``figure:<image>`` has its figure output saved as ``<image-dir>/<image>.png`` through chromium, so that the
tutorials' markdown and the docs can show it to a reader who does not run the notebook.

    PYTHONPATH=. python scripts/render_tutorials.py [NOTEBOOK ...] [--html-dir DIR] [--image-dir DIR]

Chromium is launched the way the browser tests launch it (``tests/browser.py``), hence the ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from pathlib import Path

import nbformat
import plotly.graph_objects as go
from nbclient import NotebookClient
from nbconvert import HTMLExporter
from playwright.sync_api import Page

from tests.browser import browser_page

ROOT = Path(__file__).resolve().parents[1]
FIGURE_TAG = "figure:"
PLOTLY_JSON = "application/vnd.plotly.v1+json"


def execute(path: Path, timeout_s: int) -> nbformat.NotebookNode:
    """``path`` run top to bottom in a fresh kernel, in its own directory (as JupyterLab and nbval run it)."""
    notebook = nbformat.read(path, as_version=4)
    where = {"metadata": {"path": str(path.resolve().parent)}}
    NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", resources=where).execute()
    return notebook


def tagged_figures(notebook: nbformat.NotebookNode) -> dict[str, dict]:
    """``{image name: the figure output's data}`` for each cell tagged ``figure:<image name>``."""
    figures = {}
    for cell in notebook.cells:
        names = [tag.removeprefix(FIGURE_TAG) for tag in cell.metadata.get("tags", []) if tag.startswith(FIGURE_TAG)]
        if not names:
            continue
        shown = [out.data for out in cell.get("outputs", []) if out.get("output_type") in ("display_data",
                                                                                             "execute_result")]
        figure = next((data for data in reversed(shown) if PLOTLY_JSON in data or "image/png" in data), None)
        if figure is None:
            raise SystemExit(f"cell tagged {FIGURE_TAG}{names[0]} showed no plotly figure or PNG")
        figures.update(dict.fromkeys(names, figure))
    return figures


def save_png(data: dict, target: Path, page: Page) -> None:
    """Write a figure output as a PNG: a PNG as it is, a plotly figure drawn by chromium at its own size."""
    if "image/png" in data:
        target.write_bytes(base64.b64decode(data["image/png"]))
        return
    figure = go.Figure(data[PLOTLY_JSON])
    width, height = figure.layout.width or 1000, figure.layout.height or 520
    page.set_viewport_size({"width": width + 40, "height": height + 40})
    page.set_content(figure.to_html(include_plotlyjs=True, full_html=True, default_width=f"{width}px",
                                    default_height=f"{height}px", config={"displayModeBar": False}))
    page.wait_for_selector(".main-svg")
    page.locator(".js-plotly-plot").first.screenshot(path=str(target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every tutorials/*.ipynb")
    parser.add_argument("--html-dir", type=Path, default=ROOT / "build" / "tutorials")
    parser.add_argument("--image-dir", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--timeout-s", type=int, default=1200, help="per cell")
    args = parser.parse_args()
    notebooks = args.notebooks or sorted((ROOT / "tutorials").glob("*.ipynb"))
    args.html_dir.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    # the kernels' figures carry their JSON (for the PNG) and an HTML page with plotly.js inlined (the HTML copy)
    os.environ["PLOTLY_RENDERER"] = "plotly_mimetype+notebook"
    with browser_page("render-tutorials") as page:
        for path in notebooks:
            start = time.perf_counter()
            notebook = execute(path, args.timeout_s)
            html, _ = exporter.from_notebook_node(notebook)
            (args.html_dir / f"{path.stem}.html").write_text(html)
            for name, data in tagged_figures(notebook).items():
                save_png(data, args.image_dir / f"{name}.png", page)
                print(f"  {args.image_dir / name}.png")
            print(f"{path.name}: {time.perf_counter() - start:.0f} s -> {args.html_dir / path.stem}.html", flush=True)


if __name__ == "__main__":
    sys.exit(main())
