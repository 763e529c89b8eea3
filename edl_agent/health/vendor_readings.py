"""Polled health for vendors without an event API: Kunlunxin (`xpu-smi`), Hygon (`hy-smi`) and
Ascend (`npu-smi`).

A poll runs the vendor's tool once (Ascend: once more per chip whose Health is not OK, for its
fault codes), and reports the state it read, not changes:

- `events`: one HealthEvent per device that is not OK right now (its most severe finding; the
  detail lists the others). A device that reads OK gets no event.
- `checked`: the ids of the devices whose state this poll read. A device in `checked` without an
  event is OK now: whatever it reported before is over (`clears` turns that into cleared events).
- When the tool cannot be run or its output cannot be read, the poll reports one vendor-level
  event (`device_id` None, reason `<TOOL>_FAILED`, level WARN) and checks no device: the devices
  keep their last state, because a broken tool says nothing about the hardware.

Device-node presence is checked elsewhere (health.presence); a device the tool no longer lists
is reported here (`<KIND>_NOT_REPORTED`, DEVICE_FATAL), as discovery does.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from edl_agent.config import HealthSettings
from edl_agent.devices import ascend, hygon, kunlunxin
from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.model import Device, Vendor
from edl_agent.fault_codes import format_ascend_code
from edl_agent.health.ascend_fault_codes import ascend_fault_type
from edl_agent.health.classify import (
    classify_device_state,
    classify_ecc_dbe,
    classify_npu_fault,
    most_severe,
)
from edl_agent.health.model import DeviceTelemetry, HealthEvent, Level

Clock = Callable[[], float]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class PollResult:
    vendor: Vendor
    at: float
    ok: bool
    """False when the tool failed: `events` holds the `<TOOL>_FAILED` event, `checked` is empty."""
    events: list[HealthEvent] = field(default_factory=list)
    telemetry: list[DeviceTelemetry] = field(default_factory=list)
    checked: frozenset[str] = frozenset()


class Poller(Protocol):
    def __call__(
        self,
        root: HostRoot,
        devices: Sequence[Device],
        settings: HealthSettings,
        *,
        clock: Clock = ...,
    ) -> PollResult: ...


@dataclass(frozen=True)
class _Finding:
    level: Level
    reason: str
    detail: str
    code: int | None = None


def poll_kunlunxin(
    root: HostRoot,
    devices: Sequence[Device],
    settings: HealthSettings,
    *,
    clock: Clock = time.monotonic,
) -> PollResult:
    """Read `xpu-smi -q` once: per XPU its (designed) `XPU State`, volatile DRAM ECC counts and
    live figures. Of `settings` only the tool's timeout applies (Kunlunxin has no overrides)."""
    at = clock()
    mine = _of(devices, Vendor.KUNLUNXIN)
    try:
        report = root.read_tool(
            kunlunxin.TOOL,
            kunlunxin.QUERY_ARGS,
            kunlunxin.parse_xpu_smi_query,
            timeout=settings.tool_timeout_seconds,
        )
    except ToolError as exc:
        return _failed(Vendor.KUNLUNXIN, "XPU_SMI_FAILED", str(exc), at)
    records = kunlunxin.records_by_index(report)
    result = _Builder(Vendor.KUNLUNXIN, at)
    for device in mine:
        record = records.get(device.index)
        if record is None:
            result.missing(device, "XPU_NOT_REPORTED", f"{kunlunxin.TOOL} does not list it")
            continue
        findings = _state_findings("XPU", record.state)
        if record.ecc_uncorrected:
            detail = f"{record.ecc_uncorrected} uncorrectable DRAM ECC errors since driver load"
            findings.append(_Finding(classify_ecc_dbe(), "XPU_ECC_DBE", detail))
        result.device(device, findings)
        result.telemetry.append(
            DeviceTelemetry(
                device_id=device.id,
                temperature_c=record.temperature_c,
                power_w=record.power_w,
                utilization_percent=record.utilization_percent,
                memory_used_mib=record.memory_used_mib,
                memory_total_mib=float(record.memory_mib) if record.memory_mib else None,
                ecc_corrected_total=record.ecc_corrected,
                ecc_uncorrected_total=record.ecc_uncorrected,
            )
        )
    return result.done()


