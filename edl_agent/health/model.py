"""Health events and telemetry: what watchers and pollers report, vendor-neutral and pure data."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from edl_agent.devices.model import Vendor


class Level(enum.StrEnum):
    """What a fault means for scheduling, from least to most severe."""

    IGNORE = "ignore"  # an application's own error (e.g. XID 13): count it, change nothing
    WARN = "warn"  # worth a log line and a metric; the device stays schedulable
    DEVICE_FATAL = "device_fatal"  # the device must not be allocated until it recovers
    NODE_FATAL = "node_fatal"  # the device is gone or needs a reset/reboot; stays until sound

    @property
    def unhealthy(self) -> bool:
        return self in (Level.DEVICE_FATAL, Level.NODE_FATAL)


@dataclass(frozen=True)
class HealthEvent:
    """One observation about one device (or, with `device_id` None, a whole vendor's monitor).

    `reason` is short and stable (`XID79`, `ECC_DBE`, `GPU_LOST`, `NODE_VANISHED`,
    `NPU_HEALTH_Critical`, `NVML_INIT_FAILED`) — it names metric labels and node conditions.
    `cleared` reports that a condition a poller saw earlier is gone (the poll reads OK again).
    `at` is a monotonic timestamp.
    """

    vendor: Vendor
    device_id: str | None
    reason: str
    level: Level
    at: float
    detail: str = ""
    code: int | None = None
    cleared: bool = False


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
