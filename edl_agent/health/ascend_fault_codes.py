"""Ascend chip fault codes and MindCluster's fault levels: the levels, what the agent does at each,
and the code table, kept as data (`ascend_fault_codes.json` beside this module).

The table is MindCluster's default `faultCode.json` (Huawei's Ascend device plugin), taken in by
`scripts/ascend-fault-codes`, which records where it came from in the file's `source`. A code
that the source lists under several levels takes the most severe of them, as MindCluster does
when one chip reports codes of several levels. Pure but for reading the package's data file once.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from edl_agent.health.model import ClearsBy, Level

DATA_FILE = "ascend_fault_codes.json"


class AscendFaultType(enum.StrEnum):
    """MindCluster's fault levels, as its device plugin spells them in its ConfigMaps, mildest
    first (its own order of severity)."""

    NOT_HANDLE = "NotHandleFault"  # does not affect the job; nothing to do
    SUB_HEALTH = "SubHealthFault"  # the chip works but warns of a coming fault
    RESTART_REQUEST = "RestartRequest"  # re-run the inference request or training step
    RESTART_BUSINESS = "RestartBusiness"  # re-run the job; the chip stays in service
    FREE_RESTART_NPU = "FreeRestartNPU"  # reset the chip once it is idle
    RESTART_NPU = "RestartNPU"  # reset the chip now, then re-run the job
    PRE_SEPARATE_NPU = "PreSeparateNPU"  # isolate the chip once its jobs have left it
    SEPARATE_NPU = "SeparateNPU"  # a reset does not help: isolate the chip
    MANUALLY_SEPARATE_NPU = "ManuallySeparateNPU"  # isolated after repeated faults; a person clears


class Action(enum.StrEnum):
    """What the agent does with a chip reporting a code of a level."""

    ADVERTISE = "advertise"  # count it; the chip stays in service
    DEGRADED = "degraded"  # warn: the chip still serves its pod (a Degraded state takes these)
    RERUN_JOB = "rerun job"  # the job retries; the chip stays in service
    RESET_WHEN_IDLE = "reset when idle"  # out of service until reset (remediation, opt-in)
    RESET = "reset"  # out of service until reset
    SEPARATE_WHEN_IDLE = "separate when idle"  # degraded: serves its pod, then out until released
    SEPARATE = "separate"  # out of service until an operator releases it


@dataclass(frozen=True)
class LevelRule:
    level: Level
    clears_by: ClearsBy
    action: Action


# Job-level types leave the chip schedulable: the job, not the device, retries, which is the job
# controller's business. Reset types drain the chip until it is reset (the driver keeps reporting
# the code until then, so the code no longer being reported is the evidence of a reset). Isolation
# types say a reset does not help: the chip is out until a person releases it. SubHealth and
# PreSeparateNPU warn: the chip is Degraded (it serves its pod, takes no new one); PreSeparateNPU's
# degradation lasts until a person releases the chip, SubHealth's while the driver reports it.
RULES: Mapping[AscendFaultType, LevelRule] = {
    AscendFaultType.NOT_HANDLE: LevelRule(Level.IGNORE, ClearsBy.NOTHING, Action.ADVERTISE),
    AscendFaultType.SUB_HEALTH: LevelRule(Level.DEGRADED, ClearsBy.CONDITION, Action.DEGRADED),
    AscendFaultType.RESTART_REQUEST: LevelRule(Level.WARN, ClearsBy.NOTHING, Action.RERUN_JOB),
    AscendFaultType.RESTART_BUSINESS: LevelRule(Level.WARN, ClearsBy.NOTHING, Action.RERUN_JOB),
    AscendFaultType.FREE_RESTART_NPU: LevelRule(
        Level.DEVICE_FATAL, ClearsBy.RESET, Action.RESET_WHEN_IDLE
    ),
    AscendFaultType.RESTART_NPU: LevelRule(Level.DEVICE_FATAL, ClearsBy.RESET, Action.RESET),
    AscendFaultType.PRE_SEPARATE_NPU: LevelRule(
        Level.DEGRADED, ClearsBy.RELEASE, Action.SEPARATE_WHEN_IDLE
    ),
    AscendFaultType.SEPARATE_NPU: LevelRule(Level.NODE_FATAL, ClearsBy.RELEASE, Action.SEPARATE),
    AscendFaultType.MANUALLY_SEPARATE_NPU: LevelRule(
        Level.NODE_FATAL, ClearsBy.RELEASE, Action.SEPARATE
    ),
}

# faultCode.json's list names, per level.
SOURCE_KEYS: Mapping[str, AscendFaultType] = {
    "NotHandleFaultCodes": AscendFaultType.NOT_HANDLE,
    "SubHealthFaultCodes": AscendFaultType.SUB_HEALTH,
    "RestartRequestCodes": AscendFaultType.RESTART_REQUEST,
    "RestartBusinessCodes": AscendFaultType.RESTART_BUSINESS,
    "FreeRestartNPUCodes": AscendFaultType.FREE_RESTART_NPU,
    "RestartNPUCodes": AscendFaultType.RESTART_NPU,
    "PreSeparateNPUCodes": AscendFaultType.PRE_SEPARATE_NPU,
    "SeparateNPUCodes": AscendFaultType.SEPARATE_NPU,
    "ManuallySeparateNPUCodes": AscendFaultType.MANUALLY_SEPARATE_NPU,
}
_SEVERITY = {kind: rank for rank, kind in enumerate(AscendFaultType)}


class TableError(ValueError):
    """A fault-code table that cannot be read; the message says where."""


@dataclass(frozen=True)
class Taken:
    """A source table read: code → level, and the codes it listed under several levels."""

    codes: Mapping[int, AscendFaultType]
    repeated: Mapping[int, tuple[AscendFaultType, ...]]


def read_source(document: Any) -> Taken:
    """MindCluster's faultCode.json (parsed) to code → level. Lists this table does not know are
    refused by name, so that a new level is not dropped without anyone noticing."""
    if not isinstance(document, dict):
        raise TableError("a fault-code table is a JSON object of code lists")
    unknown = sorted(set(document) - set(SOURCE_KEYS))
    if unknown:
        raise TableError(f"unknown fault-code list(s): {', '.join(unknown)}")
    seen: dict[int, list[AscendFaultType]] = {}
    for key, kind in SOURCE_KEYS.items():
        values = document.get(key, [])
        if not isinstance(values, list):
            raise TableError(f"{key}: a list of hex codes, not {type(values).__name__}")
        for text in values:
            seen.setdefault(_code(key, text), []).append(kind)
    codes = {code: max(kinds, key=_SEVERITY.__getitem__) for code, kinds in seen.items()}
    repeated = {c: tuple(k) for c, k in seen.items() if len(set(k)) > 1}
    return Taken(codes, repeated)


def render(taken: Taken, source: Mapping[str, str]) -> str:
    """The package's data file for `taken`: its source, then the codes per level (sorted)."""
    by_level: dict[str, list[str]] = {kind.value: [] for kind in AscendFaultType}
    for code, kind in sorted(taken.codes.items()):
        by_level[kind.value].append(f"{code:08X}")
    document = {
        "source": dict(source),
        "rule": "a code listed under several levels takes the most severe",
        "codes": by_level,
    }
    return json.dumps(document, indent=1) + "\n"


def parse_table(text: str) -> Mapping[int, AscendFaultType]:
    """The data file's codes."""
    document = json.loads(text)
    table: dict[int, AscendFaultType] = {}
    for name, values in document["codes"].items():
        kind = AscendFaultType(name)
        for value in values:
            table[_code(name, value)] = kind
    return table


@functools.cache
def table() -> Mapping[int, AscendFaultType]:
    """The shipped table, read once."""
    return parse_table((resources.files("edl_agent.health") / DATA_FILE).read_text())


def ascend_fault_type(code: int) -> AscendFaultType | None:
    """MindCluster's level of `code`; None for a code the table does not list."""
    return table().get(code)


def _code(where: str, text: object) -> int:
    if not isinstance(text, str):
        raise TableError(f"{where}: {text!r} is not a hex code")
    try:
        return int(text.strip().removeprefix("0x").removeprefix("0X"), 16)
    except ValueError:
        raise TableError(f"{where}: {text!r} is not a hex code") from None
