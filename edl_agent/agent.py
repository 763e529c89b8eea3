"""The node agent's composition root: it builds the parts from the settings and registers them
with one supervisor (`runtime.supervisor`), each on its own thread; it decides nothing itself.

Observers send `HealthEvent`s to the health hub (`health/hub.py`): the NVML watcher, the vendor
polls (`health/vendor_polls.py`), device-node presence and re-discovery
(`health/inventory_watch.py`), an operator's cordon and release (the node publisher). The hub
updates `DeviceState` (ListAndWatch, DRA and the node publisher wake on it), hands the quarantine
to its writer (`health/quarantine_writer.py`) and publishes each change on the queues of its
subscribers: device → pod faults (`faults/device_faults.py`), reset evidence
(`health/reset_watch.py`) and quiet periods (`health/quiet_periods.py`). Remediation
(`health/remediation.py`), the plugin round (`plugin/round.py`), the node publisher, the fault
sender, the pod-exit watcher, DRA and the metrics server are parts as well. A part that dies is
logged, counted and started again after a backoff; a slow part (a hung vendor tool, a kubelet
whose pod-resources API does not answer) holds up only itself.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from edl_agent.config import Settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.devices.names import claimable
from edl_agent.faults.reporting import FaultReporting
from edl_agent.health.classify import classify_xid
from edl_agent.health.hub import HealthHub
from edl_agent.health.inventory_watch import InventoryWatch
from edl_agent.health.model import HealthEvent
from edl_agent.health.nvml_watch import NvmlWatcher
from edl_agent.health.presence_watch import PresenceRound
from edl_agent.health.quarantine_store import QuarantineStore, read_boot_id
from edl_agent.health.quarantine_writer import QuarantineWriter
from edl_agent.health.quiet_periods import QuietPeriods
from edl_agent.health.remediation import Remediation
from edl_agent.health.reset_watch import ResetEvidence
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.tracker import Condition, HealthTracker
from edl_agent.health.vendor_polls import VendorPolls
from edl_agent.kubelet.podresources import (
    DEFAULT_TIMEOUT_SECONDS,
    Claimable,
    PodResourcesClient,
    Units,
)
from edl_agent.labels.condition import Unsaved
from edl_agent.labels.cordon import RELEASE_DEVICES
from edl_agent.labels.events import EventSpec
from edl_agent.labels.marks import OperatorMarks
from edl_agent.metrics.inputs import AgentCounts
from edl_agent.plugin.manager import PluginManager
from edl_agent.plugin.round import TICK_SECONDS, WATCHED_TICK_SECONDS, PluginRound
from edl_agent.runtime import supervisor
from edl_agent.runtime.supervisor import Part, Supervisor, Watched

if TYPE_CHECKING:
    # Imported where they start: registration with kubelet (serve_kubelet) comes first and
    # needs none of the API client, prometheus_client or the outbox.
    from edl_agent.dra.node import DraNode
    from edl_agent.faults.outbox import Outbox
    from edl_agent.kube import NodeApi
    from edl_agent.labels.publisher import NodePublisher
    from edl_agent.metrics.node import NodeMetrics


class StopSignal(supervisor.StopSignal):
    """The agent's stop flag; setting it also ends every part's wait for its next round: the
    plugin round's `wake` (which a change in kubelet's directory sets too) and each `waker()`.
    Watched parts under it are heard as they end, not polled."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = self.waker()


PUBLISHER_CHECK_SECONDS = 5.0
NVML_STOP_SECONDS = 1.0


