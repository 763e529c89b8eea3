"""Settings in layers, for both processes: a settings dataclass built from, lowest first, its
defaults, a YAML file, environment variables and the command line (`--set key.path=value`, then
named flags).

Environment variables name a key path with `__` between levels: `EDL_LOG_LEVEL=debug`,
`EDL_NVIDIA__MIG_STRATEGY=mixed`. Their values are read as YAML scalars (`true`, `3`, `[a, b]`),
so every key can be set from a pod spec; `--set nvidia.mig_strategy=mixed` reads the same way.
Every setting carries its help text in its field's metadata (`setting`), which `config --keys`
and the README print. The schemas themselves live with their processes: the agent's in
`edl_agent.config`, the restarter's in `edl_agent.restarter.core.settings`.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from edl_agent.errors import did_you_mean, shorten
from edl_agent.typed import SchemaError, build

T = TypeVar("T")
ENV_PREFIX = "EDL_"
# The restarter's settings (`edl_agent.restarter.core.settings`): a process of one kind must not
# refuse to start over the other's variables (a shell or pod that sets both).
RESTARTER_ENV_PREFIX = "EDL_RESTARTER_"
ENV_PREFIXES = (ENV_PREFIX, RESTARTER_ENV_PREFIX)
# A config file is a page of YAML; reading stops here so that a wrong path (/dev/zero, a disk
# image) is refused at once instead of filling memory.
MAX_CONFIG_BYTES = 1024 * 1024
# The key of a field's help text in its metadata.
HELP = "help"
# Which layer wins, the same for both processes: `--help` and the README say it in these words.
PRECEDENCE = "flags win over --set, --set over the environment, the environment over the file"
# Logging, the same for both processes.
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]


class ConfigError(Exception):
    """Bad configuration; the message names the key and the source."""


def setting(default: T, help: str) -> T:
    """A settings field with an immutable `default` and its `help` in the field's metadata."""
    return dataclasses.field(default=default, metadata={HELP: help})


def section(factory: Callable[[], T], help: str) -> T:
    """A settings field whose default is made by `factory` (a nested section, a mapping), with
    its `help`."""
    return dataclasses.field(default_factory=factory, metadata={HELP: help})


# A layer of settings: where it came from (named in errors) and its nested mapping of keys.
Layer = tuple[str, Mapping[str, Any]]


def load_layers(
    root: type[T],
    *,
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[Layer] = (),
    defaults: Sequence[Layer] = (),
    env_prefix: str = ENV_PREFIX,
) -> T:
    """`root` (a settings dataclass) from, lowest first: `defaults`, the YAML `file`, the
    `env_prefix` variables of `environ`, `overrides`. Raises ConfigError with one line naming
    the key and the layer it came from."""
    layers = [*defaults]
    if file is not None:
        layers.append((file, _read_file(file)))
    layers.append(("environment", env_layer(environ or {}, root, env_prefix)))
    layers += overrides
    merged: dict[str, Any] = {}
    source_of: dict[str, str] = {}
    try:
        for source, layer in layers:
            _check_layer(root, layer, source)
            _deep_merge(merged, layer)
            source_of.update(dict.fromkeys(_key_paths(layer), source))
        return build(root, merged)
    except SchemaError as exc:
        msg = f"{exc} (from {_source(source_of, exc.where)})"
        raise ConfigError(msg) from None
    except RecursionError:
        msg = "the settings are nested too deeply"
        raise ConfigError(msg) from None


def _key_paths(layer: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every dotted key path `layer` sets, mappings on the way included."""
    for key, value in layer.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, Mapping):
            yield from _key_paths(value, f"{path}.")


def _source(source_of: Mapping[str, str], where: str) -> str:
    """The layer that set `where` (`sharing[0].replicas`) or, failing that, its nearest parent."""
    parts = re.sub(r"\[\d+\]", "", where).split(".")
    for end in range(len(parts), 0, -1):
        source = source_of.get(".".join(parts[:end]))
        if source is not None:
            return source
    return "configuration"


def env_layer(
    environ: Mapping[str, str], root: type[Any], prefix: str = ENV_PREFIX
) -> dict[str, Any]:
    """The `EDL_*` variables (`prefix`) as a nested mapping; `EDL_A__B=v` becomes {"a": {"b": v}}.
    A variable belongs to the longest of `ENV_PREFIXES` it starts with: the agent leaves the
    restarter's `EDL_RESTARTER_*` alone, and the restarter every other `EDL_*`."""
    layer: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix) or name in NON_SETTING_ENV:
            continue
        if any(len(other) > len(prefix) and name.startswith(other) for other in ENV_PREFIXES):
            continue
        path = [part.lower() for part in name[len(prefix) :].split("__")]
        set_path(layer, path, parse_value(path, raw, name, root))
    return layer


# EDL_ variables that are not settings (caches and test switches read elsewhere).
NON_SETTING_ENV = frozenset(
    {"EDL_CACHE_DIR", "EDL_K8S_BIN_DIR", "EDL_HOROVOD_VENV", "EDL_PEERS_DIR", "EDL_CHAOS_SEED"}
)


