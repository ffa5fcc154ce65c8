"""Named presets: YAML files under ``configs/``, resolved with dotted overrides."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hybridflow_lab.config.loading import ConfigError, apply_overrides, from_given, load_config, to_dict
from hybridflow_lab.config.schema import LabConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def presets() -> list[str]:
    """The preset names (``configs/<name>.yaml``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config(config: LabConfig | str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> LabConfig:
    """A LabConfig from an instance, a preset name, a YAML path or nothing (defaults), plus overrides."""
    if isinstance(config, LabConfig):
        return from_given(LabConfig, to_dict(config), apply_overrides({}, overrides))
    if config is None:
        return load_config(LabConfig, None, overrides)
    path = Path(config)
    if not path.suffix:
        path = CONFIG_DIR / f"{config}.yaml"
        if not path.is_file():
            raise ConfigError("preset", f"no preset {str(config)!r}; presets: {', '.join(presets())}")
    return load_config(LabConfig, path, overrides)

