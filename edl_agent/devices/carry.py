"""What re-discovery may take away, and what it may not. Pure.

A vendor tool that breaks (exits non-zero, hangs, prints garbage or too much: discovery then
reports an error and no devices) says nothing about the hardware, so its vendor's previous
devices stay advertised as they were and the vendor is reported as failed (its monitor, not its
devices). A device that a working discovery no longer
lists has not vanished for the pods holding it: it stays advertised, Unhealthy, and is reported
gone (which turns into a health event with faults for its pods) until it is listed again. MIG
devices follow their GPU: a MIG device missing while its GPU is listed was reconfigured away.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from edl_agent.devices.model import Device, Health, Inventory, Vendor, VendorReport
from edl_agent.devices.resources import advertised_resources
from edl_agent.devices.settings import DeviceSettings


@dataclass(frozen=True)
class Carried:
    inventory: Inventory
    """What to advertise now."""
    failed: Mapping[Vendor, str]
    """Vendors whose discovery failed this time, with the error; their devices were kept."""
    gone: tuple[Device, ...]
    """Devices listed before and not now by a working discovery: kept, Unhealthy."""
    returned: frozenset[str]
    """Ids of devices carried as gone before and listed again now."""


def carry_forward(
    previous: Inventory, fresh: Inventory, *, carried: frozenset[str], settings: DeviceSettings
) -> Carried:
    """The inventory to advertise after a re-discovery that found `fresh`, given what was
    advertised (`previous`) and the ids carried as gone so far (`carried`)."""
    before = {report.vendor: report for report in previous.reports}
    reports: list[VendorReport] = []
    failed: dict[Vendor, str] = {}
    gone: list[Device] = []
    for report in fresh.reports:
        old = before.get(report.vendor)
        if report.error and (not report.devices or _degraded(old, report)):
            # The tool or library failed: outright, or a fallback listed less than it knew
            # (Ascend and Hygon list /dev or sysfs then, without products or memory).
            failed[report.vendor] = report.error
            reports.append(old if old is not None and old.devices else report)
            continue
        # A partial error (one GPU lost, the others read as before) is about devices, not the
        # monitor: the devices it could not read are carried as gone.
        kept = _missing(old, report) if old is not None else []
        gone += kept
        reports.append(dataclasses.replace(report, devices=report.devices + tuple(kept)))
    listed = {report.vendor for report in fresh.reports}
    for vendor, old in before.items():
        if vendor not in listed and old.devices:
            failed[vendor] = "discovery reported nothing for this vendor"
            reports.append(old)
    devices = [device for report in reports for device in report.devices]
    fresh_ids = {device.id for report in fresh.reports for device in report.devices}
    return Carried(
        inventory=Inventory(
            fresh.node, tuple(reports), advertised_resources(devices, settings), fresh.host
        ),
        failed=failed,
        gone=tuple(gone),
        returned=frozenset(carried & fresh_ids),
    )


def _missing(old: VendorReport, new: VendorReport) -> list[Device]:
    """`old`'s devices that `new` does not list (MIG devices only with their GPU), Unhealthy."""
    listed = {device.id for device in new.devices}
    missing = [
        device
        for device in old.devices
        if device.id not in listed and (device.parent is None or device.parent not in listed)
    ]
    return [dataclasses.replace(device, health=Health.UNHEALTHY) for device in missing]


def _degraded(old: VendorReport | None, new: VendorReport) -> bool:
    """Whether `new` reads any device it shares with `old` differently (a fallback's view)."""
    if old is None:
        return False
    known = {
        device.id: dataclasses.replace(device, health=Health.HEALTHY) for device in old.devices
    }
    return any(
        device.id in known
        and known[device.id] != dataclasses.replace(device, health=Health.HEALTHY)
        for device in new.devices
    )
