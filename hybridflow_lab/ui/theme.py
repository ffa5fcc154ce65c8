"""The widgets follow JupyterLab's theme: under a dark theme, plotly's backgrounds turn transparent and its text
and grid take JupyterLab's colours (the ``data-jp-theme-light`` attribute JupyterLab sets on the page)."""

from __future__ import annotations

import ipywidgets as widgets

THEMED = "hybridflow-themed"  # the class of a widget whose figures follow the theme
DARK = f'body[data-jp-theme-light="false"] .{THEMED}'
THEME_CSS = f"""<style>
{DARK} .js-plotly-plot .main-svg {{ background: transparent !important; }}
{DARK} .js-plotly-plot .bg {{ fill: transparent !important; }}
{DARK} .js-plotly-plot text {{ fill: var(--jp-ui-font-color1) !important; }}
{DARK} .js-plotly-plot .gridlayer path, {DARK} .js-plotly-plot .zerolinelayer path {{
  stroke: var(--jp-border-color2) !important; }}
</style>"""


def themed(box: widgets.Box) -> widgets.Box:
    """``box`` with the theme's style sheet, following JupyterLab's light or dark theme."""
    box.children = (widgets.HTML(THEME_CSS), *box.children)
    box.add_class(THEMED)
    return box
