"""Notebook and browser UI: the placement board, the live run dashboard, replay and run comparisons, the served
dashboard.

It only reads telemetry and run files and calls public APIs; nothing below imports it.
"""

from hybridflow_lab.ui.dashboard import Dashboard, dashboard
from hybridflow_lab.ui.placement_board import PlacementBoard, placement_board
from hybridflow_lab.ui.replay_compare import ReplayComparison, compare
from hybridflow_lab.ui.run_compare import RunComparison, compare_runs

__all__ = ["Dashboard", "PlacementBoard", "ReplayComparison", "RunComparison", "compare", "compare_runs",
           "dashboard", "placement_board"]
