"""Building configs from YAML files and dotted overrides (``actor.optim.lr=1e-5``), type-checked."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot work: names the key and says how to fix it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ``ConfigError``."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", f"unknown key; valid keys here: {', '.join(sorted(names))}")
    values = {name: _convert(hints[name], value, f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(prefix.rstrip(".") or cls.__name__, str(exc)) from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return _convert(option, value, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"{value!r} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        if dataclasses.is_dataclass(value):
            return value
        return from_dict(hint, value, f"{key}.")
    if origin is tuple:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(key, f"expected a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_convert(item, v, key) for v in value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 2e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool):
        is_bool = isinstance(value, bool)
        if not isinstance(value, hint) or (is_bool and hint is not bool):
            raise ConfigError(key, f"expected {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries (values parsed as YAML scalars) in a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override looks like key.path=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(key, f"{part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(cls: type[T], path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> T:
    """``cls``'s defaults, updated by a YAML file (optional), then by dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(str(path), "config file not found")
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(str(path), "the file must hold a mapping of sections")
    return from_dict(cls, merge(to_dict(cls()), apply_overrides(data, overrides)))


def merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` merged in, section by section."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def to_dict(config: Any) -> dict[str, Any]:
    """A plain nested dict (tuples as lists), ready for YAML or wandb."""
    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))
