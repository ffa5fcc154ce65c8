"""Building configs from YAML files and dotted overrides (``actor.optim.lr=1e-5``), type-checked."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot work: names the key and says how to fix it (``key``, and ``problem``: the rest)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.problem = message


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ``ConfigError``."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "config", f"is a section, not a value (got {data!r}); set its keys "
                          f"instead, e.g. {prefix}{next(iter(fields))}=...")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    renamed = getattr(cls, "RENAMED_KEYS", {})  # keys of earlier versions, each with what replaces it
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", renamed.get(unknown[0])
                          or _unknown_key(unknown[0], sorted(fields), prefix))
    values = {name: _field_value(fields[name], hints[name], value, prefix) for name, value in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(prefix.rstrip(".") or cls.__name__, str(exc)) from None


def _unknown_key(name: str, valid: list[str], prefix: str) -> str:
    message = f"unknown key; valid keys here: {', '.join(valid)}"
    close = difflib.get_close_matches(name, valid, n=1)
    return f"{message}; did you mean {prefix}{close[0]}?" if close else message


def _field_value(field: dataclasses.Field[Any], hint: Any, value: Any, prefix: str) -> Any:
    """``value`` converted to the field's type; a wrong value gets an example of a right one."""
    key = f"{prefix}{field.name}"
    try:
        return _convert(hint, value, key)
    except ConfigError as error:
        if error.key != key or field.default is dataclasses.MISSING:
            raise
        example = json.dumps(list(field.default) if isinstance(field.default, tuple) else field.default)
        raise ConfigError(key, f"{error.problem}; for example {key}={example}") from None


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
        items = _item_hints(typing.get_args(hint), len(value))
        if len(items) != len(value):
            raise ConfigError(key, f"expected a list of {len(items)} values, got {len(value)}: {list(value)!r}")
        return tuple(_convert(item, v, key) for item, v in zip(items, value, strict=True))
    if hint is Any:
        return value
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping (key: value), got {value!r}")
        return dict(value)
    if origin is typing.Literal:  # its choices are checked with the other rules (config.rules), with their fixes
        return _convert(type(typing.get_args(hint)[0]), value, key)
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


def _item_hints(args: tuple[Any, ...], length: int) -> tuple[Any, ...]:
    """The type of each item of a ``tuple[...]`` of ``length`` items: fixed (``tuple[float, float]``) or not."""
    if not args:
        return (Any,) * length
    if len(args) == 2 and args[1] is Ellipsis:
        return (args[0],) * length
    return args


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
        data = _read_yaml(Path(path))
    return from_given(cls, to_dict(cls()), apply_overrides(data, overrides))


def from_given(cls: type[T], base: dict[str, Any], given: dict[str, Any]) -> T:
    """``cls`` from ``base`` updated by what the user gave (``given``), refusing the values ``cls.REFUSED_IF_GIVEN``
    names (dotted key: the value, and why)."""
    for key, (value, why) in getattr(cls, "REFUSED_IF_GIVEN", {}).items():
        node: Any = given
        for part in key.split("."):
            node = node.get(part, {}) if isinstance(node, Mapping) else {}
        if node == value and not isinstance(node, bool):
            raise ConfigError(key, why)
    return from_dict(cls, merge(base, given))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the later value silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(key_node.start_mark.name, f"line {line}: key {key!r} is given twice in one section "
                                  f"(first on line {first_line[key]}), and only the later value would count; keep "
                                  "one of them")
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(str(path), f"config file not found; check the path (relative paths start at {Path.cwd()})")
    try:
        with path.open("rb") as stream:  # bytes: PyYAML checks the encoding, and its marks name the file
            data = yaml.load(stream, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise ConfigError(str(path), f"not valid YAML ({' '.join(str(error).split())}); fix the file: UTF-8 text, "
                          "'section:' lines with indented 'key: value' lines under them") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"the file must hold a mapping of sections, got a {type(data).__name__}; "
                          "write 'section:' lines with indented 'key: value' lines under them")
    return data


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
