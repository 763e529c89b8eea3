"""The node's current devices and their health, shared by the plugin servers and the loops that
update it. Readers take immutable snapshots; writers bump a version and wake every watcher."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from edl_agent.devices.model import Device, Health, Inventory, Resource, ResourceUnit


@dataclass(frozen=True)
class Snapshot:
    version: int
    inventory: Inventory
    unhealthy: frozenset[str]  # physical device ids
    devices: Mapping[str, Device] = field(default_factory=dict)
    resources: Mapping[str, Resource] = field(default_factory=dict)
    # Derived once per change so that every RPC reads them without rebuilding.
    units: Mapping[str, Mapping[str, ResourceUnit]] = field(default_factory=dict)
    unhealthy_all: frozenset[str] = frozenset()
    # Devices that prepared DRA claims hold (a vendor served both ways): the device plugin must
    # not hand them out, so kubelet is told they are unavailable.
    withheld: frozenset[str] = frozenset()
    unavailable: frozenset[str] = frozenset()
    # Degraded devices (physical ids, and with `degraded_all` MIG devices of a degraded GPU):
    # they serve the pods on them but are advertised unavailable, so kubelet places no new one.
    degraded: frozenset[str] = frozenset()
    degraded_all: frozenset[str] = frozenset()
    # Shadow mode (`health.shadow`): health is known and reported, but no device is withdrawn
    # from kubelet, DRA or Volcano for it.
    shadow: bool = False

    @property
    def withdrawn(self) -> frozenset[str]:
        """The unhealthy devices as kubelet, DRA and Volcano are told (none in shadow mode)."""
        return frozenset() if self.shadow else self.unhealthy_all

    @property
    def withdrawn_degraded(self) -> frozenset[str]:
        """The degraded physical devices as DRA and Volcano are told (none in shadow mode)."""
        return frozenset() if self.shadow else self.degraded

    def unit_health(self, unit: ResourceUnit) -> Health:
        """A unit is as healthy as its physical device, and a MIG device as its parent GPU; a
        device a DRA claim holds, or a degraded one, reads Unhealthy to kubelet's device-plugin
        side (no new pod is placed on it; the pods on it keep running)."""
        return Health.UNHEALTHY if unit.device_id in self.unavailable else Health.HEALTHY

    def is_unhealthy(self, device_id: str) -> bool:
        if device_id in self.unhealthy:
            return True
        device = self.devices.get(device_id)
        if device is None or device.health is Health.UNHEALTHY:
            return True
        return device.parent is not None and self.is_unhealthy(device.parent)


def _snapshot(
    version: int,
    inventory: Inventory,
    unhealthy: frozenset[str],
    withheld: frozenset[str],
    degraded: frozenset[str],
    *,
    shadow: bool,
) -> Snapshot:
    partial = Snapshot(
        version=version,
        inventory=inventory,
        unhealthy=unhealthy,
        degraded=degraded,
        shadow=shadow,
        devices={d.id: d for d in inventory.devices},
        resources={r.name: r for r in inventory.resources},
        units={r.name: {u.id: u for u in r.units} for r in inventory.resources},
    )
    return _with_unhealthy(partial, version, unhealthy, withheld)


def _with_unhealthy(
    snapshot: Snapshot,
    version: int,
    unhealthy: frozenset[str],
    withheld: frozenset[str] | None = None,
    degraded: frozenset[str] | None = None,
) -> Snapshot:
    """`snapshot` with another unhealthy (or withheld, or degraded) set: the maps derived from
    the inventory are kept (a health change on the hot path must not rebuild thousands of share
    units)."""
    held = snapshot.withheld if withheld is None else withheld
    worn = snapshot.degraded if degraded is None else degraded
    partial = dataclasses.replace(
        snapshot, version=version, unhealthy=unhealthy, withheld=held, degraded=worn
    )
    unhealthy_all = frozenset(d for d in partial.devices if partial.is_unhealthy(d))
    degraded_all = frozenset(
        d.id
        for d in partial.devices.values()
        if d.id not in unhealthy_all and (d.id in worn or d.parent in worn)
    )
    parents = _parents(partial, held)
    related = frozenset(
        d.id
        for d in partial.devices.values()
        if d.id in held or d.parent in held or d.id in parents
    )
    withdrawn = frozenset() if partial.shadow else unhealthy_all | degraded_all
    return dataclasses.replace(
        partial,
        unhealthy_all=unhealthy_all,
        degraded_all=degraded_all,
        unavailable=withdrawn | related,
    )


def _parents(snapshot: Snapshot, ids: frozenset[str]) -> set[str]:
    """The GPUs whose MIG devices are among `ids`: a GPU with a claimed partition is not whole."""
    parents = set()
    for device_id in ids:
        device = snapshot.devices.get(device_id)
        if device is not None and device.parent is not None:
            parents.add(device.parent)
    return parents


class DeviceState:
    """Thread-safe holder of the latest snapshot, with change notification."""

    def __init__(self, inventory: Inventory, *, shadow: bool = False) -> None:
        """`shadow`: report health without withdrawing devices (see `Snapshot.shadow`)."""
        self._changed = threading.Condition()
        self._closed = False
        empty: frozenset[str] = frozenset()
        self._current = _snapshot(1, inventory, empty, empty, empty, shadow=shadow)
        self._allocated: dict[str, float] = {}

    def hand_out(self, device_ids: Collection[str], now: float) -> frozenset[str]:
        """The device plugin hands these physical devices out: recorded (kubelet lists them on
        its pod-resources API only a moment later) unless a DRA claim holds one; returns those
        held, and then records nothing. One lock with `reserve_for_claim`: never both."""
        with self._changed:
            current = self._current
            held = current.unavailable - current.unhealthy_all - current.degraded_all
            refused = frozenset(d for d in device_ids if d in held)
            if not refused:
                for device_id in device_ids:
                    self._allocated[device_id] = now
            return refused

    def reserve_for_claim(
        self, device_id: str, device_plugin_holds: Collection[str], since: float
    ) -> str | None:
        """A DRA claim takes `device_id` unless the device plugin holds it (or its GPU, or one of
        its partitions): kubelet's pod-resources answer in `device_plugin_holds`, or a hand-out
        at or after `since`. Reserved at once (withheld); returns why not otherwise."""
        with self._changed:
            current = self._current
            self._allocated = {d: t for d, t in self._allocated.items() if t >= since}
            busy = set(device_plugin_holds) | set(self._allocated)
            device = current.devices.get(device_id)
            related = {device_id}
            if device is not None and device.parent is not None:
                related.add(device.parent)
            related |= {d.id for d in current.devices.values() if d.parent == device_id}
            if related & busy:
                return "held by a device-plugin pod"
            if device_id not in current.withheld:
                withheld = current.withheld | {device_id}
                self._publish(
                    _with_unhealthy(current, current.version + 1, current.unhealthy, withheld)
                )
            return None

    def snapshot(self) -> Snapshot:
        with self._changed:
            return self._current

    def set_inventory(self, inventory: Inventory) -> bool:
        """Replace the inventory; True (and watchers woken) when anything a watcher sees changed."""
        with self._changed:
            current = self._current
            if inventory == current.inventory:
                return False
            self._publish(
                _snapshot(
                    current.version + 1,
                    inventory,
                    current.unhealthy,
                    current.withheld,
                    current.degraded,
                    shadow=current.shadow,
                )
            )
            return True

    def set_unhealthy(
        self, device_ids: Collection[str], degraded: Collection[str] | None = None
    ) -> bool:
        """Replace the set of devices found unhealthy by watchers (and, when given, the set of
        degraded ones); True when it changed."""
        with self._changed:
            current = self._current
            unhealthy = frozenset(device_ids)
            worn = current.degraded if degraded is None else frozenset(degraded)
            if unhealthy == current.unhealthy and worn == current.degraded:
                return False
            self._publish(_with_unhealthy(current, current.version + 1, unhealthy, degraded=worn))
            return True

    def set_withheld(self, device_ids: Collection[str]) -> bool:
        """Replace the set of devices that DRA claims hold; True when it changed."""
        with self._changed:
            current = self._current
            withheld = frozenset(device_ids)
            if withheld == current.withheld:
                return False
            self._publish(
                _with_unhealthy(current, current.version + 1, current.unhealthy, withheld)
            )
            return True

    def wait_newer(
        self, version: int, timeout: float | None, cancel: threading.Event | None = None
    ) -> Snapshot | None:
        """The first snapshot newer than `version`, or None on timeout (None: no timeout), close
        or `cancel`. Whoever sets `cancel` calls `wake()` after it."""

        def done() -> bool:
            cancelled = cancel is not None and cancel.is_set()
            return self._closed or cancelled or self._current.version > version

        with self._changed:
            self._changed.wait_for(done, timeout=timeout)
            if self._closed or (cancel is not None and cancel.is_set()):
                return None
            if self._current.version <= version:
                return None
            return self._current

    def wake(self) -> None:
        """Wake every waiter so that it re-checks its own cancel event."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Wake every watcher for good (shutdown)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        with self._changed:
            return self._closed

    def _publish(self, snapshot: Snapshot) -> None:
        self._current = snapshot
        self._changed.notify_all()
