"""The node agent's composition root: it builds the parts from the settings and registers them
with one supervisor (`runtime.supervisor`), each on its own thread; it decides nothing itself.

Observers send `HealthEvent`s to the health hub (`health/hub.py`): the NVML watcher, the vendor
polls (`health/vendor_polls.py`), device-node presence and re-discovery
(`health/inventory_watch.py`), an operator's cordon and release (the node publisher). The hub
updates `DeviceState` (ListAndWatch, DRA and the node publisher wake on it), hands the quarantine
to its writer (`health/quarantine_writer.py`) and publishes each change on the queues of its
subscribers: device → pod faults (`faults/device_faults.py`), reset evidence
(`health/reset_watch.py`) and quiet periods (`health/quiet_periods.py`). Remediation
(`health/remediating.py`), the plugin round (`plugin/round.py`), the node publisher, the fault
sender, the pod-exit watcher, DRA and the metrics server are parts as well. A part that dies is
logged, counted and started again after a backoff; a slow part (a hung vendor tool, a kubelet
whose pod-resources API does not answer) holds up only itself.
"""

from __future__ import annotations

import functools
import threading
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
from edl_agent.dra.names import claimable
from edl_agent.health.classify import classify_xid
from edl_agent.health.hub import HealthHub
from edl_agent.health.inventory_watch import InventoryWatch
from edl_agent.health.model import DeviceTelemetry, HealthEvent
from edl_agent.health.nvml_watch import NvmlWatcher
from edl_agent.health.polled import POLLERS
from edl_agent.health.quarantine_store import QuarantineStore, read_boot_id
from edl_agent.health.quarantine_writer import QuarantineWriter
from edl_agent.health.quiet_periods import QuietPeriods
from edl_agent.health.remediating import Remediation
from edl_agent.health.remediation import Outcome
from edl_agent.health.reset_watch import ResetEvidence
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.tracker import Condition, HealthTracker
from edl_agent.health.vendor_polls import VendorPolls
from edl_agent.kubelet.podresources import (
    DEFAULT_TIMEOUT_SECONDS,
    Claimable,
    PodRef,
    PodResourcesClient,
)
from edl_agent.labels.cordon import Cordon
from edl_agent.labels.events import NORMAL, EventSpec
from edl_agent.metrics.inputs import AgentCounts
from edl_agent.plugin.manager import PluginManager
from edl_agent.plugin.round import TICK_SECONDS, WATCHED_TICK_SECONDS, PluginRound
from edl_agent.runtime.supervisor import Every, Supervisor, Watched

if TYPE_CHECKING:
    # Imported where they start: registration with kubelet (serve_kubelet) comes first and
    # needs none of the API client, prometheus_client or fault reporting.
    from edl_agent.dra.node import DraNode
    from edl_agent.faults.model import Fault
    from edl_agent.faults.outbox import Outbox
    from edl_agent.health.nvml_telemetry import NvmlTelemetry
    from edl_agent.kube import NodeApi
    from edl_agent.labels.publisher import NodePublisher
    from edl_agent.metrics.server import MetricsServer


