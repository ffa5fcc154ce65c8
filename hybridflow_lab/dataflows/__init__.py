"""Algorithms as declared objects and their dataflows: what a run needs, and one short function per iteration."""

from hybridflow_lab.dataflows.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmError,
    Dataflow,
    RunNeeds,
    algorithm_of,
    needs_old_log_probs,
    register_algorithm,
)
from hybridflow_lab.dataflows.builtin import informative_batch, per_sample
from hybridflow_lab.dataflows.checks import check_config
from hybridflow_lab.dataflows.stages import Metrics, Stages, StepContext

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmError", "Dataflow", "Metrics", "RunNeeds", "Stages", "StepContext",
           "algorithm_of", "check_config", "informative_batch", "needs_old_log_probs", "per_sample",
           "register_algorithm"]
