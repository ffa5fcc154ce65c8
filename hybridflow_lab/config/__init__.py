"""Run configuration: dataclasses, YAML + dotted overrides, validation before any worker starts."""

from hybridflow_lab.config.loading import ConfigError, apply_overrides, from_dict, load_config, to_dict
from hybridflow_lab.config.schema import (
    TRAIN_BACKENDS,
    AlgorithmConfig,
    BatchConfig,
    EngineConfig,
    LabConfig,
    OptimConfig,
    RoleConfig,
    RolloutConfig,
)
from hybridflow_lab.config.validate import validate

__all__ = ["TRAIN_BACKENDS", "AlgorithmConfig", "BatchConfig", "ConfigError", "EngineConfig", "LabConfig",
           "OptimConfig", "RoleConfig", "RolloutConfig", "apply_overrides", "from_dict", "load_config", "to_dict",
           "validate"]
