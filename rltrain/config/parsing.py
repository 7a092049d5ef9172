"""Reading a config tree: dotted overrides, conversion of every leaf to its declared type with
errors naming the key, renamed keys and values, and each section's own check."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import yaml

from rltrain.config.errors import ConfigError

# Keys that moved to another section: the old name is an error that names the new one.
MOVED = {
    "loop.weights_dir": "sync.weights_dir",
    "loop.keep_weight_versions": "sync.keep_weight_versions",
    "engine.tp_size": "engine.gpus_per_engine",
    **{f"engine.{k}": f"engine.embedded.{k}" for k in ("max_batch_size", "compile", "memory_saver", "start")},
}


# Values that were renamed: the old value is an error that names the new one.
RENAMED = {
    ("engine.backend", "native"): "embedded",
    ("trainer.backend", "native"): "fsdp",
}


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.sub=value (for example world.timeout_s=60)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: the key {key!r} is empty or has an empty part")
    # YAML parsing gives numbers, booleans, null and lists their natural types;
    # the declared field type converts further (and rejects what does not fit).
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _close(word: str, choices: list[str]) -> str:
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a section (mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    for k in unknown:
        moved = MOVED.get(f"{prefix}{k}")
        if moved:
            raise ConfigError(f"config key {prefix}{k} moved to {moved}: rename it in the config or override")
    if unknown:
        k = unknown[0]
        names = sorted(fields)
        raise ConfigError(
            f"unknown config key {prefix}{k!r}{_close(str(k), names)} (valid keys in {where}: {', '.join(names)})"
        )
    kwargs = {}
    for name in fields:
        if name not in raw:
            continue
        kwargs[name] = _convert(hints[name], raw[name], f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_section(tp, value, key + ".")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        if isinstance(value, str) and (key, value) in RENAMED:
            new = RENAMED[key, value]
            raise ConfigError(f"{key}={value} was renamed {key}={new}: change it in the config or override")
        text = str(value)
        raise ConfigError(
            f"{key}={value!r} is not allowed; expected one of {', '.join(repr(a) for a in allowed)}"
            f"{_close(text, [str(a) for a in allowed])}"
        )
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        choices = [_describe(arg) for arg in args if arg is not type(None)]
        raise ConfigError(f"{key}={value!r}: expected {', or '.join(choices)}")
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return str(value)
    raise ConfigError(f"{key}: unsupported field type {tp}")  # a programming error in a section


def _describe(tp: Any) -> str:
    """What a value of type `tp` looks like, for an error message."""
    if tp is bool:
        return "true or false"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def check_tree(node: Any) -> None:
    for f in dataclasses.fields(node):
        child = getattr(node, f.name)
        if dataclasses.is_dataclass(child):
            check_tree(child)
    check = getattr(node, "check", None)
    if check is not None:
        check()