def poll_hygon(
    root: HostRoot,
    devices: Sequence[Device],
    settings: HealthSettings,
    *,
    clock: Clock = time.monotonic,
) -> PollResult:
    """Read `hy-smi <STATUS_ARGS> --json` (DTK's rocm-smi where hy-smi is missing) once: per DCU
    its (designed) `DCU State` and live figures. Of `settings` only the tool's timeout applies
    (Hygon has no overrides). A DCU is matched by the PCI address its `PCI Bus` value starts
    with; one whose entry has no address is matched by hy-smi's card index."""
    at = clock()
    mine = _of(devices, Vendor.HYGON)
    tool = hygon.smi_tool(root, hygon_cards=True)
    try:
        statuses = root.read_tool(
            tool or hygon.TOOL,
            hygon.STATUS_ARGS,
            hygon.parse_hy_smi_status,
            timeout=settings.tool_timeout_seconds,
        )
    except ToolError as exc:
        return _failed(Vendor.HYGON, "HY_SMI_FAILED", str(exc), at)
    by_bus = {status.bus_id: status for status in statuses.values() if status.bus_id}
    result = _Builder(Vendor.HYGON, at)
    for device in mine:
        status = by_bus.get(device.pci_bus_id or "")
        if status is None:
            by_index = statuses.get(device.index)
            status = by_index if by_index is not None and by_index.bus_id is None else None
        if status is None:
            result.missing(
                device, "DCU_NOT_REPORTED", f"{_tool_name(tool, hygon.TOOL)} does not list it"
            )
            continue
        findings = _state_findings("DCU", status.state)
        result.device(device, findings)
        result.telemetry.append(
            DeviceTelemetry(
                device_id=device.id,
                temperature_c=status.temperature_c,
                power_w=status.power_w,
                utilization_percent=status.utilization_percent,
                memory_used_mib=status.memory_used_mib,
                memory_total_mib=status.memory_total_mib
                or (float(device.memory_mib) if device.memory_mib else None),
            )
        )
    return result.done()


def poll_ascend(
    root: HostRoot,
    devices: Sequence[Device],
    settings: HealthSettings,
    *,
    clock: Clock = time.monotonic,
) -> PollResult:
    """Read `npu-smi info` once, and `npu-smi info -t health -i <npu> -c <chip>` for each chip
    whose Health is not OK: its fault codes decide the level (`health.ascend_code_levels`
    overrides the table). When that second query fails the Health word alone decides."""
    at = clock()
    mine = _of(devices, Vendor.ASCEND)
    try:
        info = root.read_tool(
            ascend.TOOL,
            ascend.QUERY_ARGS,
            ascend.parse_npu_smi_info,
            timeout=settings.tool_timeout_seconds,
        )
    except ToolError as exc:
        return _failed(Vendor.ASCEND, "NPU_SMI_FAILED", str(exc), at)
    records = {record.index: record for record in info.npus}
    result = _Builder(Vendor.ASCEND, at)
    for device in mine:
        record = records.get(device.index)
        if record is None:
            result.missing(device, "NPU_NOT_REPORTED", f"{ascend.TOOL} does not list it")
            continue
        findings = []
        if record.health is not None and record.health.strip().upper() != "OK":
            finding = _npu_finding(root, ascend.TOOL, record, settings)
            if finding is not None:
                findings.append(finding)
        result.device(device, findings)
        result.telemetry.append(
            DeviceTelemetry(
                device_id=device.id,
                temperature_c=record.temperature_c,
                power_w=record.power_w,
                utilization_percent=record.aicore_percent,
                memory_used_mib=record.memory_used_mib,
                memory_total_mib=float(record.memory_mib) if record.memory_mib else None,
            )
        )
    return result.done()


POLLERS: Mapping[Vendor, Poller] = {
    Vendor.KUNLUNXIN: poll_kunlunxin,
    Vendor.HYGON: poll_hygon,
    Vendor.ASCEND: poll_ascend,
}


def poll(
    vendor: Vendor,
    root: HostRoot,
    devices: Sequence[Device],
    settings: HealthSettings,
    *,
    clock: Clock = time.monotonic,
    poller: Poller | None = None,
) -> PollResult:
    """Poll `vendor` with `poller`, else its POLLERS entry (NVIDIA reports through NVML events
    instead)."""
    poller = poller or POLLERS.get(vendor)
    if poller is None:
        msg = f"no polled health for {vendor.value}"
        raise ValueError(msg)
    try:
        return poller(root, devices, settings, clock=clock)
    except Exception as exc:  # a poll never raises: whatever broke is the monitor failing
        detail = f"{type(exc).__name__}: {exc}"[:300]
        return _failed(vendor, f"{vendor.value.upper()}_POLL_FAILED", detail, clock())


