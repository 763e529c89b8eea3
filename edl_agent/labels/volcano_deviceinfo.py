"""Ascend NPU health in the form Volcano's Ascend scheduling reads: the ConfigMap
`mindx-dl-deviceinfo-<node>` in `kube-system` that Huawei's device plugin (MindCluster) keeps for
each node. Pure: the writer (`volcano_writer`) does the I/O.

The object, as MindCluster writes it and its readers parse it:

- label `mx-consumer-cim: "true"` (the readers list ConfigMaps by it);
- `DeviceInfoCfg`: JSON, compact, in Go's `encoding/json` form (struct fields in declaration
  order, map keys sorted): `{"DeviceInfo": {"DeviceList": {...}, "UpdateTime": <unix s>},
  "SuperPodID": n, "ServerIndex": n, "CheckCode": "<hex>"}`. `CheckCode` is the SHA-256, in
  lower-case hex, of the `DeviceInfo` value marshalled the same way. `DeviceList` maps strings to
  strings, per chip family (`huawei.com/Ascend910`): the family's key lists the healthy NPUs,
  `<key>-Unhealthy` the unhealthy ones (names comma-joined, sorted), `<key>-Fault` a JSON array
  (as a string) of one object per faulty NPU; 910 nodes also carry `-NetworkUnhealthy` and
  `-Recovering`. NPUs are named `<family>-<physical id>` (`Ascend910-3`), the id being the
  `/dev/davinci<N>` number.
- `ManuallySeparateNPU`: the NPUs isolated until a person clears them, comma-joined;
- `UpgradeFaultReason`: why a fault's level was raised, a JSON object (`{}` here: we raise none).

A fault object's fields, in order: `fault_type` (`CardUnhealthy`), `npu_name`,
`large_model_fault_level`, `fault_level` and `fault_handling` (the same MindCluster level, the most
severe of the NPU's), `fault_code` (hex codes without `0x`, upper case, comma-joined),
`fault_time_and_level_map` (per code: `fault_time` in Unix milliseconds, `fault_level`).

Beside it, the Node annotation `baseDeviceInfos` lists every NPU of the node, healthy or not, by
the same name: `{"Ascend910-0":{"IP":"192.168.100.1","SuperDeviceID":0},...}` (Go's JSON, keys
sorted). Volcano's Ascend plugin takes the node's NPUs from its keys when it keeps the available
list itself (`self-maintain-available-card`, its default): the NPUs there, less those in use, less
the `-Unhealthy` ones. `IP` is the chip's RoCE address (for the rank table; "" where discovery
could not read one), `SuperDeviceID` 0 (no super-pod facts are read).

Levels come from `health.ascend_fault_codes` (MindCluster's table, with the operator's
`health.ascend_code_levels`); a code the table does not know, or an unhealthy NPU without a code,
takes the level our own condition implies: out until reset → `RestartNPU`, out until a person
releases it → `SeparateNPU`. `SuperPodID`/`ServerIndex` are -2, MindCluster's "not queried".
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from edl_agent.devices.model import Device, Vendor
from edl_agent.devices.resources import ascend_family
from edl_agent.fault_codes import HEX_CODE, parse_ascend_code
from edl_agent.health.ascend_fault_codes import AscendFaultType, ascend_fault_type
from edl_agent.health.model import ClearsBy, Level
from edl_agent.health.tracker import Condition

NAMESPACE = "kube-system"
NAME_PREFIX = "mindx-dl-deviceinfo-"
CONSUMER_LABEL = "mx-consumer-cim"
DEVICE_INFO_KEY = "DeviceInfoCfg"
MANUALLY_SEPARATED_KEY = "ManuallySeparateNPU"
UPGRADE_REASON_KEY = "UpgradeFaultReason"
NOT_QUERIED = -2  # SuperPodID / ServerIndex when the super-pod facts were not read
BASE_DEVICE_INFOS = "baseDeviceInfos"  # the Node annotation listing the node's NPUs
CARD_UNHEALTHY = "CardUnhealthy"

# MindCluster's levels, mildest first: a device's level is the most severe of its codes'.
LEVELS = tuple(kind.value for kind in AscendFaultType)
MANUALLY_SEPARATED = AscendFaultType.MANUALLY_SEPARATE_NPU.value
# The level our own decision implies, for what the table cannot say.
_FROM_LEVEL: Mapping[Level, str] = {
    Level.IGNORE: AscendFaultType.NOT_HANDLE.value,
    Level.WARN: AscendFaultType.RESTART_BUSINESS.value,
    Level.DEGRADED: AscendFaultType.SUB_HEALTH.value,
    Level.DEVICE_FATAL: AscendFaultType.RESTART_NPU.value,
    Level.NODE_FATAL: AscendFaultType.SEPARATE_NPU.value,
}
_CODE_IN_TEXT = re.compile(r"0x([0-9A-Fa-f]{8})\b")


@dataclass(frozen=True)
class NpuFault:
    npu: str  # Ascend910-3
    level: str  # a MindCluster level
    codes: tuple[tuple[int, str], ...] = ()  # (code, its own level), in first-seen order
    since: float | None = None  # monotonic, when our condition began


@dataclass(frozen=True)
class FamilyHealth:
    """One chip family's NPUs: `resource` is its key (`huawei.com/Ascend910`)."""

    resource: str
    healthy: tuple[str, ...]
    unhealthy: tuple[str, ...]
    faults: tuple[NpuFault, ...]


