"""Placement: which device pool each model runs on, its parallel sizes, and the auto-mapping search."""

from hybridflow_lab.placement.plan import Placement, Suggestion

__all__ = ["Placement", "Suggestion"]
