"""The `nvml-wear` part: reads every NVIDIA GPU each `health.degraded.poll_seconds` and tells
the health hub which warnings (`nvml_wear`) open and which end. It compares with what the hub
holds, not with what it said before, so a warning the hub ended on other evidence (a reset) is
opened again while the readings still show it, and an idle node's rounds write nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.hub import HealthHub
from edl_agent.health.model import ClearsBy, HealthEvent, Level
from edl_agent.health.nvml_telemetry import NvmlTelemetry
from edl_agent.health.nvml_wear import WEAR_REASONS, Wear, changes
from edl_agent.health.tracker import HealthTracker
from edl_agent.health_settings import DegradedSettings


class WearWatch:
    name = "nvml-wear"

    def __init__(
        self,
        hub: HealthHub,
        root: HostRoot,
        settings: DegradedSettings,
        wake: threading.Event,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hub = hub
        self._root = root
        self._settings = settings
        self._wake = wake
        self._clock = clock
        self.wear = Wear(settings)
        self.rounds = 0
        self._log = structlog.get_logger().bind(part=self.name, vendor=Vendor.NVIDIA.value)

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        with NvmlTelemetry(self._root) as telemetry:
            while not stop.is_set():
                self.step(telemetry)
                ready()
                self._wake.wait(self._settings.poll_seconds)
                self._wake.clear()

    def step(self, telemetry: NvmlTelemetry) -> None:
        """One round: read, compare with the hub, report what opened and what ended."""
        readings = telemetry.read()
        now = self._clock()
        found = self.wear.read(readings, now)
        opened, ended = changes(found, self._hub.read(_held))
        for device_id, reason, detail in opened:
            self._hub.report(
                HealthEvent(
                    Vendor.NVIDIA,
                    device_id,
                    reason,
                    Level.DEGRADED,
                    now,
                    detail=detail,
                    clears_by=ClearsBy.CONDITION,
                )
            )
        for device_id, reason in ended:
            self._hub.report(
                HealthEvent(Vendor.NVIDIA, device_id, reason, Level.DEGRADED, now, cleared=True)
            )
        self.rounds += 1


def _held(tracker: HealthTracker) -> dict[str, list[str]]:
    """The warnings of this part that the hub holds, by device."""
    held: dict[str, list[str]] = {}
    for device_id, conditions in tracker.open_conditions().items():
        reasons = [c.reason for c in conditions if c.reason in WEAR_REASONS]
        if reasons:
            held[device_id] = reasons
    return held