def assignment(text: str, root: type[Any]) -> tuple[list[str], Any]:
    """Parse a `--set key.path=value` flag."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        msg = f"--set {text!r}: expected KEY=VALUE, e.g. log_level=debug"
        raise ConfigError(msg)
    path = key.strip().split(".")
    return path, parse_value(path, raw, f"--set {key}", root)


def parse_value(path: list[str], raw: str, origin: str, root: type[Any]) -> Any:
    """Strings stay strings where the setting is a string; everything else is a YAML scalar."""
    if _hint_at(root, path) is str:
        return raw
    if not raw.strip():
        return ""
    try:
        return load_yaml(raw)
    except YamlProblem as exc:
        key, value = shorten(".".join(path)), shorten(repr(raw))
        msg = f"{key}: cannot read value {value}: {exc} (from {origin})"
        raise ConfigError(msg) from None


class YamlProblem(ValueError):
    """YAML that cannot be read: `why` in a few words, and the `line` when the parser knows."""

    def __init__(self, why: str, line: int | None = None) -> None:
        super().__init__(why if line is None else f"line {line}: {why}")
        self.why, self.line = why, line


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, with everything it raises on bad input as a YamlProblem."""
    import yaml  # only when a settings file or a YAML value is read: not at every start

    try:
        return yaml.safe_load(text)
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        char = exc.character
        shown = f"U+{char:04X}" if isinstance(char, int) else repr(char)
        why = f"character {shown} at offset {exc.position}: {exc.reason}"
        raise YamlProblem(why) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise YamlProblem(problem, None if mark is None else mark.line + 1) from None
    except RecursionError:
        raise YamlProblem("nested too deeply") from None
    except ValueError as exc:
        # From the value constructors: an integer past Python's int-string conversion limit,
        # or an impossible date such as 2024-13-01.
        digits = "digits" in str(exc)
        raise YamlProblem(
            "a number of more than 4300 digits" if digits else shorten(str(exc), 100)
        ) from None


def describe_settings(root: type[Any]) -> list[tuple[str, str, str]]:
    """(key, default, help) for every setting of `root`, for the README and `--keys`."""
    rows: list[tuple[str, str, str]] = []
    _describe(root, "", rows)
    return rows


def _describe(cls: type[Any], prefix: str, rows: list[tuple[str, str, str]]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            _describe(hint, f"{key}.", rows)
            continue
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        shown = "required" if default is dataclasses.MISSING else shown_value(default)
        rows.append((key, shown, f.metadata.get(HELP, "")))


def shown_value(value: Any) -> str:
    """A default as a YAML flow/JSON value, as one writes it in a file or `--set`: `true`,
    `[]`, `"info"`, `{"a": 1}`."""
    import json

    def plain(item: Any) -> Any:
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            return plain(dataclasses.asdict(item))
        if isinstance(item, Mapping):
            return {str(k): plain(v) for k, v in item.items()}
        if isinstance(item, list | tuple | set | frozenset):
            return [plain(v) for v in item]
        return item

    return json.dumps(plain(value), default=str)


def _hint_at(root: type[Any], path: list[str]) -> Any:
    hint: Any = root
    for part in path:
        if not (dataclasses.is_dataclass(hint) and isinstance(hint, type)):
            return None
        hints = typing.get_type_hints(hint)
        if part not in hints:
            return None
        hint = hints[part]
    return hint


def _read_file(path: str) -> Mapping[str, Any]:
    try:
        with Path(path).open("rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        msg = f"config file {path}: {exc.strerror or exc}"
        raise ConfigError(msg) from None
    if len(raw) > MAX_CONFIG_BYTES:
        msg = f"config file {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB"
        raise ConfigError(msg)
    try:
        data = load_yaml(_decode(path, raw))
    except YamlProblem as exc:
        where = "" if exc.line is None else f" line {exc.line}"
        msg = f"config file {path}{where}: {exc.why}"
        raise ConfigError(msg) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        msg = f"config file {path}: expected a mapping of settings at the top"
        raise ConfigError(msg)
    return data


def _decode(path: str, raw: bytes) -> str:
    """UTF-8 text (a byte-order mark allowed); anything else is refused with what it looks like."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or (
        len(raw) > 1 and b"\x00" in raw[:2]
    ):
        msg = f"config file {path}: UTF-16 text; save it as UTF-8"
        raise ConfigError(msg)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        msg = f"config file {path}: not UTF-8 text ({where})"
        raise ConfigError(msg) from None


def _check_layer(root: type[Any], layer: Mapping[str, Any], source: str) -> None:
    known = {f.name for f in dataclasses.fields(root)}
    for key in layer:
        if key not in known:
            shown = shorten(str(key))
            hint = did_you_mean(str(key), known)
            listed = ", ".join(sorted(known))
            msg = f"{shown}: unknown key{hint} (from {source}; known keys: {listed})"
            raise ConfigError(msg)


def set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    """Set `value` at the nested key `path`, creating mappings on the way."""
    for part in path[:-1]:
        nested = target.setdefault(part, {})
        if not isinstance(nested, dict):
            nested = target[part] = {}
        target = nested
    target[path[-1]] = value


def _deep_merge(target: dict[str, Any], layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        current = target.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            merged = dict(current)
            _deep_merge(merged, value)
            target[key] = merged
        elif isinstance(value, Mapping):
            target[key] = dict(value)
        else:
            target[key] = value
