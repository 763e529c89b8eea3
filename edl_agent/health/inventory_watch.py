"""What is on the node, watched: device-node presence and periodic re-discovery.

Presence (`check_presence`, run by the `presence` part of `health/presence_watch.py` when a
device directory changes): a device whose /dev nodes vanished cannot be given to a container, so
it is NODE_VANISHED (node fatal) until its nodes are back; a change under /dev also runs
re-discovery at once. Re-discovery (`rediscovery` part, every
`plugin.rediscover_seconds` or when woken) reads the whole node again: new devices are served,
devices no longer listed are carried forward Unhealthy (DEVICE_GONE) until listed again, and a
vendor whose discovery fails is a monitor failure (DISCOVERY_FAILED) until it works again. Both
only report to the health hub and replace the inventory in `DeviceState`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from edl_agent.config import Settings
from edl_agent.devices.carry import carry_forward
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.hub import HealthHub
from edl_agent.health.model import ClearsBy, Evidence, HealthEvent, Level
from edl_agent.health.presence import vanished
from edl_agent.health.state import DeviceState
from edl_agent.runtime.supervisor import Every

NODE_VANISHED = "NODE_VANISHED"
DEVICE_GONE = "DEVICE_GONE"
DISCOVERY_FAILED = "DISCOVERY_FAILED"


class InventoryWatch:
    def __init__(
        self,
        *,
        hub: HealthHub,
        state: DeviceState,
        root: HostRoot,
        settings: Settings,
        rediscover_now: threading.Event,
        inventory_changed: Callable[[], None],
        discovery_seconds: float = 0.0,
    ) -> None:
        self._hub = hub
        self._state = state
        self._root = root
        self._settings = settings
        self.rediscover_now = rediscover_now
        self._inventory_changed = inventory_changed
        self.discovery_seconds = discovery_seconds
        self.rediscoveries = 0
        self._vanished: frozenset[str] = frozenset()
        self._gone: frozenset[str] = frozenset()
        self._discovery_failed: frozenset[Vendor] = frozenset()
        self._log = structlog.get_logger().bind(part="inventory")

    def rediscovery(self) -> Every:
        """The `rediscovery` part."""
        every = self._settings.plugin.rediscover_seconds
        return Every("rediscovery", lambda: every, self.rediscover_step, self.rediscover_now)

    def directories(self) -> set[Path]:
        """The local directories holding the device nodes of the current inventory."""
        devices = self._state.snapshot().inventory.devices
        nodes = {node for device in devices for node in device.device_nodes}
        return {self._root.path(node).parent for node in nodes}

    def check_presence(self) -> None:
        """One presence round (the `presence` part's step)."""
        now = time.monotonic()
        devices = self._state.snapshot().inventory.devices
        missing = vanished(devices, self._root.exists)
        if missing == self._vanished:
            return
        gone, back = missing - self._vanished, self._vanished - missing
        self._vanished = missing
        for device in devices:
            if device.id in gone:
                lost = [p for p in device.device_nodes if not self._root.exists(p)]
                detail = f"missing {', '.join(lost)}"
                self._hub.report(
                    HealthEvent(
                        device.vendor, device.id, NODE_VANISHED, Level.NODE_FATAL, now, detail
                    )
                )
        if back:
            self._hub.clear(back, Evidence.GONE, reasons={NODE_VANISHED})
        self.rediscover_now.set()  # /dev changed: look at the whole node again

    def rediscover_step(self) -> None:
        """The `rediscovery` part's step (its first round's discovery ran at start)."""
        if self.rediscoveries:
            self.rediscover()
        self.rediscoveries += 1

    def rediscover(self) -> None:
        started = time.monotonic()
        fresh = discover_node(self._settings)
        self.discovery_seconds = time.monotonic() - started
        carried = carry_forward(
            self._state.snapshot().inventory, fresh, carried=self._gone, settings=self._settings
        )
        newly_gone = [d for d in carried.gone if d.id not in self._gone]
        self._gone = frozenset(d.id for d in carried.gone)
        if self._state.set_inventory(carried.inventory):
            self._log.info("inventory changed", devices=len(carried.inventory.devices))
            self._inventory_changed()
        now = time.monotonic()
        for vendor in {r.vendor for r in carried.inventory.reports}:
            failed = carried.failed.get(vendor)
            if failed is not None:
                self._hub.report(
                    HealthEvent(vendor, None, DISCOVERY_FAILED, Level.WARN, now, detail=failed)
                )
            elif vendor in self._discovery_failed:
                self._hub.report(
                    HealthEvent(vendor, None, DISCOVERY_FAILED, Level.WARN, now, cleared=True)
                )
        self._discovery_failed = frozenset(carried.failed)
        for device in newly_gone:
            detail = "no longer listed by discovery; kept, advertised Unhealthy"
            self._hub.report(
                HealthEvent(
                    device.vendor,
                    device.id,
                    DEVICE_GONE,
                    Level.DEVICE_FATAL,
                    now,
                    detail=detail,
                    clears_by=ClearsBy.CONDITION,
                )
            )
        # Being listed again ends only the device's absence: it is no evidence of a reset.
        self._hub.clear(carried.returned, Evidence.GONE, reasons={DEVICE_GONE})
