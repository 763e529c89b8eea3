"""Build frozen dataclasses from parsed YAML/JSON with errors that name the offending key.

Configuration and simulated-node profiles both come from people's YAML; a wrong key or type must
come back as one line (`nvidia.mig_strategy: expected one of none, single, mixed, got 'all'`),
never as a traceback from deep inside a constructor.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from edl_agent.errors import did_you_mean, shorten

T = TypeVar("T")
# Every integer setting fits in 64 bits (Kubernetes quantities, protobuf fields, C libraries);
# bigger ones are typos, and beyond ~4300 digits Python cannot even print them.
MAX_INT = 2**63 - 1
# Numbers with an exponent but no dot (`1e3`), which a YAML 1.1 reader leaves as strings.
EXPONENT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]{1,4}")
YAML_TRUE = frozenset({"on", "yes", "true"})
YAML_FALSE = frozenset({"off", "no", "false"})
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
    hints, fields = _schema(cls)  # type: ignore[arg-type]  # a class is hashable
    unknown = sorted(str(key) for key in data if key not in fields)
    if unknown:
        known = ", ".join(sorted(fields))
        hint = did_you_mean(unknown[0], fields, prefix=_join(where, ""))
        raise SchemaError(
            _join(where, shorten(unknown[0])), f"unknown key{hint} (known keys: {known})"
        )
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


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """A dataclass's resolved type hints and fields, worked out once: resolving the hints is
    most of the cost of building one (every policy event the restarter sees is built)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


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
        if isinstance(value, bool):
            value = _yaml_word(value, args)
        if value in args:
            return value
        choices = ", ".join(str(a) for a in args)
        raise SchemaError(where, f"expected one of {choices}, got {shorten(repr(value))}")
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
            if abs(value) > MAX_INT:
                raise SchemaError(where, f"{_describe(value)} is out of range (at most {MAX_INT})")
            return value
        raise SchemaError(where, f"expected an integer, got {_describe(value)}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _finite(value, where)
        if isinstance(value, str) and EXPONENT.fullmatch(value.strip()):
            return _finite(value, where)  # 1e3: a number in YAML 1.2, a string in YAML 1.1
        raise SchemaError(where, f"expected a number, got {_describe(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise SchemaError(where, f"expected a string, got {_describe(value)}")
    msg = f"unsupported schema type {hint!r}"
    raise TypeError(msg)


def _finite(value: float | str, where: str) -> float:
    """A number as a float; infinities, NaN and numbers beyond a float's range are refused (a
    NaN compares false with every bound, so no later range check would catch it)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise SchemaError(where, f"expected a finite number, got {_describe(value)}")
    return number


def _yaml_word(value: bool, choices: tuple[Any, ...]) -> Any:
    """The choice a YAML 1.1 reader turned into a bool (`off`, `no`, `on`, `yes`), so that a
    documented word such as `labels: off` means itself in a file, the environment or --set."""
    words = YAML_TRUE if value else YAML_FALSE
    matches = [c for c in choices if isinstance(c, str) and c.lower() in words]
    return matches[0] if len(matches) == 1 else value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"an integer of about {round(value.bit_length() * math.log10(2))} digits"
    return f"{type(value).__name__} {shorten(repr(value))}"