@dataclass(frozen=True)
class NpuReport:
    """What the ConfigMap says, without the update time: equal reports need no write."""

    families: tuple[FamilyHealth, ...]
    manually_separated: tuple[str, ...] = ()


def configmap_name(node: str) -> str:
    return NAME_PREFIX + node


def npu_report(
    *,
    devices: Iterable[Device],
    unhealthy: Iterable[str],
    conditions: Mapping[str, Condition],
    prefix: str = "huawei.com/",
    overrides: Mapping[str, str] | None = None,
) -> NpuReport | None:
    """The report for the node's Ascend NPUs (None without any): `unhealthy` are the ids of the
    devices withdrawn (unhealthy or degraded: only these are listed so), `conditions` the hub's
    worst condition per such device, `overrides` `health.ascend_code_levels`."""
    bad = set(unhealthy)
    groups: dict[str, list[tuple[str, Device]]] = {}
    for device in devices:
        family = ascend_family(device.product)
        if device.vendor is Vendor.ASCEND and device.parent is None and family is not None:
            groups.setdefault(prefix + family, []).append((f"{family}-{device.index}", device))
    if not groups:
        return None
    families = []
    separated: list[str] = []
    for resource, members in sorted(groups.items()):
        healthy, sick, faults = [], [], []
        for name, device in sorted(members, key=lambda member: member[1].index):
            if device.id not in bad:
                healthy.append(name)
                continue
            sick.append(name)
            fault = npu_fault(name, conditions.get(device.id), overrides)
            faults.append(fault)
            if fault.level == MANUALLY_SEPARATED:
                separated.append(name)
        families.append(FamilyHealth(resource, tuple(healthy), tuple(sick), tuple(faults)))
    return NpuReport(tuple(families), tuple(sorted(separated)))


def npu_fault(
    name: str, condition: Condition | None, overrides: Mapping[str, str] | None
) -> NpuFault:
    """The fault object of one unhealthy NPU, from our condition (None: unhealthy by discovery,
    e.g. its device node is gone, which only a person can repair)."""
    if condition is None:
        return NpuFault(name, _FROM_LEVEL[Level.NODE_FATAL])
    implied = _implied(condition)
    codes = tuple(
        (code, code_level(code, overrides) or implied)
        for code in codes_of(condition.reason + " " + condition.detail)
    )
    level = most_severe([implied, *(own for _, own in codes)])
    return NpuFault(name, level, codes, condition.since)


def _implied(condition: Condition) -> str:
    if condition.clears_by is ClearsBy.RELEASE and condition.level.unhealthy:
        return _FROM_LEVEL[Level.NODE_FATAL]
    return _FROM_LEVEL[condition.level]


def codes_of(text: str) -> tuple[int, ...]:
    """The Ascend fault codes (`0x80E01801`) a condition's reason and detail name, once each."""
    return tuple(dict.fromkeys(int(m.group(1), 16) for m in _CODE_IN_TEXT.finditer(text)))


