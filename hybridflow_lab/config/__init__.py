"""Run configuration: dataclasses, YAML + dotted overrides, validation before any worker starts."""

from hybridflow_lab.config.loading import ConfigError, apply_overrides, from_dict, load_config, to_dict
from hybridflow_lab.config.schema import (
    AlgorithmConfig,
    BatchConfig,
    EngineConfig,
    LabConfig,
    RoleConfig,
    RolloutConfig,
)
from hybridflow_lab.config.validate import validate

__all__ = ["AlgorithmConfig", "BatchConfig", "ConfigError", "EngineConfig", "LabConfig", "RoleConfig", "RolloutConfig",
           "apply_overrides", "from_dict", "load_config", "to_dict", "validate"]
