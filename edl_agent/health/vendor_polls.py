"""The polled vendors (Kunlunxin XPU, Hygon DCU, Ascend NPU): one `poll-<vendor>` part each, so
a vendor tool that hangs holds up only its own vendor. Hygon is read through DTK's rocm_smi
library where it answers (`hygon_library`), Ascend through the driver's DCMI library
(`ascend_library`), each through its tool otherwise.

A vendor tool sends no events: it is read every `health.poll_seconds` (the operator's choice,
1 s by default, for the fault-to-Unhealthy time it buys; `health.vendor_poll_seconds` sets a
vendor's own). Each round reports the tool's health
events to the hub, keeps its telemetry for /metrics, and tells the hub which polled conditions a
working poll no longer shows: the vendors' drivers hold a reset-class fault (an NPU's RestartNPU
code, an XPU/DCU `Fault` state, a volatile ECC count) until the device is reset, so a device the
tool reads clean again was reset (conditions that wait for a reboot or a person stay).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from edl_agent.config import HealthSettings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.ascend_library import poll_ascend_auto
from edl_agent.health.hub import HealthHub
from edl_agent.health.hygon_library import poll_hygon_auto
from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.state import DeviceState
from edl_agent.health.vendor_readings import POLLERS, Poller, poll
from edl_agent.runtime.supervisor import Every

POLLED_REASON_PREFIXES = ("XPU_", "DCU_", "NPU_")
# Vendors read through their library where it answers (each falls back to its tool by itself).
LIBRARY_POLLERS: dict[Vendor, Poller] = {
    Vendor.HYGON: poll_hygon_auto,
    Vendor.ASCEND: poll_ascend_auto,
}


class VendorPolls:
    def __init__(
        self, hub: HealthHub, state: DeviceState, root: HostRoot, settings: HealthSettings
    ) -> None:
        self._hub = hub
        self._state = state
        self._root = root
        self._settings = settings
        self.telemetry: dict[Vendor, list[DeviceTelemetry]] = {}

    def parts(self, waker: Callable[[], threading.Event]) -> list[Every]:
        """A `poll-<vendor>` part for each polled vendor on the node."""
        vendors = [r.vendor for r in self._state.snapshot().inventory.reports]
        return [
            Every(
                f"poll-{vendor.value}",
                functools.partial(self._settings.poll_seconds_of, vendor.value),
                functools.partial(self.poll, vendor),
                waker(),
            )
            for vendor in vendors
            if vendor in POLLERS
        ]

    def poll(self, vendor: Vendor) -> None:
        """One poll of one vendor's tool (the step of its part)."""
        devices = [d for d in self._state.snapshot().inventory.devices if d.vendor is vendor]
        if not devices:
            return
        result = poll(
            vendor, self._root, devices, self._settings, poller=LIBRARY_POLLERS.get(vendor)
        )
        self.telemetry[vendor] = result.telemetry
        for event in result.events:
            self._hub.report(event)
        if not result.ok:
            return
        reported: dict[str, set[str]] = {}
        for event in result.events:
            if event.device_id is not None and event.level.kept:
                reported.setdefault(event.device_id, set()).add(event.reason)
        self._hub.polled_ok(vendor, result.checked, reported, POLLED_REASON_PREFIXES)

    def all_telemetry(self) -> list[DeviceTelemetry]:
        return [figure for figures in list(self.telemetry.values()) for figure in figures]
