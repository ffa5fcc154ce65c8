"""Run configuration: dataclasses, YAML + dotted overrides, and the rules between settings (pure: no I/O)."""

from hybridflow_lab.config.loading import ConfigError, apply_overrides, from_dict, load_config, to_dict
from hybridflow_lab.config.rules import validate
from hybridflow_lab.config.schema import (
    KL_ALIASES,
    PROJECTIONS,
    TRAIN_BACKENDS,
    AlgorithmConfig,
    BatchConfig,
    EngineConfig,
    LabConfig,
    LoraConfig,
    OptimConfig,
    RoleConfig,
    RolloutConfig,
)

__all__ = ["KL_ALIASES", "PROJECTIONS", "TRAIN_BACKENDS", "AlgorithmConfig", "BatchConfig", "ConfigError",
           "EngineConfig", "LabConfig", "LoraConfig", "OptimConfig", "RoleConfig", "RolloutConfig", "apply_overrides",
           "from_dict", "load_config", "to_dict", "validate"]
