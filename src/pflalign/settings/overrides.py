"""Where a config's values come from and how they are applied: a preset or a TOML/JSON file
(`load_config_source`), ``--set key=value`` with dotted keys (`parse_set`), each nested dict
merged into the dataclasses key by key with every value's type checked (`_apply`); and two
helpers over such nested dicts: `merge` (layers of overrides) and `flat` (configs compared key by key).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path

from ..errors import UserError
from .checks import _suggest
from .run_config import PRESETS


def _coerce(value, tp, key: str):
    """Check/convert one value against a dataclass field type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner:
            try:
                return _coerce(value, a, key)
            except UserError:
                continue
        raise UserError(f"config key {key}: {value!r} is not a valid {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"config key {key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UserError(f"config key {key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"config key {key}: expected a string, got {value!r}")
    if origin is list or tp is list:
        if isinstance(value, str):  # --set data.clients=a,b
            value = [v for v in value.split(",") if v]
        if isinstance(value, list):
            return [_coerce(v, args[0], key) if args else v for v in value]
        raise UserError(f"config key {key}: expected a list, got {value!r}")
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise UserError(f"config key {key}: expected a table, got {value!r}")
    return value


def _apply(obj, updates: dict, prefix: str = "") -> None:
    """Merge a nested dict into a (nested) dataclass, checking every key and type."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in updates.items():
        full = f"{prefix}{key}"
        if key not in names:
            valid = ", ".join(f.name for f in dataclasses.fields(obj))
            raise UserError(f"unknown config key {full!r}{_suggest(key, names)}; valid keys: {valid}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"config key {full}: expected a table of {', '.join(f.name for f in dataclasses.fields(current))}")
            _apply(current, value, prefix=f"{full}.")
        elif key == "method_args" and isinstance(value, dict):
            current.update(value)
        else:
            setattr(obj, key, _coerce(value, hints[key], full))


def parse_value(text: str):
    """`--set` values: JSON when it parses (numbers, true/false, null, lists), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_set(items: list[str]) -> dict:
    """['lora.r=8', 'method=fedavg'] → {'lora': {'r': 8}, 'method': 'fedavg'}."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects key=value, got {item!r}")
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = parse_value(text.strip())
    return out


def load_config_source(source: str | None) -> dict:
    """A preset name or a TOML/JSON file → nested dict of overrides."""
    if source is None:
        return {}
    if source in PRESETS and not Path(source).exists():
        return json.loads(json.dumps(PRESETS[source]))  # deep copy
    path = Path(source)
    if not path.is_file():
        raise UserError(f"config {source!r} is neither a file nor a preset{_suggest(source, PRESETS)}; presets: {', '.join(PRESETS)}")
    try:
        text = path.read_text()
        loaded = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot parse config: {exc}") from exc
    except OSError as exc:
        raise UserError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: a config must be a table of keys, got a JSON {type(loaded).__name__}")
    return loaded


def merge(into: dict, updates: dict) -> dict:
    """Nested dict merge (later wins: a table merges key by key, any other value replaces),
    leaving both inputs unchanged: the layers of a sweep's run config, a rescore's ``--set``."""
    out = json.loads(json.dumps(into))
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value))
    return out


def flat(d: dict, empty_tables: bool = True, prefix: str = "") -> dict:
    """{"a": {"b": 1}, "c": {}} → {"a.b": 1, "c": {}}: one dotted key per value, to compare two
    configs key by key. `empty_tables` False drops an empty table (it has no keys to differ in:
    a rescore's ``method_args: {}`` → ``{personalized: ...}`` is one changed key, not two)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and (v or not empty_tables):
            out.update(flat(v, empty_tables, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
