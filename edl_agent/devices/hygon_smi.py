"""`hy-smi --json` (and DTK's `rocm-smi --json`): text in, records out. Pure.

hy-smi follows rocm-smi's JSON (`{"card0": {...}, "system": {...}}`) but reports memory in MiB
with lower-case `vram` keys, calls a DCU `HCU` on newer drivers (`HCU use (%)` for `DCU use (%)`)
and, on BW nodes, prints JSON with missing commas and empty keys (read by `lenient_json`). Its
`--showbus` values carry more than the address (`0000:09:00.0 --> SN: ... --> OAM ID: 1`): the
leading address is taken. Every field is read on its own: a card whose product, memory or bus id
cannot be read keeps the rest, and the field is listed in `problems`. Only output with no
`card<N>` entry at all is refused. Formats: tests/fixtures/real/hygon/SOURCES.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edl_agent.devices.lenient_json import NotJsonError, read_lenient_json

_CARD = re.compile(r"^card(\d+)$")
_LEADING_BUS_ID = re.compile(
    r"^\s*([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])(?![0-9a-fA-F:.])"
)
_MIB = 1024 * 1024

_PRODUCT_KEYS = ("Card Series", "Card series", "Card Model", "Card model")
_MEMORY_MIB_KEYS = ("vram Total Memory (MiB)", "VRAM Total Memory (MiB)")
_MEMORY_BYTES_KEYS = ("VRAM Total Memory (B)", "vram Total Memory (B)")
_DRIVER_KEYS = ("Driver version", "Driver Version")
# Status keys as rocm-smi spells them and hy-smi prints them (HCU is the newer name of a DCU).
# `DCU State` is designed for the simulated tool: real hy-smi has no health field.
_TEMPERATURE_KEYS = ("Temperature (Sensor junction) (C)", "Temperature (Sensor edge) (C)")
_POWER_KEYS = (
    "Average Graphics Package Power (W)",
    "Current Socket Graphics Package Power (W)",
)
_USE_KEYS = ("HCU use (%)", "DCU use (%)", "GPU use (%)")
_USED_MIB_KEYS = ("vram Total Used Memory (MiB)", "VRAM Total Used Memory (MiB)")
_USED_BYTES_KEYS = ("VRAM Total Used Memory (B)", "vram Total Used Memory (B)")
STATE_KEY = "DCU State"
_BUS_KEYS = ("PCI Bus",)


class HySmiParseError(ValueError):
    """`hy-smi --json` printed nothing this parser can read."""


@dataclass(frozen=True)
class DcuRecord:
    """One `card<i>` entry; None where the tool printed nothing readable."""

    index: int
    product: str | None
    memory_mib: int | None
    bus_id: str | None = None  # only when hy-smi was asked for (or printed) `PCI Bus`


@dataclass(frozen=True)
class HySmiReport:
    driver_version: str | None
    dcus: tuple[DcuRecord, ...]
    problems: tuple[str, ...] = ()  # repaired JSON and unreadable fields, one line each


@dataclass(frozen=True)
class DcuStatus:
    """Live figures of one `card<i>` entry; None where hy-smi printed nothing usable."""

    index: int
    bus_id: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    state: str | None = None


def parse_hy_smi_json(text: str) -> HySmiReport:
    data, cards, problems = _cards(text)
    dcus = [_dcu_record(index, key, fields, problems) for index, key, fields in cards]
    system = data.get("system")
    driver = _first(system, _DRIVER_KEYS) if isinstance(system, dict) else None
    return HySmiReport(
        driver_version=driver,
        dcus=tuple(sorted(dcus, key=lambda d: d.index)),
        problems=tuple(problems),
    )


def parse_hy_smi_status(text: str) -> dict[int, DcuStatus]:
    """The live figures of `hy-smi <STATUS_ARGS>` by DCU index; every figure is optional."""
    statuses = {}
    for index, key, fields in _cards(text)[1]:
        statuses[index] = DcuStatus(
            index=index,
            bus_id=_bus_id(fields, key, []),
            temperature_c=_float(_first(fields, _TEMPERATURE_KEYS)),
            power_w=_float(_first(fields, _POWER_KEYS)),
            utilization_percent=_float(_first(fields, _USE_KEYS)),
            memory_used_mib=_mib(fields, _USED_MIB_KEYS, _USED_BYTES_KEYS),
            memory_total_mib=_mib(fields, _MEMORY_MIB_KEYS, _MEMORY_BYTES_KEYS),
            state=_first(fields, (STATE_KEY,)) or None,
        )
    return statuses


def _cards(
    text: str,
) -> tuple[Mapping[str, Any], list[tuple[int, str, Mapping[str, Any]]], list[str]]:
    """The JSON object, its `card<N>` entries in index order and what had to be repaired."""
    try:
        read = read_lenient_json(text)
    except NotJsonError as exc:
        raise HySmiParseError(str(exc)) from None
    problems = [f"JSON repaired: {repair}" for repair in read.repairs]
    cards: list[tuple[int, str, Mapping[str, Any]]] = []
    for key, value in read.data.items():
        match = _CARD.match(key)
        if match is None:
            continue
        if isinstance(value, dict):
            cards.append((int(match.group(1)), key, value))
        else:
            problems.append(f"{key}: not an object, skipped")
    if not cards:
        raise HySmiParseError("no card<N> entries")
    return read.data, sorted(cards), problems


def _dcu_record(index: int, key: str, fields: Mapping[str, Any], problems: list[str]) -> DcuRecord:
    product = _first(fields, _PRODUCT_KEYS) or None
    if product is None:
        problems.append(f"{key}: no Card Series")
    memory = _mib(fields, _MEMORY_MIB_KEYS, _MEMORY_BYTES_KEYS)
    if memory is None:
        problems.append(f"{key}: no numeric vram Total Memory")
    return DcuRecord(
        index=index,
        product=product,
        memory_mib=int(memory) if memory is not None else None,
        bus_id=_bus_id(fields, key, problems),
    )


def _bus_id(fields: Mapping[str, Any], key: str, problems: list[str]) -> str | None:
    """The PCI address a `PCI Bus` value starts with (`0000:09:00.0 --> SN: ...`)."""
    text = _first(fields, _BUS_KEYS)
    if text is None:
        return None
    match = _LEADING_BUS_ID.match(text)
    if match is None:
        problems.append(f"{key}: PCI Bus {text[:60]!r} holds no address")
        return None
    return match.group(1).lower()


def _first(fields: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = fields.get(key)
        if value is not None:
            return str(value).strip()
    return None


def _float(text: str | None) -> float | None:
    """A figure as hy-smi prints it (`45.0`, `12`, `41.0C`, `80W`); None for N/A and the like."""
    if text is None:
        return None
    try:
        value = float(text.rstrip("%CW ").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _mib(
    fields: Mapping[str, Any], mib_keys: tuple[str, ...], byte_keys: tuple[str, ...]
) -> float | None:
    mib = _float(_first(fields, mib_keys))
    if mib is not None:
        return mib
    in_bytes = _float(_first(fields, byte_keys))
    return in_bytes / _MIB if in_bytes is not None else None


def parse_kfd_properties(text: str) -> dict[str, int]:
    """A KFD topology `properties` file: one `name value` pair per line, values integers."""
    properties = {}
    for line in text.splitlines():
        name, _, value = line.strip().partition(" ")
        value = value.strip()
        if name and value.lstrip("-").isdigit():
            properties[name] = int(value)
    return properties
