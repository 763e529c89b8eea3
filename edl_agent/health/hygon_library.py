"""Polled health of Hygon DCUs through DTK's rocm_smi library instead of `hy-smi`: the same
findings, reasons and levels as `vendor_readings.poll_hygon`, read in-process (no tool started).

rocm_smi has no state word; what it shows is turned into the word hy-smi's designed `DCU State`
would carry, so both paths raise the same events:

- Lost: the device's reads fail as for a device that left the bus (its PCI id still answers);
- Fault: the device counts uncorrectable ECC errors (memory controller, SDMA, GFX, MMHUB);
- Warning: its temperature is at or above the sensor's max threshold, where the driver throttles.

A DCU is matched by PCI address, as in `poll_hygon`. A library that cannot be loaded or cannot
count its devices is one vendor-level `ROCM_SMI_FAILED` event and checks no device.

`poll_hygon_auto` is the Hygon poller to run: the library where it answers, else that round the
tool, so a node without DTK's library (or with a broken one) keeps its health.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from edl_agent.config import HealthSettings
from edl_agent.devices import rocm_smi
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Vendor
from edl_agent.health.library_first import LibraryFirst
from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.vendor_readings import (
    Clock,
    PollResult,
    _Builder,
    _failed,
    _Finding,
    _of,
    _state_findings,
    poll_hygon,
)

HEALTH_SOURCE_LIBRARY = rocm_smi.HEALTH_SOURCE
HEALTH_SOURCE_TOOL = "hy-smi"  # or DTK's rocm-smi where hy-smi is missing


def library_usable(root: HostRoot) -> bool:
    """Whether DTK's rocm_smi library under `root` loads, initialises and lists its devices."""
    return rocm_smi.usable(root) is not None


def poll_hygon_library(
    root: HostRoot,
    devices: Sequence[Device],
    settings: HealthSettings,
    *,
    clock: Clock = time.monotonic,
) -> PollResult:
    """Read every DCU through rocm_smi once (module docstring). Of `settings` nothing applies
    (no tool runs). Never raises: whatever breaks is a `ROCM_SMI_FAILED` vendor event."""
    try:
        return _poll_library(root, devices, clock())
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"[:300]
        return _failed(Vendor.HYGON, "ROCM_SMI_FAILED", detail, clock())


# The Hygon poller to run: through the library where the host has it and it answers, else (that
# round) through `poll_hygon`'s tool.
poll_hygon_auto = LibraryFirst(
    vendor=Vendor.HYGON,
    find=rocm_smi.find_library,
    library=poll_hygon_library,
    tool=poll_hygon,
    library_source=HEALTH_SOURCE_LIBRARY,
    tool_source=HEALTH_SOURCE_TOOL,
)


def _poll_library(root: HostRoot, devices: Sequence[Device], at: float) -> PollResult:
    mine = _of(devices, Vendor.HYGON)
    path = rocm_smi.find_library(root)
    if path is None:
        detail = f"{rocm_smi.LIBRARY} not found under the host root"
        return _failed(Vendor.HYGON, "ROCM_SMI_FAILED", detail, at)
    try:
        readings = rocm_smi.open_library(path).read_all()
    except OSError as exc:  # its message names the file
        return _failed(Vendor.HYGON, "ROCM_SMI_FAILED", f"cannot load: {exc}", at)
    except rocm_smi.RsmiError as exc:
        return _failed(Vendor.HYGON, "ROCM_SMI_FAILED", f"{path}: {exc}", at)
    by_bus = {reading.bus_id: reading for reading in readings if reading.bus_id}
    result = _Builder(Vendor.HYGON, at)
    for device in mine:
        reading = by_bus.get(device.pci_bus_id or "")
        if reading is None:
            result.missing(device, "DCU_NOT_REPORTED", f"{rocm_smi.LIBRARY} does not list it")
            continue
        result.device(device, findings(reading))
        if reading.gone:
            continue
        result.telemetry.append(
            DeviceTelemetry(
                device_id=device.id,
                temperature_c=reading.temperature_c,
                power_w=reading.power_w,
                utilization_percent=reading.utilization_percent,
                memory_used_mib=reading.memory_used_mib,
                memory_total_mib=reading.memory_total_mib
                or (float(device.memory_mib) if device.memory_mib else None),
                ecc_corrected_total=reading.ecc_corrected,
                ecc_uncorrected_total=reading.ecc_uncorrected,
            )
        )
    return result.done()


def findings(reading: rocm_smi.DcuReading) -> list[_Finding]:
    """The state finding of one reading (the most severe that applies), worded as hy-smi's."""
    if reading.gone:
        state, why = "Lost", reading.gone_detail
    elif reading.ecc_uncorrected:
        state, why = "Fault", f"{reading.ecc_uncorrected} uncorrectable ECC errors"
    elif (
        reading.temperature_c is not None
        and reading.temperature_max_c
        and reading.temperature_c >= reading.temperature_max_c
    ):
        state = "Warning"
        why = f"{reading.temperature_c:g} C, max {reading.temperature_max_c:g} C"
    else:
        return []
    return [replace(f, detail=f"{f.detail} ({why})") for f in _state_findings("DCU", state)]
