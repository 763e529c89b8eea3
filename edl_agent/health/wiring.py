"""The node's health, wired: what the agent reads from the node at start (`read_node`), and the
health hub with every part that feeds it or follows it (`NodeHealth`).

`read_node` is all the disk the start needs: device discovery, the boot id, the quarantine an
earlier run saved. `NodeHealth` builds on it without touching a disk (the restored quarantine is
saved by the writer part once it runs), and `add_parts` hands its parts to the supervisor: the NVML
watcher and the reader of its warnings (on an NVIDIA node), rocm_smi's event watcher (on a Hygon
node whose library loads), DCMI's fault-event watcher (on an Ascend node whose library loads), the
quarantine writer, device-node presence and re-discovery, reset evidence, quiet periods, the
vendor polls and remediation (when enabled).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from edl_agent.config import Settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.ascend_library import library_usable as dcmi_usable
from edl_agent.health.classify import classify_xid
from edl_agent.health.dcmi_watch import DcmiWatcher
from edl_agent.health.hub import HealthHub
from edl_agent.health.hygon_library import library_usable as rocm_smi_usable
from edl_agent.health.inventory_watch import InventoryWatch
from edl_agent.health.nvml_watch import NvmlWatcher
from edl_agent.health.presence_watch import PresenceRound
from edl_agent.health.quarantine_store import Quarantine, QuarantineStore, read_boot_id
from edl_agent.health.quarantine_writer import QuarantineWriter
from edl_agent.health.quiet_periods import QuietPeriods
from edl_agent.health.remediation import Remediation
from edl_agent.health.reset_watch import ResetEvidence
from edl_agent.health.rocm_smi_watch import RocmSmiWatcher
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.vendor_polls import VendorPolls
from edl_agent.health.wear_watch import WearWatch
from edl_agent.kubelet.podresources import Claimable, PodResourcesClient
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.steps import Steps
from edl_agent.runtime.supervisor import Part, StopSignal, Supervisor

NVML_STOP_SECONDS = 1.0  # NVML's wait cannot be cut short: the stop does not wait for it longer


@dataclass(frozen=True)
class NodeAtStart:
    """What the agent reads from the node before it builds anything."""

    state: DeviceState
    discovery_seconds: float
    boot_id: str | None
    store: QuarantineStore | None  # None without a state directory
    saved: Quarantine | None  # what an earlier run quarantined


def read_node(settings: Settings) -> NodeAtStart:
    """Discover the node's devices; read its boot id and the quarantine saved in the state
    directory."""
    started = time.monotonic()
    state = DeviceState(discover_node(settings), shadow=settings.health.shadow)
    seconds = time.monotonic() - started
    boot_id = read_boot_id(HostRoot.at(settings.host_root).read_optional)
    directory = settings.faults.state_dir
    store = QuarantineStore(Path(directory) / "health") if directory else None
    return NodeAtStart(state, seconds, boot_id, store, store.load() if store else None)


class NodeHealth:
    def __init__(
        self,
        settings: Settings,
        node: NodeAtStart,
        *,
        stop: StopSignal,
        pods: PodResourcesClient,
        claimable: Callable[[Snapshot], Claimable],
        announce: Callable[[str, str, str], None],
        release_annotation: str,
        on_unsaved: Callable[[], None],
        inventory_changed: Callable[[], None],
        evidence_seconds: float,
    ) -> None:
        """`stop` wakes every part; `announce(kind, reason, message)`: an event for the Node;
        `on_unsaved`: the quarantine's save started or stopped failing; `inventory_changed`:
        re-discovery found other devices; `evidence_seconds`: reset evidence's round."""
        self._settings, health, waker = settings, settings.health, stop.waker
        self.state = node.state
        self.root = HostRoot.at(settings.host_root)
        self.writer = (
            QuarantineWriter(node.store, waker(), on_unsaved=on_unsaved)
            if node.store is not None
            else None
        )
        self.hub = HealthHub(self.state, health, boot_id=node.boot_id, writer=self.writer)
        if node.saved is not None:  # before kubelet is served; the writer part saves it
            self.hub.restore(node.saved)
        self.inventory = InventoryWatch(
            hub=self.hub,
            state=self.state,
            root=self.root,
            settings=settings,
            rediscover_now=waker(),
            inventory_changed=inventory_changed,
            discovery_seconds=node.discovery_seconds,
        )
        self.polls = VendorPolls(self.hub, self.state, self.root, health)
        self.remediation = Remediation(
            hub=self.hub,
            state=self.state,
            root=self.root,
            settings=health,
            pods=pods,
            claimable=claimable,
            announce=announce,
            release_annotation=release_annotation,
        )
        self.resets = ResetEvidence(self.hub, self.root, waker(), interval=lambda: evidence_seconds)
        self.quiet = QuietPeriods(self.hub, waker())
        self.nvml: NvmlWatcher | None = None  # made with the parts, on an NVIDIA node
        self.wear: WearWatch | None = None  # likewise, when `health.degraded.enabled`
        self._waker = waker

    def add_parts(self, supervisor: Supervisor, steps: Steps) -> None:
        """Hand every health part to `supervisor`; the presence check is a step of `steps`."""
        health, add, waker = self._settings.health, supervisor.add, self._waker
        if health.shadow:
            structlog.get_logger().bind(part="health").warning(
                "shadow mode: device health is reported, no device is withdrawn or reset"
            )
        if any(r.vendor is Vendor.NVIDIA for r in self.state.snapshot().inventory.reports):
            self.nvml = NvmlWatcher(
                self.root,
                self.hub.report,
                lambda code: classify_xid(code, health.xid_levels),
                wait_ms=round(health.nvml_wait_seconds * 1000),
            )
            retry = Backoff(health.nvml_retry_seconds, health.nvml_retry_seconds)
            add(self.nvml, critical=False, backoff=retry, stop_seconds=NVML_STOP_SECONDS)
            if health.degraded.enabled:
                self.wear = WearWatch(self.hub, self.root, health.degraded, waker())
                add(self.wear, critical=False, backoff=retry)
        vendors = {r.vendor for r in self.state.snapshot().inventory.reports}
        retry = Backoff(health.nvml_retry_seconds, health.nvml_retry_seconds)
        if Vendor.HYGON in vendors and rocm_smi_usable(self.root):
            watcher = RocmSmiWatcher(self.root, self.hub.report)
            add(watcher, critical=False, backoff=retry, stop_seconds=NVML_STOP_SECONDS)
        if Vendor.ASCEND in vendors and dcmi_usable(self.root):
            events = DcmiWatcher(self.root, self.hub.report, lambda: self._settings.health)
            add(events, critical=False, backoff=retry, stop_seconds=NVML_STOP_SECONDS)
        if self.writer is not None:
            add(self.writer, critical=False)
        presence = PresenceRound(
            check=functools.partial(steps.run, "presence", self.inventory.check_presence),
            directories=self.inventory.directories,
            wake=waker(),
            poll_seconds=lambda: self._settings.plugin.health_poll_seconds,
        )
        parts: list[Part] = [presence, self.inventory.rediscovery(), self.resets, self.quiet]
        for part in [*parts, *self.polls.parts(waker)]:
            add(part)
        if health.remediation.enabled and not health.shadow:
            add(self.remediation.part(waker()), critical=False)
