"""DRA on this node, from the agent's one device state: for every vendor served through DRA
(`serve: dra` or `both`) a kubelet plugin (registration, prepare, device health), its CDI specs
and its ResourceSlices.

- **Plugins.** One server per driver in kubelet's plugins_registry directory; a socket that went
  (a wiped directory) is served again on the next round.
- **Claims.** A prepared claim's devices are withheld from the device plugin at once (one lock
  decides between a device-plugin hand-out and a claim: `DeviceState.reserve_for_claim`), and the
  devices the device plugin holds — by kubelet's pod-resources answer or a hand-out of the last
  minute — are refused to claims. Withheld is recomputed from the checkpoint after every call.
- **Slices.** Published on every change of the device state and every `RESYNC_SECONDS`; devices
  the device plugin holds are tainted so the scheduler places no claim on them. API errors are
  retried with backoff.
- **CDI.** The vendor specs are rewritten when the inventory changes (every vendor's with
  `plugin.cdi`, whose Allocate answers name them).
- **No vendor through DRA** (and an API server): slices a former configuration published for
  this node are removed once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from edl_agent.cdi import CdiWriter, claim_cdi_id, claim_spec, vendor_spec
from edl_agent.cdi import Grant as CdiGrant
from edl_agent.config import Settings
from edl_agent.devices import names
from edl_agent.devices.container import optional_control_nodes
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Health, Inventory, Vendor
from edl_agent.dra.api import DraApi
from edl_agent.dra.checkpoint import PreparedClaims
from edl_agent.dra.kubelet_plugin import DeviceHealthMap, DraPluginServer, socket_path
from edl_agent.dra.prepare import ClaimRef, Grant, Preparer, PrepareResult
from edl_agent.dra.publisher import SlicePublisher, remove_stale_slices
from edl_agent.dra.slices import desired_slices
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.kubelet.podresources import PodResourcesClient
from edl_agent.runtime.backoff import Backoff

RESYNC_SECONDS = 60.0
# How long a device-plugin hand-out blocks a claim without kubelet's pod-resources listing it.
HAND_OUT_SECONDS = 60.0
# While a vendor is served both ways the device plugin's holdings are read this often, for the
# slices' taints (kubelet's pod-resources API cannot be watched).
BOTH_WAYS_SECONDS = 5.0
DEVICE_PLUGIN_TAINT = "edl.io/device-plugin"
Reasons = Callable[[], Mapping[str, str]]


def dra_vendors(settings: Settings) -> list[Vendor]:
    return [v for v in names.CLASSES if settings.serve(v.value) != "device-plugin"]


class _VendorHealth:
    """One driver's devices' health, as the kubelet plugin streams it, from the device state."""

    def __init__(self, state: DeviceState, vendor: Vendor, reasons: Reasons) -> None:
        self._state = state
        self._vendor = vendor
        self._reasons = reasons

    def snapshot(self) -> tuple[int, DeviceHealthMap]:
        snapshot = self._state.snapshot()
        device_names = names.device_names(snapshot.inventory.devices)
        reasons = self._reasons()
        health: dict[str, tuple[bool, str]] = {}
        for device in snapshot.inventory.devices:
            if device.vendor is self._vendor and device.id in device_names:
                healthy = device.id not in snapshot.withdrawn
                message = "" if healthy else reasons.get(device.id, "unhealthy")
                health[device_names[device.id]] = (healthy, message)
        return snapshot.version, health

    def wait_newer(self, version: int, timeout: float, cancel: threading.Event) -> bool:
        return self._state.wait_newer(version, timeout, cancel) is not None

    def wake(self) -> None:
        self._state.wake()


class _ClaimSpecs:
    """The per-claim CDI spec, written through the agent's CDI writer."""

    def __init__(self, writer: CdiWriter, state: DeviceState, settings: Settings) -> None:
        self._writer = writer
        self._state = state
        self._settings = settings

    def write(self, claim_uid: str, grants: list[Grant]) -> str:
        shares = [
            CdiGrant(
                g.device,
                memory_mib=g.consumed_capacity.get("memory") or None,
                core_percent=g.consumed_capacity.get("cores") or None,
            )
            for g in grants
        ]
        spec = claim_spec(
            claim_uid,
            shares,
            node_devices=self._state.snapshot().inventory.devices,
            settings=self._settings.plugin,
        )
        self._writer.write_claim(claim_uid, spec)
        return claim_cdi_id(claim_uid)

    def remove(self, claim_uid: str) -> None:
        self._writer.remove_claim(claim_uid)


