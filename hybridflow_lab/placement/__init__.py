"""Placement: which device pool each model runs on, and its parallel sizes."""

from hybridflow_lab.placement.plan import PlacementPlan, Suggestion

__all__ = ["PlacementPlan", "Suggestion"]
