"""The node agent's supervisor: one loop that owns the periodic parts and keeps each alive.

Each step (plugin sync, device-node presence, vendor health polls, recovery, re-discovery) runs
guarded: an exception is logged with its traceback, counted, and the step is tried again on a
later tick — one broken part never stops the others. The gRPC servers and the NVML event watcher
run on their own threads; health events from any of them go through `report()`, the one health
stream that feeds the device plugin (ListAndWatch wakes at once) and the metrics.

Fault reports (`start_faults`): a device that turns Unhealthy while pods hold it (kubelet's
pod-resources API; shares count for their physical device) becomes a DEVICE_UNHEALTHY fault
naming those pods — a device no pod holds gives the restarter nothing to restart, so it is only
logged. A watcher of this node's pods adds CONTAINER_EXIT faults. Faults go to the durable outbox
under `faults.state_dir`, which a sender delivers to the restarter; with no
`faults.restarter_address` they are only logged.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import structlog

from edl_agent.config import Settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Health, Inventory, Vendor
from edl_agent.devices.resources import advertised_resources
from edl_agent.faults.ids import device_unhealthy_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.outbox import Outbox, OutboxError
from edl_agent.faults.pod_exits import PodExitWatcher
from edl_agent.faults.sender import Sender, SenderSettings
from edl_agent.health.classify import classify_xid
from edl_agent.health.model import DeviceTelemetry, HealthEvent, Level
from edl_agent.health.nvml_telemetry import NvmlTelemetry
from edl_agent.health.nvml_watch import GPU_LOST, NvmlWatcher
from edl_agent.health.polled import POLLERS, poll
from edl_agent.health.presence import vanished
from edl_agent.health.tracker import UNHEALTHY, Condition, HealthTracker, Transition
from edl_agent.kube import KubeApi
from edl_agent.labels.cordon import Cordon
from edl_agent.labels.publisher import NodePublisher
from edl_agent.metrics.collectors import EdlCollector, build_registry
from edl_agent.metrics.inputs import AgentCounts, HealthCounts
from edl_agent.metrics.podresources import PodResourcesClient
from edl_agent.metrics.server import MetricsServer
from edl_agent.plugin.dirwatch import DirectoryWatch
from edl_agent.plugin.manager import PluginManager
from edl_agent.plugin.state import DeviceState

TICK_SECONDS = 0.25
NODE_VANISHED = "NODE_VANISHED"


@dataclass
class _Schedule:
    interval: float
    due: float = 0.0

    def take(self, now: float) -> bool:
        if now < self.due:
            return False
        self.due = now + self.interval
        return True


class StopSignal(threading.Event):
    """The agent's stop flag; setting it also ends the run loop's wait for its next tick, which
    other things (a change in kubelet's directory) end too through `wake`."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = threading.Event()

    def set(self) -> None:
        super().set()
        self.wake.set()


@dataclass
class Agent:
    settings: Settings
    stop: StopSignal = field(default_factory=StopSignal)
    step_failures: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.root = HostRoot.at(self.settings.host_root)
        self._log = structlog.get_logger()
        started = time.monotonic()
        self.state = DeviceState(discover_node(self.settings))
        self.discovery_seconds = time.monotonic() - started
        self.plugins = PluginManager(
            settings=self.settings.plugin, state=self.state, root=self.root
        )
        self.tracker = HealthTracker(quiet_seconds=self.settings.health.quiet_seconds)
        self._health_lock = threading.Lock()
        self._vanished: frozenset[str] = frozenset()
        self.polled_telemetry: dict[Vendor, list[DeviceTelemetry]] = {}
        self.nvml: NvmlWatcher | None = None
        self._presence = _Schedule(self.settings.plugin.health_poll_seconds)
        self._polls = _Schedule(self.settings.health.poll_seconds)
        self._rediscovery = _Schedule(
            self.settings.plugin.rediscover_seconds,
            due=time.monotonic() + self.settings.plugin.rediscover_seconds,
        )
        self._ready = threading.Event()
        self.metrics: MetricsServer | None = None
        self._pods = PodResourcesClient(Path(self.settings.pod_resources_socket))
        self._nvml_telemetry: NvmlTelemetry | None = None
        self.publisher: NodePublisher | None = None
        self._cordoned: frozenset[str] = frozenset()
        self._faults_on = False
        self.outbox: Outbox | None = None
        self.sender: Sender | None = None
        self.pod_exits: PodExitWatcher | None = None

    def run(self) -> None:
        """Run until `stop` is set; then stop the watchers and servers and remove our sockets."""
        self._log.info(
            "agent running",
            node=self.state.snapshot().inventory.node,
            kubelet_dir=str(self.plugins.directory),
            resources=sorted(self.state.snapshot().resources),
        )
        self._start_nvml_watcher()
        # A change in kubelet's directory (a kubelet restart) makes the next tick come at once.
        wake = self.stop.wake
        directory_watch = DirectoryWatch(self.plugins.directory, wake.set)
        try:
            directory_watch.start()
            while not self.stop.is_set():
                self.tick(time.monotonic())
                self._ready.set()
                wake.wait(TICK_SECONDS)
                wake.clear()
        finally:
            directory_watch.stop()
            if self.nvml is not None:
                self.nvml.stop()
            if self.publisher is not None:
                self.publisher.stop()
            self.stop_faults()
            self.state.close()
            self.plugins.close()
            self.stop_metrics()
            self._log.info("agent stopped")

    def start_publisher(self, api: KubeApi | None) -> None:
        """Publish labels, the node condition and events (only logged when `api` is None)."""
        self.publisher = NodePublisher(
            api=api,
            settings=self.settings,
            state=self.state,
            root=self.root,
            unhealthy=self.unhealthy,
            on_cordon=self.set_cordon,
        )
        self.publisher.start()

    def start_faults(self, api: KubeApi | None) -> None:
        """Report faults: open the outbox and start its sender (when a restarter is configured)
        and watch this node's pods for container exits (when `api` is given). Raises OutboxError
        when the state directory cannot be used, ValueError for unusable sender settings."""
        settings = self.settings.faults
        node = self.state.snapshot().inventory.node
        if settings.restarter_address:
            outbox = Outbox(Path(settings.state_dir) / "outbox")
            try:
                sender = Sender(
                    outbox,
                    SenderSettings(
                        address=settings.restarter_address,
                        token_file=Path(settings.token_file),
                        ca_file=Path(settings.ca_file) if settings.ca_file else None,
                        server_name=settings.server_name,
                        insecure=settings.insecure,
                    ),
                )
            except ValueError:
                outbox.close()
                raise
            self.outbox, self.sender = outbox, sender
            sender.start()
            self._log.info(
                "reporting faults to the restarter",
                address=settings.restarter_address,
                outbox=str(outbox.directory),
                pending=len(outbox),
            )
        else:
            self._log.info("no faults.restarter_address: faults are only logged")
        self._faults_on = True
        if api is not None:
            self.pod_exits = PodExitWatcher(api, node, self.report_fault)
            self.pod_exits.start()

    def stop_faults(self) -> None:
        """Stop watching and sending; pending faults stay in the outbox on disk."""
        self._faults_on = False
        if self.pod_exits is not None:
            self.pod_exits.stop()
            self.pod_exits = None
        if self.sender is not None:
            self.sender.stop()
            self.sender = None
        if self.outbox is not None:
            self.outbox.close()
            self.outbox = None

    def report_fault(self, fault: Fault) -> None:
        """Log `fault` and keep it in the outbox for the restarter (any thread)."""
        self._log.warning(
            "fault observed",
            fault_id=fault.id,
            kind=str(fault.kind),
            pods=[f"{p.namespace}/{p.name}" for p in fault.pods],
            container=fault.container,
            exit_code=fault.exit_code,
            devices=list(fault.device_ids) or None,
            reason=fault.reason,
        )
        outbox = self.outbox
        if outbox is None:
            return
        try:
            outbox.enqueue(fault)
        except OutboxError as exc:  # closed while stopping: the fault is seen again next run
            self._log.warning("fault not kept", fault_id=fault.id, error=str(exc))

    def _device_faults(self, turned: list[tuple[str, Condition]]) -> None:
        """Faults for devices that just turned Unhealthy, naming the pods that hold them."""
        snapshot = self.state.snapshot()
        holders = self._pods.pod_devices(snapshot.units)
        node = snapshot.inventory.node
        for device_id, condition in turned:
            held_by = holders.get(device_id, [])
            if not held_by:
                self._log.info(
                    "unhealthy device held by no pod: no fault to report",
                    device=device_id,
                    reason=condition.reason,
                )
                continue
            age = max(0.0, time.monotonic() - condition.since)
            containers = sorted({f"{p.namespace}/{p.pod}/{p.container}" for p in held_by})
            held = f"held by {', '.join(containers)}"
            detail = f"{condition.detail}; {held}" if condition.detail else held
            self.report_fault(
                Fault(
                    id=device_unhealthy_id(node, device_id, condition.reason, condition.since),
                    kind=FaultKind.DEVICE_UNHEALTHY,
                    node=node,
                    observed_at=datetime.now(UTC) - timedelta(seconds=age),
                    pods=tuple(sorted({PodRef(p.namespace, p.pod) for p in held_by})),
                    reason=condition.reason,
                    device_ids=(device_id,),
                    detail=detail,
                )
            )

    def set_cordon(self, cordon: Cordon) -> None:
        """Devices cordoned by the node annotation are advertised Unhealthy until released."""
        with self._health_lock:
            if cordon.device_ids == self._cordoned:
                return
            self._cordoned = cordon.device_ids
            self._publish([])
        self._log.info(
            "cordoned devices changed",
            cordoned=sorted(cordon.device_ids) or None,
            unknown=list(cordon.unknown) or None,
        )

    def start_metrics(self) -> None:
        """Serve /metrics, /healthz and /readyz; OSError when the address cannot be bound."""
        if not self.settings.metrics_addr:
            return
        if any(r.vendor is Vendor.NVIDIA for r in self.state.snapshot().inventory.reports):
            self._nvml_telemetry = NvmlTelemetry(self.root)
        collector = EdlCollector(
            snapshot=self.state.snapshot,
            telemetry=self._telemetry,
            health_counts=self._health_counts,
            agent_counts=self._agent_counts,
            pods=lambda: self._pods.pod_devices(self.state.snapshot().units),
        )
        self.metrics = MetricsServer(
            self.settings.metrics_addr, build_registry(collector), ready=self.ready
        )
        self.metrics.start()

    def stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self._nvml_telemetry is not None:
            self._nvml_telemetry.close()
            self._nvml_telemetry = None
        self._pods.close()

    def _telemetry(self) -> list[DeviceTelemetry]:
        figures = self._nvml_telemetry.read() if self._nvml_telemetry is not None else []
        for vendor_figures in list(self.polled_telemetry.values()):
            figures.extend(vendor_figures)
        return figures

    def _health_counts(self) -> HealthCounts:
        with self._health_lock:
            counts = self.tracker.counts
            return HealthCounts(
                xid_errors=dict(counts.xid_errors),
                transitions=dict(counts.transitions),
                events=dict(counts.events),
            )

    def _agent_counts(self) -> AgentCounts:
        plugin = self.plugins.counters
        return AgentCounts(
            discovery_seconds=self.discovery_seconds,
            nvml_event_loop_restarts=self.nvml.restarts if self.nvml is not None else 0,
            registrations=plugin.registrations,
            registration_failures=plugin.registration_failures,
            plugin_server_restarts=plugin.server_restarts,
            step_failures=dict(self.step_failures),
        )

    def wait_ready(self, timeout: float) -> bool:
        """True once the first tick has served every resource (for embedding and tests)."""
        return self._ready.wait(timeout)

    def ready(self) -> tuple[bool, str]:
        """Readiness for /readyz: every vendor's monitor works and the plugins are served."""
        failed = self.tracker.vendor_conditions()
        if failed:
            reasons = ", ".join(f"{v.value}: {c.reason}" for v, c in failed.items())
            return False, f"health monitor failing ({reasons})"
        if self.nvml is not None and not self.nvml.ready:
            return False, "NVML event loop not running"
        if not self._ready.is_set():
            return False, "starting"
        return True, "ok"

    def report(self, event: HealthEvent) -> None:
        """The health stream: any watcher or poller, any thread."""
        if event.device_id is None and event.reason == GPU_LOST:
            # A GPU lost before we could read its uuid is not in the inventory at all (discovery
            # reports it as an error); it must not take the vendor's other GPUs down with it.
            event = dataclasses.replace(event, level=Level.WARN)
        with self._health_lock:
            devices = self.state.snapshot().inventory.devices
            changes = self.tracker.observe(event, devices)
            self._publish(changes)
            turned: list[tuple[str, Condition]] = []
            if self._faults_on and any(c.to == UNHEALTHY for c in changes):
                conditions = self.tracker.unhealthy(devices)
                turned = [
                    (c.device_id, conditions[c.device_id])
                    for c in changes
                    if c.to == UNHEALTHY and c.device_id in conditions
                ]
        if turned:
            self._guarded("device_faults", lambda: self._device_faults(turned))
        if event.level is not Level.IGNORE or changes:
            self._log.log(
                30 if event.level.unhealthy and not event.cleared else 20,
                "health event",
                vendor=event.vendor.value,
                device=event.device_id,
                reason=event.reason,
                severity=event.level.value,
                cleared=event.cleared or None,
                detail=event.detail or None,
            )

    def unhealthy(self) -> dict[str, Condition]:
        """Unhealthy devices and why (events and vanished device nodes)."""
        with self._health_lock:
            return self.tracker.unhealthy(self.state.snapshot().inventory.devices)

    def tick(self, now: float) -> None:
        if self._presence.take(now):
            self._guarded("presence", lambda: self._check_presence(now))
        if self._polls.take(now):
            self._guarded("vendor_health", self._poll_vendors)
        self._guarded("recovery", lambda: self._expire(now))
        if self._rediscovery.take(now):
            self._guarded("rediscovery", self._rediscover)
        self._guarded("plugins", self.plugins.sync)

    def _start_nvml_watcher(self) -> None:
        reports = self.state.snapshot().inventory.reports
        if not any(r.vendor is Vendor.NVIDIA for r in reports):
            return
        overrides = self.settings.health.xid_levels
        self.nvml = NvmlWatcher(
            self.root,
            self.report,
            lambda code: classify_xid(code, overrides),
            retry_seconds=self.settings.health.nvml_retry_seconds,
        )
        self.nvml.start()

    def _check_presence(self, now: float) -> None:
        devices = self.state.snapshot().inventory.devices
        missing = vanished(devices, self.root.exists)
        if missing == self._vanished:
            return
        gone, back = missing - self._vanished, self._vanished - missing
        self._vanished = missing
        for device in devices:
            if device.id in gone:
                lost = [p for p in device.device_nodes if not self.root.exists(p)]
                detail = f"missing {', '.join(lost)}"
                event = HealthEvent(
                    device.vendor, device.id, NODE_VANISHED, Level.NODE_FATAL, now, detail
                )
                self.report(event)
        if back:
            with self._health_lock:
                self._publish(self.tracker.sound(back, devices, reasons={NODE_VANISHED}))
        self._rediscovery.due = now  # /dev changed: look at the whole node again

    def _poll_vendors(self) -> None:
        inventory = self.state.snapshot().inventory
        for report in inventory.reports:
            if report.vendor not in POLLERS or not report.devices:
                continue
            result = poll(report.vendor, self.root, report.devices, self.settings.health)
            self.polled_telemetry[report.vendor] = result.telemetry
            for event in result.events:
                self.report(event)

    def _expire(self, now: float) -> None:
        with self._health_lock:
            changes = self.tracker.expire(now, self.state.snapshot().inventory.devices)
            self._publish(changes)

    def _rediscover(self) -> None:
        started = time.monotonic()
        inventory = self._keep_failed(discover_node(self.settings))
        self.discovery_seconds = time.monotonic() - started
        if self.state.set_inventory(inventory):
            self._log.info("inventory changed", devices=len(inventory.devices))
        sound = [d for d in inventory.devices if _sound(d, self._vanished)]
        watched = [d.id for d in sound if d.vendor not in POLLERS]
        polled = [d.id for d in sound if d.vendor in POLLERS]
        # A poller re-reports a fault on every poll: what it saw a moment ago is still there.
        fresh = started - 2 * self.settings.health.poll_seconds
        with self._health_lock:
            changes = self.tracker.sound(watched, inventory.devices)
            changes += self.tracker.sound(polled, inventory.devices, seen_before=fresh)
            self._publish(changes)

    def _keep_failed(self, inventory: Inventory) -> Inventory:
        """Devices that fell off the bus drop out of discovery; keep advertising them as
        Unhealthy (rather than letting them vanish from kubelet) until they are found again."""
        listed = {d.id for d in inventory.devices}
        with self._health_lock:
            failed = self.tracker.unhealthy(())
        previous = self.state.snapshot().inventory.devices
        keep = [
            dataclasses.replace(d, health=Health.UNHEALTHY)
            for d in previous
            if d.id not in listed and d.id in failed
        ]
        if not keep:
            return inventory
        reports = tuple(
            dataclasses.replace(
                r, devices=r.devices + tuple(d for d in keep if d.vendor is r.vendor)
            )
            for r in inventory.reports
        )
        devices = [d for r in reports for d in r.devices]
        return Inventory(inventory.node, reports, advertised_resources(devices, self.settings))

    def _publish(self, changes: list[Transition]) -> None:
        """Push the tracker's view into the device state (caller holds the health lock)."""
        devices = self.state.snapshot().inventory.devices
        self.state.set_unhealthy(self.tracker.unhealthy(devices).keys() | self._cordoned)
        for change in changes:
            self._log.log(
                30 if change.to == "Unhealthy" else 20,
                "device health changed",
                device=change.device_id,
                to=change.to,
                reason=change.reason,
                detail=change.detail or None,
            )

    def _guarded(self, step: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            self.step_failures[step] += 1
            self._log.exception("agent step failed", step=step, failures=self.step_failures[step])


def _sound(device: Device, vanished_ids: frozenset[str]) -> bool:
    return device.health is Health.HEALTHY and device.id not in vanished_ids
