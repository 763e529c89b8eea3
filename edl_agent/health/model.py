"""Health events and telemetry: what watchers and pollers report, vendor-neutral and pure data."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from edl_agent.devices.model import Vendor


class Level(enum.StrEnum):
    """What a fault means for scheduling, from least to most severe."""

    IGNORE = "ignore"  # an application's own error (e.g. XID 13): count it, change nothing
    WARN = "warn"  # worth a log line and a metric; the device stays schedulable
    # The device still serves the pod on it but takes no new work: a fault is coming (ECC errors
    # climbing, rows pending remap, a downgraded link), so the pod may leave gracefully first.
    DEGRADED = "degraded"
    DEVICE_FATAL = "device_fatal"  # the device must not be allocated until it recovers
    NODE_FATAL = "node_fatal"  # the device is gone or needs a reset/reboot; stays until sound

    @property
    def unhealthy(self) -> bool:
        return self in (Level.DEVICE_FATAL, Level.NODE_FATAL)

    @property
    def kept(self) -> bool:
        """Whether an event at this level opens a condition on its device (Degraded or worse)."""
        return self is Level.DEGRADED or self.unhealthy

    @property
    def rank(self) -> int:
        return _LEVEL_ORDER.index(self)


_LEVEL_ORDER = tuple(Level)


class ClearsBy(enum.StrEnum):
    """What ends a condition that makes a device unhealthy, from the vendor's catalog.

    Severe faults never end with time alone: only evidence does (see `ends`).
    """

    NOTHING = "nothing"  # counted only; the device is never quarantined for it
    CONDITION = "condition"  # lasts while its source reports it (a poll, a missing /dev node)
    QUIET = "quiet"  # ends after `health.quiet_seconds` without a repeat (an operator's choice)
    RESET = "reset"  # a reset of that device, observed (a reboot resets every device too)
    REBOOT = "reboot"  # a reboot of the node: a new boot id
    RELEASE = "release"  # an operator's release (the edl.io/release-devices annotation)

    @property
    def persistent(self) -> bool:
        """Kept in the state directory: an agent restart is not evidence of anything."""
        return self in (ClearsBy.RESET, ClearsBy.REBOOT, ClearsBy.RELEASE)


class Evidence(enum.StrEnum):
    """What the agent observed that may end conditions."""

    GONE = "gone"  # the source reports the condition over (a poll reads OK, the node is back)
    QUIET = "quiet"  # `quiet_seconds` passed without a repeat
    RESET = "reset"  # the device was reset (observed, or performed and validated by the agent)
    REBOOT = "reboot"  # the node's boot id changed
    RELEASE = "release"  # an operator released the device


_ENDED_BY: dict[ClearsBy, frozenset[Evidence]] = {
    ClearsBy.NOTHING: frozenset(Evidence),
    ClearsBy.CONDITION: frozenset(
        {Evidence.GONE, Evidence.RESET, Evidence.REBOOT, Evidence.RELEASE}
    ),
    ClearsBy.QUIET: frozenset(
        {Evidence.GONE, Evidence.QUIET, Evidence.RESET, Evidence.REBOOT, Evidence.RELEASE}
    ),
    ClearsBy.RESET: frozenset({Evidence.RESET, Evidence.REBOOT, Evidence.RELEASE}),
    ClearsBy.REBOOT: frozenset({Evidence.REBOOT, Evidence.RELEASE}),
    ClearsBy.RELEASE: frozenset({Evidence.RELEASE}),
}


def ends(clears_by: ClearsBy, evidence: Evidence) -> bool:
    """Whether `evidence` ends a condition that `clears_by` clears. An operator's release ends
    everything; a reboot ends everything but what needs a person; a reset ends what a reset
    clears; a source saying "over" ends only what lasts while reported."""
    return evidence in _ENDED_BY[clears_by]


@dataclass(frozen=True)
class HealthEvent:
    """One observation about one device (or, with `device_id` None, a whole vendor's monitor).

    `reason` is short and stable (`XID79`, `ECC_DBE`, `GPU_LOST`, `NODE_VANISHED`,
    `NPU_HEALTH_Critical`, `NVML_INIT_FAILED`) — it names metric labels and node conditions.
    `cleared` reports that a condition a poller saw earlier is gone (the poll reads OK again).
    `at` is a monotonic timestamp. `clears_by` says what ends the condition (None: derived from
    the vendor's catalog by reason and code).
    """

    vendor: Vendor
    device_id: str | None
    reason: str
    level: Level
    at: float
    detail: str = ""
    code: int | None = None
    cleared: bool = False
    clears_by: ClearsBy | None = None  # None: `health.classify.what_clears` decides


@dataclass(frozen=True)
class DeviceTelemetry:
    """Figures read at scrape time; None where the device or its tool does not report one."""

    device_id: str
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    # Readings that warn before an NVIDIA GPU fails; None for MIG devices and other vendors.
    clock_event_reasons: int | None = None  # nvmlClocksEventReason* bits: 0x1 idle, 0x8 HW slowdown
    pcie_generation: int | None = None  # what the PCIe link trained at...
    pcie_generation_max: int | None = None  # ...and the most it can with this GPU in this slot
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    rows_pending: int | None = None  # NVML's flag: 1 while a row remapping waits for a reset
    rows_failed: int | None = None  # NVML's flag: 1 once a row remapping failed (not counts)
    recovery_action: int | None = None  # nvmlDeviceGpuRecoveryAction_t: 1 GPU_RESET, 2 NODE_REBOOT