@dataclass
class Agent:
    settings: Settings
    stop: StopSignal = field(default_factory=StopSignal)
    step_failures: Counter[str] = field(default_factory=Counter)
    # The plugin round while something is under way, and while all is quiet (plugin/round.py).
    tick_seconds: float = TICK_SECONDS
    watched_tick_seconds: float = WATCHED_TICK_SECONDS
    # Reset evidence between events (at least reset_watch.MIN_INTERVAL_SECONDS).
    evidence_seconds: float = 5.0
    # How long one call to kubelet's pod-resources API may take.
    pod_resources_timeout: float = DEFAULT_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        settings, health, waker = self.settings, self.settings.health, self.stop.waker
        self.root = HostRoot.at(settings.host_root)
        self._log = structlog.get_logger()
        self._failing: dict[str, str] = {}  # step → its error, while it fails
        # Started later (the CLI's start_*): None until then. First, for what runs before them
        # (the quarantine writer tells `_unsaved_turned` when the restored quarantine fails).
        self.nvml: NvmlWatcher | None = None
        self.publisher: NodePublisher | None = None
        self.dra: DraNode | None = None
        self.metrics: NodeMetrics | None = None
        started = time.monotonic()
        self.state = DeviceState(discover_node(settings))
        node = self.state.snapshot().inventory.node
        self.supervisor = Supervisor(self.stop)
        directory = settings.faults.state_dir
        store = QuarantineStore(Path(directory) / "health")
        self.writer = (
            QuarantineWriter(store, waker(), on_unsaved=self._unsaved_turned) if directory else None
        )
        boot_id = read_boot_id(self.root.read_optional)
        self.hub = HealthHub(self.state, health, boot_id=boot_id, writer=self.writer)
        if self.writer is not None:  # what an earlier run quarantined, before kubelet is served
            saved = store.load()
            if saved is not None:
                self.hub.restore(saved)
            self.writer.flush()
        self.plugins = PluginManager(settings=settings.plugin, state=self.state, root=self.root)
        self.round = PluginRound(
            self.plugins,
            self.stop.wake,
            guarded=self._guarded,
            tick_seconds=self.tick_seconds,
            watched_tick_seconds=self.watched_tick_seconds,
        )
        self.inventory = InventoryWatch(
            hub=self.hub,
            state=self.state,
            root=self.root,
            settings=settings,
            rediscover_now=waker(),
            inventory_changed=self.stop.wake.set,  # servers for new resources now
            discovery_seconds=time.monotonic() - started,
        )
        self.polls = VendorPolls(self.hub, self.state, self.root, health)
        timeout = self.pod_resources_timeout
        self.pods = PodResourcesClient(Path(settings.pod_resources_socket), timeout=timeout)
        self.remediation = Remediation(
            hub=self.hub,
            state=self.state,
            root=self.root,
            settings=health,
            pods=self.pods,
            claimable=self._claimable,
            announce=lambda kind, reason, message: self._announce(EventSpec(kind, reason, message)),
            release_annotation=RELEASE_DEVICES,
        )
        self.resets = ResetEvidence(
            self.hub, self.root, waker(), interval=lambda: self.evidence_seconds
        )
        self.quiet = QuietPeriods(self.hub, waker())
        self.marks = OperatorMarks(self.hub, self._announce)
        self.faults = FaultReporting(settings.faults, node)

    def serve_kubelet(self) -> None:
        """Serve every resource and register it with kubelet now, before the rest starts: the
        devices are schedulable as soon as discovery is done (`run` keeps them registered)."""
        self.round.sync()

    def run(self) -> None:
        """Run until `stop` is set; then stop the parts and remove our sockets."""
        snapshot = self.state.snapshot()
        self._log.info(
            "agent running",
            node=snapshot.inventory.node,
            kubelet_dir=str(self.plugins.directory),
            resources=sorted(snapshot.resources),
        )
        self._add_parts()
        try:
            self.supervisor.start()
            self.stop.wait()
        finally:
            self.stop.set()
            self.state.wake()  # parts waiting on the device state check `stop`
            self.supervisor.join()
            self.close()

    def close(self) -> None:
        """Stop whatever was started and remove our sockets (after `run`, or instead of it when
        starting failed half-way)."""
        self.stop.set()
        if self.nvml is not None:
            self.nvml.request_stop()  # it ends after its current wait: meanwhile stop the rest
        stops = (self.publisher, self.faults, self.dra, self.metrics)
        for started in [part.stop for part in stops if part is not None]:
            started()
        if self.nvml is not None:  # NVML's wait cannot be cut short: not waited for long
            self.nvml.stop(timeout=NVML_STOP_SECONDS)
        self.state.close()
        self.plugins.close()
        self.pods.close()
        if self.writer is not None:
            self.writer.flush()
        self._log.info("agent stopped")

    def _add_parts(self) -> None:
        """Every job is a part of its own: a vendor tool that hangs, or a kubelet that does not
        answer, delays neither the others nor the health stream."""
        health, add, waker = self.settings.health, self.supervisor.add, self.stop.waker
        if any(r.vendor is Vendor.NVIDIA for r in self.state.snapshot().inventory.reports):
            self.nvml = NvmlWatcher(
                self.root,
                self.hub.report,
                lambda code: classify_xid(code, health.xid_levels),
                retry_seconds=health.nvml_retry_seconds,
                wait_ms=round(health.nvml_wait_seconds * 1000),
            )
            self.nvml.start()
            add(Watched("nvml-watch", self.nvml), critical=False)
        if self.writer is not None:
            add(self.writer, critical=False)
        presence = PresenceRound(
            check=functools.partial(self._guarded, "presence", self.inventory.check_presence),
            directories=self.inventory.directories,
            wake=waker(),
            poll_seconds=lambda: self.settings.plugin.health_poll_seconds,
        )
        parts: list[Part] = [self.round, presence, self.inventory.rediscovery()]
        for part in [*parts, self.resets, self.quiet, *self.polls.parts(waker)]:
            add(part)
        if health.remediation.enabled:
            add(self.remediation.part(waker()), critical=False)

    # The parts the CLI starts once kubelet is served.

    def start_publisher(self, api: NodeApi | None) -> None:
        """Publish labels, the node condition and events (only logged when `api` is None)."""
        from edl_agent.labels.publisher import NodePublisher

        self.publisher = NodePublisher(
            api=api,
            settings=self.settings,
            state=self.state,
            root=self.root,
            unhealthy=self.hub.unhealthy,
            on_cordon=self.marks.cordon,
            on_release=self.marks.release,
            monitors=self.hub.monitor_failures,
            unsaved=self.unsaved,
        )
        self.hub.subscribe(self.publisher.poke_event, lambda change: change.shown, keep=False)
        self.publisher.start()
        # Its own watches restart themselves; a publisher that died is seen within 5 s (looked
        # at, not told: what is alive is the publisher's thread and its watches together).
        publisher = Watched("node-publisher", self.publisher, poll_seconds=PUBLISHER_CHECK_SECONDS)
        self.supervisor.add(publisher, critical=False)

    def start_dra(self, api: NodeApi | None) -> None:
        """Serve the vendors whose `serve` is `dra` or `both` through DRA (dra/node.py; only
        logged when `api` is None). OSError when its socket or CDI directory cannot be made."""
        from edl_agent.dra.wiring import start_dra

        self.dra = start_dra(
            self.settings,
            state=self.state,
            root=self.root,
            api=api,
            reasons=lambda: {d: c.reason for d, c in self.hub.unhealthy().items()},
            pods=self.pods,
            supervisor=self.supervisor,
            hub=self.hub,
            wake=self.stop.waker(),
        )

    def start_faults(self, api: NodeApi | None) -> None:
        """Report faults (faults/reporting.py), and devices that turn Unhealthy while pods hold
        them as faults (faults/device_faults.py). Raises OutboxError, ValueError."""
        from edl_agent.faults.device_faults import DeviceFaults

        self.faults.start(api, self.supervisor)
        if self.faults.outbox is not None:
            self.faults.outbox.add_memory_listener(self._unsaved_turned)
        self.device_faults = DeviceFaults(
            hub=self.hub,
            state=self.state,
            pods=self.pods,
            claimable=self._claimable,
            report=self.faults.report,
            pod=self.faults.pod,
            wake=self.stop.waker(),
            # kubelet not answering: asked again every plugin.health_poll_seconds
            retry_seconds=self.settings.plugin.health_poll_seconds,
        )
        self.supervisor.add(self.device_faults, critical=False)

    def start_metrics(self) -> None:
        """Serve /metrics, /healthz and /readyz; OSError when the address cannot be bound."""
        if not self.settings.metrics_addr:
            return
        from edl_agent.metrics.node import NodeMetrics

        self.metrics = NodeMetrics(
            self.settings.metrics_addr,
            root=self.root,
            state=self.state,
            polled=self.polls.all_telemetry,
            hub=self.hub,
            agent_counts=self.agent_counts,
            pods=lambda: self.pods.pod_devices(*self._holders_query()),
            ready=self.ready,
        )
        self.metrics.start(self.supervisor)

    # What the parts offer, for the CLI, /metrics, /readyz and tests.

    @property
    def tracker(self) -> HealthTracker:
        return self.hub.tracker

    @property
    def outbox(self) -> Outbox | None:
        return self.faults.outbox

    @property
    def remediations(self) -> Counter[tuple[str, str]]:
        return self.remediation.counts

    @property
    def rediscoveries(self) -> int:
        return self.inventory.rediscoveries

    def rediscover_now(self) -> None:
        """Run the periodic re-discovery at once (as a change under /dev does)."""
        self.inventory.rediscover_now.set()

    def report(self, event: HealthEvent) -> None:
        """The health stream: any observer, any thread."""
        self.hub.report(event)

    def unhealthy(self) -> dict[str, Condition]:
        return self.hub.unhealthy()

    def wait_ready(self, timeout: float) -> bool:
        """True once the first plugin round has served every resource."""
        return self.round.served.wait(timeout)

    def ready(self) -> tuple[bool, str]:
        """Readiness for /readyz: every vendor's monitor works and the plugins are served. The
        detail says what the disk refused to hold, ready or not: said, not failed (a full disk is
        no reason to stop serving)."""
        ready, detail = self._readiness()
        unsaved = self.unsaved()
        if unsaved:
            refused = f"the disk refuses writes: {unsaved.describe()} kept in memory only"
            detail = f"{detail}, but {refused}" if ready else f"{detail}; {refused}"
        return ready, detail

    def _readiness(self) -> tuple[bool, str]:
        failed = self.hub.monitor_failures()
        if failed:
            reasons = ", ".join(f"{v.value}: {c.reason}" for v, c in failed.items())
            return False, f"health monitor failing ({reasons})"
        if self.nvml is not None and not self.nvml.ready:
            return False, "NVML event loop not running"
        starting = not self.round.served.is_set() and "plugins" not in self._failing
        unserved = [] if starting else self.plugins.unserved()
        if starting or unserved:
            return False, f"no socket served for {', '.join(unserved)}" if unserved else "starting"
        return self.supervisor.ready()

    def unsaved(self) -> Unsaved:
        """What the state directory does not hold now, because it refused the writes."""
        outbox = self.faults.outbox
        return Unsaved(
            faults=outbox.counts().in_memory if outbox is not None else 0,
            quarantine=self.writer is not None and self.writer.unsaved,
        )

    def _unsaved_turned(self) -> None:
        """The disk started or stopped refusing: the node condition says so (any thread)."""
        if self.publisher is not None:
            self.publisher.poke_event.set()

    def agent_counts(self) -> AgentCounts:
        plugin, dra = self.plugins.counters, self.dra
        failures = Counter(self.step_failures)
        if self.writer is not None and self.writer.failures:
            failures["quarantine_save"] = self.writer.failures
        vendors = {r.vendor.value for r in self.state.snapshot().inventory.reports}
        unsaved = self.unsaved()
        return AgentCounts(
            discovery_seconds=self.inventory.discovery_seconds,
            nvml_event_loop_restarts=self.nvml.restarts if self.nvml is not None else 0,
            registrations=plugin.registrations,
            registration_failures=plugin.registration_failures,
            plugin_server_restarts=plugin.server_restarts,
            step_failures=dict(failures),
            remediations=self.remediation.counted(vendors),
            parts={p.name: (p.up, p.restarts) for p in self.supervisor.statuses()},
            dra_plugins=dra.plugin_counts() if dra is not None else {},
            dra_publish_failures=dra.publish_failures if dra is not None else 0,
            faults_in_memory=unsaved.faults,
            quarantine_unsaved=unsaved.quarantine,
        )

    def _holders_query(self) -> tuple[Units, Claimable]:
        snapshot = self.state.snapshot()
        return snapshot.units, self._claimable(snapshot)

    def _announce(self, event: EventSpec) -> None:
        if self.publisher is not None:
            self.publisher.announce(event)

    def _claimable(self, snapshot: Snapshot) -> Claimable:
        serve = self.settings.serve
        return claimable(snapshot.inventory, lambda v: serve(v.value) != "device-plugin")

    def _guarded(self, step: str, action: Callable[[], None]) -> None:
        """Run one step of a round; a failure is logged when it starts or changes (with its
        traceback the first time), not at every round while it lasts."""
        try:
            action()
        except Exception as exc:
            self.step_failures[step] += 1
            error = f"{type(exc).__name__}: {exc}"
            previous = self._failing.get(step)
            self._failing[step] = error
            if previous is None:
                self._log.exception("agent step failed", step=step)
            elif previous != error:
                self._log.error("agent step still fails", step=step, error=error)
            return
        if self._failing.pop(step, None) is not None:
            self._log.info("agent step works again", step=step, failures=self.step_failures[step])
