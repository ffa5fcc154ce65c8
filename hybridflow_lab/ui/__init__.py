"""Notebook and browser UI: the placement board, the live run dashboard, the served dashboard.

It only reads telemetry and run files and calls public APIs; nothing below imports it.
"""

from hybridflow_lab.ui.dashboard import Dashboard, dashboard
from hybridflow_lab.ui.placement_board import PlacementBoard, placement_board

__all__ = ["Dashboard", "PlacementBoard", "dashboard", "placement_board"]
