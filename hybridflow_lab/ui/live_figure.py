"""``LiveFigure``: a plotly figure in a notebook widget that any thread can replace.

Not plotly's ``FigureWidget``: it is an anywidget that sends plotly.js (5 MB) with every figure, and anywidget
(0.11) drops every later message to a model whose code took over 2 s to load. On a loaded machine a dashboard's
FigureWidgets stayed at their first, empty state for the rest of the run. A ``LiveFigure`` is an ``Output`` widget
holding the figure's plotly mime bundle, drawn by JupyterLab's plotly extension (loaded once, with the page); each
replacement carries the whole figure, so a late front end draws the newest one.
"""

from __future__ import annotations

import json
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio

PLOTLY_MIME = "application/vnd.plotly.v1+json"


class LiveFigure(widgets.Output):
    """An ``Output`` widget showing ``figure``; ``show`` replaces it."""

    def __init__(self, figure: go.Figure | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.show(figure if figure is not None else go.Figure())

    def show(self, figure: go.Figure) -> None:
        """Draw ``figure`` in place of the one shown (safe from a background thread: one state update)."""
        self.figure = figure
        bundle = {PLOTLY_MIME: json.loads(pio.to_json(figure, validate=False)), "text/plain": "<plotly figure>"}
        self.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
