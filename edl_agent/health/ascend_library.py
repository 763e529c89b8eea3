"""Polled health of Ascend NPUs through the driver's DCMI library instead of `npu-smi`: the same
findings, reasons and levels as `vendor_readings.poll_ascend`, read in-process (no tool started).

Each round reads every chip's health value and fault codes (DCMI gives both in one pass, where
the tool needs one more run per unhealthy chip); the codes decide the level through the fault
code table, the health word where there are none. A chip is matched by its physical id, N of
/dev/davinci<N>. A library that cannot be loaded or cannot list its chips is one vendor-level
`DCMI_FAILED` event and checks no device.

`poll_ascend_auto` is the Ascend poller to run: the library where it answers, else that round the
tool, so a node without the library (or with a broken one) keeps its health. Fault events come
through `dcmi_watch` beside it, within milliseconds; the poll is what clears them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from edl_agent.config import HealthSettings
from edl_agent.devices import ascend, dcmi
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
    npu_finding,
    poll_ascend,
)

FAILED = "DCMI_FAILED"


def library_usable(root: HostRoot) -> bool:
    """Whether the DCMI library under `root` loads, initialises and lists its chips."""
    return dcmi.usable(root) is not None


def poll_ascend_library(
    root: HostRoot,
    devices: Sequence[Device],
    settings: HealthSettings,
    *,
    clock: Clock = time.monotonic,
) -> PollResult:
    """Read every chip through DCMI once (module docstring). Of `settings` only the operator's
    fault-code levels apply. Never raises: whatever breaks is a `DCMI_FAILED` vendor event."""
    try:
        return _poll_library(root, devices, settings, clock())
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"[:300]
        return _failed(Vendor.ASCEND, FAILED, detail, clock())


# The Ascend poller to run: through the library where the host has it and it answers, else (that
# round) through `poll_ascend`'s tool.
poll_ascend_auto = LibraryFirst(
    vendor=Vendor.ASCEND,
    find=dcmi.find_library,
    library=poll_ascend_library,
    tool=poll_ascend,
    library_source=dcmi.HEALTH_SOURCE,
    tool_source=ascend.TOOL,
)


def _poll_library(
    root: HostRoot, devices: Sequence[Device], settings: HealthSettings, at: float
) -> PollResult:
    mine = _of(devices, Vendor.ASCEND)
    path = dcmi.find_library(root)
    if path is None:
        return _failed(Vendor.ASCEND, FAILED, f"{dcmi.LIBRARY} not found under the host root", at)
    try:
        chips = dcmi.open_library(path).chips()
    except OSError as exc:  # its message names the file
        return _failed(Vendor.ASCEND, FAILED, f"cannot load: {exc}", at)
    except dcmi.DcmiError as exc:
        return _failed(Vendor.ASCEND, FAILED, f"{path}: {exc}", at)
    by_phy = {chip.phy_id: chip for chip in chips}
    result = _Builder(Vendor.ASCEND, at)
    for device in mine:
        chip = by_phy.get(device.index)
        if chip is None:
            result.missing(device, "NPU_NOT_REPORTED", f"{dcmi.LIBRARY} does not list it")
            continue
        result.device(device, findings(chip, settings))
        result.telemetry.append(
            DeviceTelemetry(
                device_id=device.id,
                temperature_c=chip.temperature_c,
                power_w=chip.power_w,
                utilization_percent=chip.aicore_percent,
                memory_used_mib=float(chip.memory_used_mib)
                if chip.memory_used_mib is not None
                else None,
                memory_total_mib=float(chip.memory_mib) if chip.memory_mib else None,
            )
        )
    return result.done()


def findings(chip: dcmi.NpuChip, settings: HealthSettings) -> list[_Finding]:
    """The finding of one chip, worded as the tool poll words it; [] when it is healthy."""
    word = chip.health_word
    if word == "OK" and not chip.error_codes:
        return []
    note = "" if chip.codes_read else "; fault codes unknown: dcmi_get_device_errorcode_v2 failed"
    finding = npu_finding(word, chip.error_codes, note, settings)
    return [finding] if finding is not None else []