def code_level(code: int, overrides: Mapping[str, str] | None = None) -> str | None:
    """MindCluster's level of `code`: the operator's override (our level, translated), else the
    table's type; None when neither knows it."""
    for key, value in (overrides or {}).items():
        if HEX_CODE.match(key.strip()) and parse_ascend_code(key) == code:
            return _FROM_LEVEL[Level(value)]
    kind = ascend_fault_type(code)
    return None if kind is None else str(kind)


def most_severe(levels: Iterable[str]) -> str:
    return max(levels, key=lambda level: LEVELS.index(level) if level in LEVELS else -1)


# --- rendering -----------------------------------------------------------------------------------


def go_json(value: Any) -> str:
    """`value` as Go's `json.Marshal` writes it: compact, UTF-8, with `<`, `>`, `&`, U+2028 and
    U+2029 escaped. Dicts keep their order: callers sort the maps (Go sorts map keys) and give
    structs their fields in declaration order."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def check_code(device_info: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the `DeviceInfo` value ({DeviceList, UpdateTime}) in Go's JSON form."""
    ordered = {
        "DeviceList": dict(sorted(device_info["DeviceList"].items())),
        "UpdateTime": device_info["UpdateTime"],
    }
    return hashlib.sha256(go_json(ordered).encode()).hexdigest()


def device_list(report: NpuReport, *, wall_offset: float) -> dict[str, str]:
    """The `DeviceList` map, sorted; `wall_offset` turns monotonic times into Unix seconds."""
    entries: dict[str, str] = {}
    for family in report.families:
        key = family.resource
        entries[key] = ",".join(family.healthy)
        entries[key + "-Unhealthy"] = ",".join(family.unhealthy)
        if key.endswith("Ascend910"):
            entries[key + "-NetworkUnhealthy"] = ""
            entries[key + "-Recovering"] = ""
        faults = [_fault_json(fault, wall_offset) for fault in family.faults]
        entries[key + "-Fault"] = go_json(faults)
    return dict(sorted(entries.items()))


def _fault_json(fault: NpuFault, wall_offset: float) -> dict[str, Any]:
    millis = 0 if fault.since is None else round((fault.since + wall_offset) * 1000)
    hexes = [(f"{code:X}", own) for code, own in fault.codes]
    times = {h: {"fault_time": millis, "fault_level": own} for h, own in sorted(hexes)}
    return {
        "fault_type": CARD_UNHEALTHY,
        "npu_name": fault.npu,
        "large_model_fault_level": fault.level,
        "fault_level": fault.level,
        "fault_handling": fault.level,
        "fault_code": ",".join(h for h, _ in hexes),
        "fault_time_and_level_map": times,
    }


def configmap_data(report: NpuReport, *, update_time: int, wall_offset: float) -> dict[str, str]:
    """The ConfigMap's `data`, with `UpdateTime` = `update_time` (Unix seconds)."""
    info = {"DeviceList": device_list(report, wall_offset=wall_offset), "UpdateTime": update_time}
    cache = {
        "DeviceInfo": info,
        "SuperPodID": NOT_QUERIED,
        "ServerIndex": NOT_QUERIED,
        "CheckCode": check_code(info),
    }
    return {
        DEVICE_INFO_KEY: go_json(cache),
        MANUALLY_SEPARATED_KEY: ",".join(report.manually_separated),
        UPGRADE_REASON_KEY: "{}",
    }


def base_device_infos(devices: Iterable[Device]) -> str | None:
    """The `baseDeviceInfos` annotation's value for the node's Ascend NPUs of a known chip (None
    without any): each by name, its RoCE address and super-device id."""
    infos = {}
    for device in devices:
        family = ascend_family(device.product)
        if device.vendor is Vendor.ASCEND and device.parent is None and family is not None:
            address = device.attributes.get("device_ip", "")
            infos[f"{family}-{device.index}"] = {"IP": address, "SuperDeviceID": 0}
    return go_json(dict(sorted(infos.items()))) if infos else None


def configmap(node: str, data: Mapping[str, str]) -> dict[str, Any]:
    """The whole object, for a create or a replace."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(node),
            "namespace": NAMESPACE,
            "labels": {CONSUMER_LABEL: "true"},
        },
        "data": dict(data),
    }
