"""The 3D-HybridEngine: the actor's training and generation layouts on the same ranks, and resharding between them."""

from hybridflow_lab.hybrid.layout import STRATEGIES, ParallelLayout, formula_bytes_per_rank

__all__ = ["STRATEGIES", "ParallelLayout", "formula_bytes_per_rank"]