class StopSignal(threading.Event):
    """The agent's stop flag; setting it also ends every part's wait for its next round: the
    plugin round's `wake` (which a change in kubelet's directory sets too) and each `waker()`."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = threading.Event()
        self._wakes = [self.wake]

    def waker(self) -> threading.Event:
        """A wake-up event of one part, set by `set()` too."""
        event = threading.Event()
        self._wakes.append(event)
        if self.is_set():
            event.set()
        return event

    def set(self) -> None:
        super().set()
        for event in self._wakes:
            event.set()


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
        settings, health = self.settings, self.settings.health
        self.root = HostRoot.at(settings.host_root)
        self._log = structlog.get_logger()
        started = time.monotonic()
        self.state = DeviceState(discover_node(settings))
        self.supervisor = Supervisor(self.stop)
        store = QuarantineStore(Path(settings.faults.state_dir) / "health")
        self.writer = (
            QuarantineWriter(store, self.stop.waker()) if settings.faults.state_dir else None
        )
        self.hub = HealthHub(
            self.state, health, boot_id=read_boot_id(self.root.read_optional), writer=self.writer
        )
        self._restore_quarantine()
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
            rediscover_now=self.stop.waker(),
            inventory_changed=self.stop.wake.set,  # servers for new resources now
            discovery_seconds=time.monotonic() - started,
        )
        self.polls = VendorPolls(self.hub, self.state, self.root, health)
        self.pods = PodResourcesClient(
            Path(settings.pod_resources_socket), timeout=self.pod_resources_timeout
        )
        self.remediation = Remediation(
            hub=self.hub,
            state=self.state,
            root=self.root,
            settings=health,
            pods=self.pods,
            claimable=self._claimable,
            announce=self._announce,
        )
        self.resets = ResetEvidence(
            self.hub, self.root, self.stop.waker(), interval=lambda: self.evidence_seconds
        )
        self.quiet = QuietPeriods(self.hub, self.stop.waker())
        self.nvml: NvmlWatcher | None = None
        self.publisher: NodePublisher | None = None
        self.dra: DraNode | None = None
        self.metrics: MetricsServer | None = None
        self._nvml_telemetry: NvmlTelemetry | None = None
        from edl_agent.faults.reporting import FaultReporting

        self.faults = FaultReporting(settings.faults, self.state.snapshot().inventory.node)

    # --- what the hub and the parts offer, for the CLI, the metrics and tests

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
        """The health stream: any watcher or poller, any thread."""
        self.hub.report(event)

    def report_fault(self, fault: Fault) -> None:
        self.faults.report(fault)

    def unhealthy(self) -> dict[str, Condition]:
        return self.hub.unhealthy()

    def monitor_failures(self) -> dict[Vendor, Condition]:
        return self.hub.monitor_failures()

    def pods_holding(self, snapshot: Snapshot) -> dict[str, list[PodRef]]:
        """Device id → the containers holding it, through the device plugin or a DRA claim."""
        return self.pods.pod_devices(snapshot.units, self._claimable(snapshot))

    def wait_ready(self, timeout: float) -> bool:
        """True once the first plugin round has served every resource."""
        return self.round.served.wait(timeout)

    def ready(self) -> tuple[bool, str]:
        """Readiness for /readyz: every vendor's monitor works and the plugins are served."""
        failed = self.hub.monitor_failures()
        if failed:
            reasons = ", ".join(f"{v.value}: {c.reason}" for v, c in failed.items())
            return False, f"health monitor failing ({reasons})"
        if self.nvml is not None and not self.nvml.ready:
            return False, "NVML event loop not running"
        if not self.round.served.is_set():
            return False, "starting"
        return self.supervisor.ready()

    # --- lifecycle

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
            self.nvml.stop()
        if self.publisher is not None:
            self.publisher.stop()
        self.stop_faults()
        if self.dra is not None:
            self.dra.stop()
        self.state.close()
        self.plugins.close()
        self.stop_metrics()
        if self.writer is not None:
            self.writer.flush()
        self._log.info("agent stopped")

    def _add_parts(self) -> None:
        """Every job is a part of its own: a vendor tool that hangs in a poll or in re-discovery,
        or a kubelet that does not answer, delays neither the others nor the health stream."""
        health, plugin, parts = self.settings.health, self.settings.plugin, self.supervisor
        if any(r.vendor is Vendor.NVIDIA for r in self.state.snapshot().inventory.reports):
            self.nvml = NvmlWatcher(
                self.root,
                self.hub.report,
                lambda code: classify_xid(code, health.xid_levels),
                retry_seconds=health.nvml_retry_seconds,
            )
            self.nvml.start()
            parts.add(Watched("nvml-watch", self.nvml), critical=False)
        if self.writer is not None:
            parts.add(self.writer, critical=False)
        parts.add(self.round)
        # Device-node presence has no event to wait on: its round is the operator's setting.
        presence = Every(
            "presence",
            lambda: plugin.health_poll_seconds,
            functools.partial(self._guarded, "presence", self.inventory.check_presence),
            self.stop.waker(),
        )
        parts.add(presence)
        rediscover = self.inventory.rediscover_step
        wake = self.inventory.rediscover_now
        parts.add(Every("rediscovery", lambda: plugin.rediscover_seconds, rediscover, wake))
        for report in self.state.snapshot().inventory.reports:
            if report.vendor in POLLERS:
                step = functools.partial(self.polls.poll, report.vendor)
                interval = lambda: health.poll_seconds  # noqa: E731 - a vendor tool has no events
                parts.add(Every(f"poll-{report.vendor.value}", interval, step, self.stop.waker()))
        parts.add(self.resets)
        parts.add(self.quiet)
        if health.remediation.enabled:
            self._log.info(
                "remediation on: idle devices waiting for a reset are reset",
                vendors=sorted(health.remediation.commands),
                max_per_hour=health.remediation.max_per_hour,
                max_attempts=health.remediation.max_attempts,
            )
            every = lambda: health.remediation.interval_seconds  # noqa: E731
            remediate = Every("remediation", every, self.remediation.step, self.stop.waker())
            parts.add(remediate, critical=False)

    def remediate(self, now: float) -> Outcome | None:
        """Reset one idle device whose quarantine a reset clears, if any may be reset now."""
        return self.remediation.remediate(now)

    # --- the parts started by the CLI once kubelet is served

    def start_publisher(self, api: NodeApi | None) -> None:
        """Publish labels, the node condition and events (only logged when `api` is None)."""
        from edl_agent.labels.publisher import NodePublisher

        self.publisher = NodePublisher(
            api=api,
            settings=self.settings,
            state=self.state,
            root=self.root,
            unhealthy=self.unhealthy,
            on_cordon=self.set_cordon,
            on_release=self.release,
            monitors=self.monitor_failures,
        )
        self.hub.subscribe(self.publisher.poke_event, lambda change: change.shown)
        self.publisher.start()
        self.supervisor.add(Watched("node-publisher", self.publisher), critical=False)

    def start_dra(self, api: NodeApi | None) -> None:
        """Serve the vendors whose `serve` is `dra` or `both` through DRA: kubelet plugins, CDI
        specs and ResourceSlices (only logged when `api` is None). Raises OSError when the
        plugin socket or the CDI directory cannot be made."""
        from edl_agent.dra.api import KubeDraApi
        from edl_agent.dra.node import DraNode, dra_vendors

        if not dra_vendors(self.settings) and not self.settings.plugin.cdi:
            if api is not None:  # slices a configuration that served DRA left: in the background
                from edl_agent.dra.publisher import remove_stale_slices

                node = self.state.snapshot().inventory.node
                args = (KubeDraApi(api), node)
                threading.Thread(target=remove_stale_slices, args=args, daemon=True).start()
            return
        self.dra = DraNode(
            self.settings,
            self.state,
            self.root,
            api=KubeDraApi(api) if api is not None else None,
            reasons=lambda: {d: c.reason for d, c in self.unhealthy().items()},
            pods=self.pods,
        )
        self.dra.start()
        self.supervisor.add(self.dra, critical=False)
        self._log.info(
            "serving through DRA",
            drivers=sorted(self.dra.servers),
            registry=self.settings.dra.plugins_registry_dir,
            cdi_dir=self.settings.dra.cdi_dir,
        )

    def start_faults(self, api: NodeApi | None) -> None:
        """Report faults (faults/reporting.py) and turn devices that turn Unhealthy while pods
        hold them into faults (faults/device_faults.py). Raises OutboxError, ValueError."""
        from edl_agent.faults.device_faults import DeviceFaults

        self.faults.start(api, self.supervisor)
        self.device_faults = DeviceFaults(
            hub=self.hub,
            state=self.state,
            pods=self.pods,
            claimable=self._claimable,
            report=self.faults.report,
            pod=self.faults.pod,
            wake=self.stop.waker(),
            # kubelet not answering: asked again at the presence round, as an operator set it
            retry_seconds=self.settings.plugin.health_poll_seconds,
        )
        self.supervisor.add(self.device_faults, critical=False)

    def stop_faults(self) -> None:
        self.faults.stop()

    def start_metrics(self) -> None:
        """Serve /metrics, /healthz and /readyz; OSError when the address cannot be bound."""
        if not self.settings.metrics_addr:
            return
        from edl_agent.health.nvml_telemetry import NvmlTelemetry
        from edl_agent.metrics.collectors import EdlCollector, build_registry
        from edl_agent.metrics.server import MetricsServer

        if any(r.vendor is Vendor.NVIDIA for r in self.state.snapshot().inventory.reports):
            self._nvml_telemetry = NvmlTelemetry(self.root)
        collector = EdlCollector(
            snapshot=self.state.snapshot,
            telemetry=self._telemetry,
            health_counts=self.hub.counts,
            agent_counts=self.agent_counts,
            pods=lambda: self.pods_holding(self.state.snapshot()),
        )
        registry = build_registry(collector)
        self.metrics = MetricsServer(self.settings.metrics_addr, registry, ready=self.ready)
        self.metrics.start()
        self.supervisor.add(Watched("metrics", self.metrics), critical=False)

    def _telemetry(self) -> list[DeviceTelemetry]:
        figures = self._nvml_telemetry.read() if self._nvml_telemetry is not None else []
        return figures + self.polls.all_telemetry()

    def agent_counts(self) -> AgentCounts:
        plugin = self.plugins.counters
        failures = Counter(self.step_failures)
        if self.writer is not None and self.writer.failures:
            failures["quarantine_save"] = self.writer.failures
        return AgentCounts(
            discovery_seconds=self.inventory.discovery_seconds,
            nvml_event_loop_restarts=self.nvml.restarts if self.nvml is not None else 0,
            registrations=plugin.registrations,
            registration_failures=plugin.registration_failures,
            plugin_server_restarts=plugin.server_restarts,
            step_failures=dict(failures),
            remediations=self.remediation.counted(
                {r.vendor.value for r in self.state.snapshot().inventory.reports}
            ),
            parts={p.name: (p.up, p.restarts) for p in self.supervisor.statuses()},
            dra_plugins=self.dra.plugin_counts() if self.dra is not None else {},
            dra_publish_failures=self.dra.publish_failures if self.dra is not None else 0,
        )

    def stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self._nvml_telemetry is not None:
            self._nvml_telemetry.close()
            self._nvml_telemetry = None
        self.pods.close()

    # --- cordon and release (the node publisher's calls)

    def set_cordon(self, cordon: Cordon) -> None:
        """Devices cordoned by the node annotation are advertised Unhealthy until released."""
        if self.hub.set_cordon(cordon.device_ids):
            self._log.info(
                "cordoned devices changed",
                cordoned=sorted(cordon.device_ids) or None,
                unknown=list(cordon.unknown) or None,
            )

    def release(self, released: Cordon) -> None:
        """An operator released these devices (`edl.io/release-devices`): every quarantine of
        theirs ends, whatever it waited for."""
        changes = self.hub.release(released.device_ids)
        if changes:
            names = ", ".join(c.device_id for c in changes)
            message = f"released by an operator: {names}"
            self._announce(EventSpec(NORMAL, "AcceleratorReleased", message))
        self._log.warning(
            "devices released by an operator",
            released=sorted(released.device_ids) or None,
            back_in_service=[c.device_id for c in changes] or None,
            unknown=list(released.unknown) or None,
        )

    # --- helpers

    def _announce(self, event: EventSpec) -> None:
        if self.publisher is not None:
            self.publisher.announce(event)

    def _claimable(self, snapshot: Snapshot) -> Claimable:
        return claimable(
            snapshot.inventory, lambda vendor: self.settings.serve(vendor.value) != "device-plugin"
        )

    def _restore_quarantine(self) -> None:
        """Reopen what an earlier run quarantined, before kubelet is first served."""
        if self.writer is None:
            return
        saved = self.writer.store.load()
        if saved is not None:
            restored, rebooted = self.hub.restore(saved)
            self._log.info(
                "quarantine restored",
                devices=restored,
                rebooted_since=rebooted or None,
                released_by_reboot=(len(saved.conditions) - restored) or None,
            )
        self.writer.flush()

    def _guarded(self, step: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            self.step_failures[step] += 1
            self._log.exception("agent step failed", step=step, failures=self.step_failures[step])