class _NodePreparer(Preparer):
    """The driver's preparer; after every call the device plugin's view of claimed devices is
    brought in line with the checkpoint."""

    def __init__(self, after: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._after = after

    def prepare(self, claims: Iterable[ClaimRef]) -> dict[str, PrepareResult]:
        try:
            return super().prepare(claims)
        finally:
            self._after()

    def unprepare(self, claims: Iterable[ClaimRef]) -> dict[str, str | None]:
        try:
            return super().unprepare(claims)
        finally:
            self._after()


class DraNode:
    """Everything DRA for the agent; `run` is a supervised part."""

    name = "dra"

    def __init__(
        self,
        settings: Settings,
        state: DeviceState,
        root: HostRoot,
        *,
        api: DraApi | None,
        reasons: Reasons,
        pods: PodResourcesClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._state = state
        self._root = root
        self._api = api
        self._reasons = reasons
        self._pods = pods
        self._clock = clock
        self.vendors = dra_vendors(settings)
        self.node = state.snapshot().inventory.node
        self.checkpoint = PreparedClaims(Path(settings.faults.state_dir))
        self.cdi = CdiWriter(settings.dra.cdi_dir)
        self.publisher = SlicePublisher(api, self.node) if api is not None else None
        self.servers: dict[str, DraPluginServer] = {}
        self._backoff = Backoff(0.5, 30.0)
        self._publish_due = 0.0
        self._published_version = -1
        self._cdi_inventory: Inventory | None = None
        self._device_plugin_holds: frozenset[str] = frozenset()
        self._holds_read = -BOTH_WAYS_SECONDS
        self.publish_failures = 0
        # Told after every prepare and unprepare (the claims' device status is written then).
        self.claims_changed: Callable[[], None] = lambda: None
        self._log = structlog.get_logger().bind(part="dra", node=self.node)

    # --- the part --------------------------------------------------------------------------

    def start(self) -> None:
        """Withhold what the checkpoint says is prepared, write the CDI specs and serve every
        driver (before kubelet can ask)."""
        self._withhold_prepared()
        self._sync_cdi(self._state.snapshot())
        self._serve(self._state.snapshot())

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        while not stop.is_set():
            snapshot = self._state.snapshot()
            self.round(snapshot)
            wait = max(0.05, min(self._next_due() - self._clock(), RESYNC_SECONDS))
            self._state.wait_newer(snapshot.version, wait, stop)

    def round(self, snapshot: Snapshot) -> None:
        self._serve(snapshot)
        self._sync_cdi(snapshot)
        now = self._clock()
        if self._both_ways() and now - self._holds_read >= BOTH_WAYS_SECONDS:
            self._holds_read = now
            holds = self._read_device_plugin_holds(snapshot)
            if holds is not None and holds != self._device_plugin_holds:
                self._device_plugin_holds = holds
                self._published_version = -1
        if snapshot.version != self._published_version or now >= self._publish_due:
            self._publish(snapshot, now)

    def plugin_counts(self) -> dict[str, tuple[bool, int]]:
        """Driver → (kubelet accepted its plugin, claims prepared now), for the metrics."""
        servers = dict(self.servers)  # a copy: the part's thread may change the map
        return {
            driver: (server.registered.is_set(), len(self.checkpoint.claims(driver)))
            for driver, server in sorted(servers.items())
        }

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()

    # --- plugins and claims ----------------------------------------------------------------

    def _serve(self, snapshot: Snapshot) -> None:
        present = {d.vendor for d in snapshot.inventory.devices}
        registry = Path(self._settings.dra.plugins_registry_dir)
        for vendor in self.vendors:
            driver = names.driver_name(vendor)
            server = self.servers.get(driver)
            if vendor not in present:
                if server is not None:
                    server.stop()
                    del self.servers[driver]
                continue
            if server is not None and server.serving():
                continue
            if server is not None:
                self._log.warning("DRA plugin socket gone, serving again", driver=driver)
                server.stop()
            registry.mkdir(parents=True, exist_ok=True)
            server = DraPluginServer(
                driver=driver,
                socket_path=socket_path(registry, driver),
                preparer=self._preparer(vendor),
                health=_VendorHealth(self._state, vendor, self._reasons),
                timeout_seconds=self._settings.dra.health_timeout_seconds,
            )
            server.start()
            self.servers[driver] = server

    def driver_health(self, driver: str) -> DeviceHealthMap:
        """The driver's devices by name → (healthy, why not), as its plugin streams them."""
        vendor = names.vendor_of_driver(driver)
        if vendor is None:
            return {}
        return _VendorHealth(self._state, vendor, self._reasons).snapshot()[1]

    def _preparer(self, vendor: Vendor) -> Preparer:
        return _NodePreparer(
            self._after_claims,
            driver=names.driver_name(vendor),
            pool=self.node,
            read_claim=self._read_claim,
            devices=lambda: self._devices(vendor),
            checkpoint=self.checkpoint,
            claim_cdi=_ClaimSpecs(self.cdi, self._state, self._settings),
            is_available=lambda name: self._reserve(vendor, name),
        )

    def _read_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        if self._api is None:
            raise RuntimeError("no API server: claims cannot be read")
        return self._api.read_resource_claim(namespace, name)

    def _devices(self, vendor: Vendor) -> dict[str, tuple[Vendor, Device]]:
        """The vendor's devices by name, with their health as the agent knows it now."""
        snapshot = self._state.snapshot()
        device_names = names.device_names(snapshot.inventory.devices)
        found = {}
        for device in snapshot.inventory.devices:
            if device.vendor is vendor and device.id in device_names:
                known = device
                if device.id in snapshot.withdrawn:
                    known = dataclasses.replace(device, health=Health.UNHEALTHY)
                found[device_names[device.id]] = (vendor, known)
        return found

    def _reserve(self, vendor: Vendor, name: str) -> str | None:
        snapshot = self._state.snapshot()
        device_id = self._claimable(snapshot).get((names.driver_name(vendor), self.node, name))
        if device_id is None:
            return "not on this node"
        holds: frozenset[str] = frozenset()
        if self._settings.serve(vendor.value) == "both":
            known = self._read_device_plugin_holds(snapshot)
            if known is None:
                return "kubelet's pod-resources API does not answer: the device plugin may hold it"
            holds = known
        return self._state.reserve_for_claim(device_id, holds, self._clock() - HAND_OUT_SECONDS)

    def _read_device_plugin_holds(self, snapshot: Snapshot) -> frozenset[str] | None:
        holders = self._pods.pod_devices_known(snapshot.units)
        return None if holders is None else frozenset(holders)

    def _after_claims(self) -> None:
        self._withhold_prepared()
        self.claims_changed()

    def _withhold_prepared(self) -> None:
        claimable = self._claimable(self._state.snapshot())
        held = {
            claimable[key]
            for claim in self.checkpoint.claims()
            for device in claim.devices
            if (key := (claim.driver, device.pool, device.device)) in claimable
        }
        self._state.set_withheld(held)

    def _claimable(self, snapshot: Snapshot) -> dict[tuple[str, str, str], str]:
        return names.claimable(snapshot.inventory, lambda vendor: vendor in self.vendors)

    def _both_ways(self) -> bool:
        return any(self._settings.serve(v.value) == "both" for v in self.vendors)

    # --- CDI and slices --------------------------------------------------------------------

    def _sync_cdi(self, snapshot: Snapshot) -> None:
        if snapshot.inventory == self._cdi_inventory:
            return
        present = {path for path in optional_control_nodes() if self._root.exists(path)}
        devices = snapshot.inventory.devices
        vendors = list(names.CLASSES) if self._settings.plugin.cdi else self.vendors
        specs = {vendor: vendor_spec(vendor, devices, present) for vendor in vendors}
        try:
            written = self.cdi.sync_vendor_specs(specs)
        except OSError as exc:
            self._log.error("writing CDI specs failed", error=str(exc))
            return
        self._cdi_inventory = snapshot.inventory
        if written:
            self._log.info("CDI specs written", files=[str(p) for p in written])

    def _publish(self, snapshot: Snapshot, now: float) -> None:
        if not self.vendors:  # CDI specs only (plugin.cdi): old slices are removed, once
            first = self._publish_due != float("inf")
            self._publish_due = float("inf")
            self._published_version = snapshot.version
            if first and self._api is not None:
                try:
                    remove_stale_slices(self._api, self.node)
                except Exception as exc:  # only a clean-up: the next start tries again
                    self._log.warning("removing stale ResourceSlices failed", error=str(exc))
            return
        reasons = self._reasons()
        unhealthy = {d: reasons.get(d, "unhealthy") for d in snapshot.withdrawn}
        degraded = {d: reasons.get(d, "degraded") for d in snapshot.withdrawn_degraded}
        desired = desired_slices(
            (snapshot.inventory, unhealthy),
            self._settings,
            self.node,
            datetime.now(UTC),
            degraded=degraded,
        )
        if self._device_plugin_holds:
            desired = _with_taint(desired, self._held_names(snapshot))
        if self.publisher is None:
            if self._published_version < 0:
                count = sum(len(specs) for specs in desired.values())
                self._log.info("no API server: ResourceSlices only logged", slices=count)
            self._published_version = snapshot.version
            self._publish_due = now + RESYNC_SECONDS
            return
        try:
            result = self.publisher.sync(desired)
        except Exception as exc:
            self.publish_failures += 1
            delay = self._backoff.next_delay()
            self._log.warning("publishing ResourceSlices failed", error=str(exc), retry_in=delay)
            self._publish_due = now + delay
            self._published_version = snapshot.version
            return
        self._backoff.reset()
        self._published_version = snapshot.version
        self._publish_due = now + RESYNC_SECONDS
        if result.writes:
            self._log.info(
                "ResourceSlices published",
                created=result.created,
                updated=result.updated,
                deleted=result.deleted,
            )

    def _held_names(self, snapshot: Snapshot) -> set[str]:
        device_names = names.device_names(snapshot.inventory.devices)
        return {device_names[d] for d in self._device_plugin_holds if d in device_names}

    def _next_due(self) -> float:
        due = self._publish_due
        if self._both_ways():
            due = min(due, self._holds_read + BOTH_WAYS_SECONDS)
        return due


def _with_taint(
    desired: Mapping[str, list[dict[str, Any]]], device_names: set[str]
) -> dict[str, list[dict[str, Any]]]:
    """`desired` with a NoSchedule taint on the named devices (held by device-plugin pods)."""
    taint = {"key": DEVICE_PLUGIN_TAINT, "value": "held", "effect": "NoSchedule"}
    result: dict[str, list[dict[str, Any]]] = {}
    for driver, specs in desired.items():
        result[driver] = []
        for spec in specs:
            devices = []
            for device in spec.get("devices", []):
                held = device["name"] in device_names
                taints = [*device.get("taints", []), taint] if held else None
                devices.append({**device, "taints": taints} if taints else device)
            result[driver].append({**spec, "devices": devices} if "devices" in spec else spec)
    return result
