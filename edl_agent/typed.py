"""Build frozen dataclasses from parsed YAML/JSON with errors that name the offending key.

Configuration and simulated-node profiles both come from people's YAML; a wrong key or type must
come back as one line (`nvidia.mig_strategy: expected one of none, single, mixed, got 'all'`),
never as a traceback from deep inside a constructor.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")
KEY_PATH = re.compile(r"[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*")


class SchemaError(ValueError):
    """Input that does not fit the schema; `where` is the dotted key path."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        self.message = message


def build(cls: type[T], data: Any, where: str = "") -> T:
    """Construct dataclass `cls` from `data`, checking keys, types and the class's own checks.

    A class may define `check(self) -> None` raising ValueError("key: problem") or
    ValueError("problem") for value constraints; the key is joined onto `where`.
    """
    if not isinstance(data, Mapping):
        raise SchemaError(where, f"expected a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(key) for key in data if key not in fields)
    if unknown:
        known = ", ".join(sorted(fields))
        raise SchemaError(_join(where, unknown[0]), f"unknown key (known keys: {known})")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        key_where = _join(where, name)
        if name in data:
            values[name] = _convert(hints[name], data[name], key_where)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(key_where, "required key is missing")
    instance = cls(**values)
    check = getattr(instance, "check", None)
    if callable(check):
        try:
            check()
        except ValueError as exc:
            key, sep, message = str(exc).partition(": ")
            if sep and KEY_PATH.fullmatch(key):
                raise SchemaError(_join(where, key), message) from None
            raise SchemaError(where, str(exc)) from None
    return instance


def _convert(hint: Any, value: Any, where: str) -> Any:  # noqa: PLR0911, PLR0912 - one branch per type kind
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        errors: list[SchemaError] = []
        for candidate in candidates:
            try:
                return _convert(candidate, value, where)
            except SchemaError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is typing.Literal:
        if value in args:
            return value
        choices = ", ".join(str(a) for a in args)
        raise SchemaError(where, f"expected one of {choices}, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise SchemaError(where, f"expected a list, got {_describe(value)}")
        item_hint = args[0] if args else Any
        return tuple(_convert(item_hint, item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise SchemaError(where, f"expected a mapping, got {_describe(value)}")
        value_hint = args[1] if len(args) == 2 else Any
        return {str(k): _convert(value_hint, v, _join(where, str(k))) for k, v in value.items()}
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in hint)
            raise SchemaError(where, f"expected one of {choices}, got {value!r}") from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise SchemaError(where, f"expected true or false, got {_describe(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SchemaError(where, f"expected an integer, got {_describe(value)}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise SchemaError(where, f"expected a number, got {_describe(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise SchemaError(where, f"expected a string, got {_describe(value)}")
    msg = f"unsupported schema type {hint!r}"
    raise TypeError(msg)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"{type(value).__name__} {value!r}"