def clears(active: Mapping[str | None, HealthEvent], result: PollResult) -> list[HealthEvent]:
    """Cleared events for what `result` shows is over.

    `active` holds the last event still in force per device id (None for the vendor-level tool
    event) from earlier polls of the same vendor. A device's condition is over when this poll
    checked the device and reported nothing for it; the tool event is over when the tool worked.
    """
    reported = {event.device_id for event in result.events}
    over = [
        event
        for device_id, event in active.items()
        if device_id not in reported
        and (device_id in result.checked if device_id is not None else result.ok)
    ]
    return [replace(event, cleared=True, at=result.at) for event in over]


def _npu_finding(
    root: HostRoot, tool: str, record: ascend.NpuRecord, settings: HealthSettings
) -> _Finding | None:
    health, note = record.health or "unknown", ""
    codes: tuple[int, ...] = ()
    args = [arg.format(npu=record.npu_id, chip=record.chip_id) for arg in ascend.HEALTH_ARGS]
    try:
        if record.npu_id is None or record.chip_id is None:
            msg = "its NPU or chip id could not be read from the table"
            raise ToolError(msg)  # handled below like a failed query: the Health word decides
        detail = root.read_tool(
            tool, args, ascend.parse_npu_smi_health, timeout=settings.tool_timeout_seconds
        )
    except ToolError as exc:
        note = f"; fault codes unknown: {exc}"
    else:
        health, codes = detail.health, detail.codes
        if detail.information:
            note = f": {detail.information}"
    return npu_finding(health, codes, note, settings)


def npu_finding(
    health: str, codes: tuple[int, ...], note: str, settings: HealthSettings
) -> _Finding | None:
    """The finding for a chip's health word and fault codes (None when they are healthy), with
    `note` after what it lists."""
    level, code = classify_npu_fault(health, codes, settings.ascend_code_levels)
    if level is None:
        return None
    listed = ", ".join(_describe_code(c) for c in codes)
    text = f"health {health}" + (f", fault codes {listed}" if listed else "") + note
    if code is None:
        return _Finding(level, f"NPU_HEALTH_{_safe(health)}", text)
    return _Finding(level, f"NPU_FAULT_{format_ascend_code(code)}", text, code)


def _describe_code(code: int) -> str:
    fault_type = ascend_fault_type(code)
    name = format_ascend_code(code)
    return f"{name} ({fault_type.value})" if fault_type is not None else name


class _Builder:
    def __init__(self, vendor: Vendor, at: float) -> None:
        self.vendor = vendor
        self.at = at
        self.events: list[HealthEvent] = []
        self.telemetry: list[DeviceTelemetry] = []
        self.checked: set[str] = set()

    def device(self, device: Device, findings: list[_Finding]) -> None:
        self.checked.add(device.id)
        if not findings:
            return
        worst_level = most_severe(f.level for f in findings)
        worst = next(f for f in findings if f.level is worst_level)
        detail = "; ".join(f.detail for f in findings)
        self.events.append(
            HealthEvent(
                vendor=self.vendor,
                device_id=device.id,
                reason=worst.reason,
                level=worst.level,
                at=self.at,
                detail=detail,
                code=worst.code,
            )
        )

    def missing(self, device: Device, reason: str, detail: str) -> None:
        self.device(device, [_Finding(Level.DEVICE_FATAL, reason, detail)])

    def done(self) -> PollResult:
        return PollResult(
            vendor=self.vendor,
            at=self.at,
            ok=True,
            events=self.events,
            telemetry=self.telemetry,
            checked=frozenset(self.checked),
        )


def _failed(vendor: Vendor, reason: str, detail: str, at: float) -> PollResult:
    event = HealthEvent(
        vendor=vendor, device_id=None, reason=reason, level=Level.WARN, at=at, detail=detail
    )
    return PollResult(vendor=vendor, at=at, ok=False, events=[event])


def _state_findings(kind: str, state: str | None) -> list[_Finding]:
    """The finding for an XPU/DCU `State` the tool reports, if it is not a healthy one."""
    level = classify_device_state(state) if state is not None else None
    if state is None or level is None:
        return []
    return [_Finding(level, f"{kind}_STATE_{_safe(state)}", f"state {state}")]


def _tool_name(path: Path | None, default: str) -> str:
    return path.name if path is not None else default


def _of(devices: Sequence[Device], vendor: Vendor) -> list[Device]:
    return [device for device in devices if device.vendor is vendor and device.parent is None]


def _safe(word: str) -> str:
    """A vendor word as part of a reason (reasons name metric labels): no blanks or symbols."""
    return _UNSAFE.sub("_", word.strip()) or "unknown"
