"""Plain dict -> typed dataclass conversion with errors that name the field.

Hydra/OmegaConf stops at the edge (pretrain.py); library code only ever sees the dataclasses built
here. We convert by hand instead of with OmegaConf structured configs so that every error names the
dotted field, the offending value and what to type instead, and so that tuples/Optionals/Literals
behave the same whether the config came from YAML, the command line or Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")

REMOVED = "removed"
"""A dataclass field's metadata key: {value: why it was removed and what to use instead}, for values a release took
out of a Literal (field(metadata={REMOVED: {...}}))."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the field, the value and the fix."""


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}={value!r} matches none of: {tp} "
                          f"({'; '.join(errors)})")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{path}={value!r} is not allowed; choose one of: {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r} must be a list, written {path}=[a,b,...] on the command line")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}={value!r} must have {len(args)} entries")
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is float:
        # ints are fine where floats are expected (lr=1 is a float); bools are not.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any or (tp is dict and isinstance(value, dict)):
        return value
    raise ConfigError(f"{path}={value!r} has type {type(value).__name__}; expected {_type_name(tp)}")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}={data!r} must be a mapping of fields of {cls.__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(
                f"unknown config key '{dotted}'; {hint}known keys here: {', '.join(sorted(fields))}"
            )
        removed = fields[key].metadata.get(REMOVED, {})
        if isinstance(value, str) and value in removed:  # a value a release took out: say why and what instead
            raise ConfigError(f"{dotted}={value}: {removed[value]}")
        kwargs[key] = _convert(value, hints[key], dotted)
    return cls(**kwargs)


def check_partial(cls: type, data: Any, path: str) -> dict:
    """Some fields of dataclass `cls` (overrides of a registered config), each converted to its declared type:
    unknown keys are left for the caller to report; a nested dataclass field given as a dict is checked the same
    way, field by field. Raises ConfigError naming `path.key`, the value and the expected type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}={data!r} must be a mapping of fields of {cls.__name__}, e.g. {path}.FIELD=VALUE")
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        dotted = f"{path}.{key}"
        if key not in hints:
            out[key] = value
            continue
        nested = [a for a in (typing.get_args(hints[key]) or (hints[key],)) if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, dict):
            out[key] = check_partial(nested[0], value, dotted)
        else:
            out[key] = _convert(value, hints[key], dotted)
    return out


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain JSON-able dict (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj
