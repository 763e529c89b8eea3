"""Devices an operator took out of service on a live node, from the Node annotation
`edl.io/cordoned-devices`. Pure.

The value lists devices separated by commas (spaces are ignored), each either a device id as
`edl-agent discover` prints it (`GPU-8f1c...`, `MIG-...`, `ascend-npu3`) or `<vendor>:<index>`
for a physical device (`nvidia:3`, `ascend:0`):

    kubectl annotate node gpu-17 edl.io/cordoned-devices=nvidia:3,GPU-8f1c2a3e-...

The agent advertises cordoned devices Unhealthy and refuses to allocate them (a cordoned GPU
takes its MIG devices along); removing the annotation, or a device from it, brings them back.
Entries naming no known device are reported, so a typo shows up in the log.

`edl.io/release-devices` takes the same list and is a one-off command: the agent ends every
quarantine of the named devices (whatever it waited for: a reset, a reboot, a person), then
removes the annotation. A fault that comes after is quarantined again as usual:

    kubectl annotate node gpu-17 edl.io/release-devices=nvidia:3
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from edl_agent.devices.model import Device

CORDONED_DEVICES = "edl.io/cordoned-devices"
RELEASE_DEVICES = "edl.io/release-devices"
_BY_INDEX = re.compile(r"([A-Za-z]+):(\d+)")


@dataclass(frozen=True)
class Cordon:
    device_ids: frozenset[str]
    unknown: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    """The devices an operator releases, and the annotation value that named them."""

    devices: Cordon
    value: str


def parse_cordoned(text: str | None) -> tuple[str, ...]:
    """The entries of the annotation, in order, without blanks and repeats."""
    entries = (part.strip() for part in (text or "").split(","))
    return tuple(dict.fromkeys(entry for entry in entries if entry))


def cordoned_devices(text: str | None, devices: Iterable[Device]) -> Cordon:
    """The device ids the annotation value names, and the entries that name none."""
    known = list(devices)
    by_id = {d.id for d in known}
    by_index = {(d.vendor.value, d.index): d.id for d in known if d.parent is None}
    ids: set[str] = set()
    unknown: list[str] = []
    for entry in parse_cordoned(text):
        found = _BY_INDEX.fullmatch(entry)
        if entry in by_id:
            ids.add(entry)
        elif found and (found.group(1).lower(), int(found.group(2))) in by_index:
            ids.add(by_index[(found.group(1).lower(), int(found.group(2)))])
        else:
            unknown.append(entry)
    return Cordon(frozenset(ids), tuple(unknown))


def cordon_annotation(annotations: Mapping[str, str] | None) -> str | None:
    return (annotations or {}).get(CORDONED_DEVICES)
