"""The node agent: its parts under one supervisor, and the health stream that joins them.

Every long-running job is a part of `runtime.supervisor` with its own thread: `plugins` (kubelet
registration and servers, device-node presence, quiet periods), `rediscovery`, one
`poll-<vendor>` per polled vendor, `reset-evidence` (NVML reset marks, the boot id),
`remediation` (opt-in), and the threads of the NVML watcher, node publisher, fault sender,
pod-exit watcher and metrics server, watched. A part that dies is logged, counted and started
again after a backoff; a hung vendor tool holds up only its own part. Health events from any
part go through `report()`, the one health stream that feeds the device plugin (ListAndWatch
wakes at once), the node publisher, the quarantine file and the metrics.

Fault reports (`start_faults`): a device that turns Unhealthy while pods hold it (kubelet's
pod-resources API; shares count for their physical device) becomes one DEVICE_UNHEALTHY fault
per pod holding it (`pod_faults.per_pod_faults`: with the pod's uid and never dated before the
pod, when the pod watcher has seen it) — a device no pod holds gives the restarter nothing to
restart, so it is only logged. A watcher of this node's pods adds CONTAINER_EXIT faults. Faults
go to the durable outbox under `faults.state_dir`, which a sender delivers to the restarter;
with no `faults.restarter_address` they are only logged.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from edl_agent.config import Settings
from edl_agent.devices.carry import carry_forward
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.devices.names import claimable
from edl_agent.health.classify import classify_xid, what_clears
from edl_agent.health.model import (
    ClearsBy,
    DeviceTelemetry,
    Evidence,
    HealthEvent,
    Level,
    ends,
)
from edl_agent.health.nvml_reset import (
    Baseline,
    read_baselines,
)
from edl_agent.health.nvml_watch import GPU_LOST, NvmlWatcher
from edl_agent.health.polled import POLLERS, PollResult, poll
from edl_agent.health.presence import vanished
from edl_agent.health.quarantine_store import Quarantine, QuarantineStore, read_boot_id
from edl_agent.health.remediation import (
    Attempt,
    History,
    Outcome,
    Remediator,
    choose,
    held_ids,
    record,
    validate_reset,
)
from edl_agent.health.reset_evidence import check_resets, waiting_for_reset
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.tracker import UNHEALTHY, Condition, HealthTracker, Transition
from edl_agent.kubelet.podresources import PodRef, PodResourcesClient
from edl_agent.labels.condition import device_name
from edl_agent.labels.cordon import RELEASE_DEVICES, Cordon
from edl_agent.labels.events import NORMAL, WARNING, EventSpec
from edl_agent.log_limit import LogLimiter
from edl_agent.metrics.inputs import AgentCounts, HealthCounts
from edl_agent.plugin.dirwatch import DirectoryWatch
from edl_agent.plugin.manager import PluginManager
from edl_agent.runtime.supervisor import Every, Supervisor, Watched

if TYPE_CHECKING:
    # Imported where they start (start_faults, start_metrics, start_publisher): registration
    # with kubelet (serve_kubelet) comes first and needs none of the API client,
    # prometheus_client or fault reporting.
    from edl_agent.dra.node import DraNode
    from edl_agent.faults.model import Fault
    from edl_agent.faults.outbox import Outbox
    from edl_agent.faults.pod_exits import PodExitWatcher
    from edl_agent.faults.sender import Sender
    from edl_agent.health.nvml_telemetry import NvmlTelemetry
    from edl_agent.kube import NodeApi
    from edl_agent.labels.publisher import NodePublisher
    from edl_agent.metrics.server import MetricsServer

TICK_SECONDS = 0.25
# The plugin part's round while kubelet's directory is watched and nothing waits to register: a
# kubelet restart wakes it at once, and a quiet period's end is a deadline of its own, so the
# round is for device-node presence.
WATCHED_TICK_SECONDS = 1.0
# The shortest wait for a quiet period's end (one that is already due is expired in this round).
MIN_TICK_SECONDS = 0.01
NODE_VANISHED = "NODE_VANISHED"
DEVICE_GONE = "DEVICE_GONE"
DISCOVERY_FAILED = "DISCOVERY_FAILED"


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
    """The agent's stop flag; setting it also ends every part's wait for its next round: the
    plugin tick's `wake` (which a change in kubelet's directory sets too) and each `waker()`."""

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

    def __post_init__(self) -> None:
        self.root = HostRoot.at(self.settings.host_root)
        self._log = structlog.get_logger()
        started = time.monotonic()
        self.state = DeviceState(discover_node(self.settings))
        self.discovery_seconds = time.monotonic() - started
        self.plugins = PluginManager(
            settings=self.settings.plugin, state=self.state, root=self.root
        )
        health = self.settings.health
        self.tracker = HealthTracker(
            quiet_seconds=health.quiet_seconds,
            clears_by=lambda event: what_clears(
                event,
                xid_overrides=health.xid_clears_by,
                ascend_overrides=health.ascend_code_clears_by,
            ),
        )
        self._health_lock = threading.Lock()
        self._event_log = LogLimiter(interval=EVENT_LOG_SECONDS)
        self.boot_id = read_boot_id(self.root.read_optional)
        self._store = (
            QuarantineStore(Path(self.settings.faults.state_dir) / "health")
            if self.settings.faults.state_dir
            else None
        )
        self._baselines: dict[str, Baseline] = {}
        self._quarantine_keys: frozenset[tuple[str, str, str]] = frozenset()
        self._restore_quarantine()
        self._remediation = Remediator(
            self.root,
            health.remediation,
            validate=lambda device: validate_reset(self.root, device, health),
        )
        self._remediation_history = History()
        self.remediations: Counter[tuple[str, str]] = Counter()  # (vendor, result)
        self._vanished: frozenset[str] = frozenset()
        self._gone: frozenset[str] = frozenset()
        self._discovery_failed: frozenset[Vendor] = frozenset()
        self.polled_telemetry: dict[Vendor, list[DeviceTelemetry]] = {}
        self.nvml: NvmlWatcher | None = None
        self._presence = _Schedule(self.settings.plugin.health_poll_seconds)
        self._directory_watched = False
        self.supervisor = Supervisor(self.stop)
        self._rediscover_now = self.stop.waker()
        self.rediscoveries = 0
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
        self.dra: DraNode | None = None
        # Device id → the condition of a device fault waiting for kubelet's pod-resources API.
        self._pending_faults: dict[str, Condition] = {}
        self._pending_lock = threading.Lock()

    def serve_kubelet(self) -> None:
        """Serve every resource and register it with kubelet now, before the rest starts: the
        devices are schedulable as soon as discovery is done (`run` keeps them registered)."""
        self._guarded("plugins", self.plugins.sync)

    def run(self) -> None:
        """Run until `stop` is set; then stop the watchers and servers and remove our sockets."""
        self._log.info(
            "agent running",
            node=self.state.snapshot().inventory.node,
            kubelet_dir=str(self.plugins.directory),
            resources=sorted(self.state.snapshot().resources),
        )
        self._start_nvml_watcher()
        self._add_parts()
        # A change in kubelet's directory (a kubelet restart) makes the next tick come at once.
        directory_watch = DirectoryWatch(self.plugins.directory, self.stop.wake.set)
        try:
            self._directory_watched = directory_watch.start()
            self.supervisor.start()
            self.stop.wait()
        finally:
            directory_watch.stop()
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
        self._log.info("agent stopped")

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
        self.publisher.start()
        self.supervisor.add(Watched("node-publisher", self.publisher), critical=False)

    def start_dra(self, api: NodeApi | None) -> None:
        """Serve the vendors whose `serve` is `dra` or `both` through DRA: kubelet plugins, CDI
        specs and ResourceSlices (only logged when `api` is None). Raises OSError when the
        plugin socket or the CDI directory cannot be made."""
        from edl_agent.dra.node import DraNode, dra_vendors

        if not dra_vendors(self.settings) and not self.settings.plugin.cdi:
            if api is not None:
                self._remove_stale_slices(api)
            return
        from edl_agent.dra.api import KubeDraApi

        self.dra = DraNode(
            self.settings,
            self.state,
            self.root,
            api=KubeDraApi(api) if api is not None else None,
            reasons=lambda: {d: c.reason for d, c in self.unhealthy().items()},
            pods=self._pods,
        )
        self.dra.start()
        self.supervisor.add(self.dra, critical=False)
        self._log.info(
            "serving through DRA",
            drivers=sorted(self.dra.servers),
            registry=self.settings.dra.plugins_registry_dir,
            cdi_dir=self.settings.dra.cdi_dir,
        )

    def _remove_stale_slices(self, api: NodeApi) -> None:
        """In the background: ResourceSlices of this node left by a configuration that served a
        vendor through DRA are removed (one list call when there are none)."""
        from edl_agent.dra.api import KubeDraApi
        from edl_agent.dra.publisher import remove_stale_slices

        node = self.state.snapshot().inventory.node
        threading.Thread(
            target=remove_stale_slices,
            args=(KubeDraApi(api), node),
            name="dra-cleanup",
            daemon=True,
        ).start()

    def start_faults(self, api: NodeApi | None) -> None:
        """Report faults: open the outbox and start its sender (when a restarter is configured)
        and watch this node's pods for container exits (when `api` is given). Raises OutboxError
        when the state directory cannot be used, ValueError for unusable sender settings."""
        from edl_agent.faults.outbox import Outbox
        from edl_agent.faults.sender import Sender, SenderSettings

        settings = self.settings.faults
        node = self.state.snapshot().inventory.node
        if settings.restarter_address:
            outbox = Outbox(Path(settings.state_dir) / "outbox")
            try:
                sender = Sender(outbox, SenderSettings.from_settings(settings))
            except ValueError:
                outbox.close()
                raise
            self.outbox, self.sender = outbox, sender
            sender.start()
            self.supervisor.add(Watched("fault-sender", sender), critical=False)
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
            from edl_agent.faults.pod_exits import PodExitWatcher

            self.pod_exits = PodExitWatcher(api, node, self.report_fault)
            self.pod_exits.start()
            self.supervisor.add(Watched("pod-exits", self.pod_exits), critical=False)

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
        from edl_agent.faults.outbox import OutboxError  # loaded with the outbox

        try:
            outbox.enqueue(fault)
        except OutboxError as exc:  # closed while stopping: the fault is seen again next run
            self._log.warning("fault not kept", fault_id=fault.id, error=str(exc))

    def _device_faults(self, turned: list[tuple[str, Condition]]) -> None:
        """Faults for devices that just turned Unhealthy: one per pod holding the device."""
        from edl_agent.faults.ids import device_unhealthy_id
        from edl_agent.faults.model import Fault, FaultKind
        from edl_agent.faults.pod_faults import per_pod_faults

        snapshot = self.state.snapshot()
        holders = self._pods.pod_devices_known(snapshot.units, self._claimable(snapshot))
        if holders is None:
            # "No answer" is not "no pods": the faults wait for kubelet's answer (plugin round).
            with self._pending_lock:
                first = not self._pending_faults
                self._pending_faults.update(turned)
            if first:
                self._log.warning(
                    "kubelet's pod-resources API does not answer: device faults wait for it",
                    devices=[device_id for device_id, _ in turned],
                )
            return
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
            spell = Fault(
                id=device_unhealthy_id(node, device_id, condition.reason, condition.since),
                kind=FaultKind.DEVICE_UNHEALTHY,
                node=node,
                observed_at=datetime.now(UTC) - timedelta(seconds=age),
                reason=condition.reason,
                device_ids=(device_id,),
                detail=detail,
            )
            names = sorted({(p.namespace, p.pod) for p in held_by})
            for fault in per_pod_faults(spell, [self._pod_object(*name) for name in names]):
                self.report_fault(fault)

    def _pod_object(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The pod as the pod watcher last saw it (uid, creation time); else its name alone,
        which is all kubelet's pod-resources API tells."""
        watcher = self.pod_exits
        pod = watcher.pod(namespace, name) if watcher is not None else None
        return pod if pod is not None else {"metadata": {"namespace": namespace, "name": name}}

    def _retry_device_faults(self) -> None:
        with self._pending_lock:
            pending, self._pending_faults = self._pending_faults, {}
        if pending:
            self._device_faults(list(pending.items()))

    def pods_holding(self, snapshot: Snapshot) -> dict[str, list[PodRef]]:
        """Device id → the containers holding it, through the device plugin or a DRA claim."""
        return self._pods.pod_devices(snapshot.units, self._claimable(snapshot))

    def _claimable(self, snapshot: Snapshot) -> dict[tuple[str, str, str], str]:
        return claimable(
            snapshot.inventory, lambda vendor: self.settings.serve(vendor.value) != "device-plugin"
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

    def release(self, released: Cordon) -> None:
        """An operator released these devices (`edl.io/release-devices`): every quarantine of
        theirs ends, whatever it waited for."""
        with self._health_lock:
            changes = self.tracker.clear(released.device_ids, Evidence.RELEASE)
            for device_id in released.device_ids:
                self._baselines.pop(device_id, None)
            self._publish(changes)
            self._save_quarantine()
        if changes:
            names = ", ".join(c.device_id for c in changes)
            self._announce(NORMAL, "AcceleratorReleased", f"released by an operator: {names}")
        self._log.warning(
            "devices released by an operator",
            released=sorted(released.device_ids) or None,
            back_in_service=[c.device_id for c in changes] or None,
            unknown=list(released.unknown) or None,
        )

    def _announce(self, kind: str, reason: str, message: str) -> None:
        if self.publisher is not None:
            self.publisher.announce(EventSpec(kind, reason, message))

    def monitor_failures(self) -> dict[Vendor, Condition]:
        with self._health_lock:
            return dict(self.tracker.monitor_failures())

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
            health_counts=self._health_counts,
            agent_counts=self._agent_counts,
            pods=lambda: self.pods_holding(self.state.snapshot()),
        )
        self.metrics = MetricsServer(
            self.settings.metrics_addr, build_registry(collector), ready=self.ready
        )
        self.metrics.start()
        self.supervisor.add(Watched("metrics", self.metrics), critical=False)

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
            failing = self.tracker.monitor_failures()
            devices = self.state.snapshot().inventory.devices
            return HealthCounts(
                xid_errors=dict(counts.xid_errors),
                transitions=dict(counts.transitions),
                events=dict(counts.events),
                quarantined=frozenset(
                    (device_id, c.reason, c.clears_by.value)
                    for device_id in self.tracker.unhealthy(devices)
                    for c in self.tracker.conditions(device_id)
                ),
                monitors={
                    r.vendor.value: r.vendor not in failing
                    for r in self.state.snapshot().inventory.reports
                },
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
            remediations=self._remediation_counts(),
            parts={p.name: (p.up, p.restarts) for p in self.supervisor.statuses()},
            dra_plugins=self.dra.plugin_counts() if self.dra is not None else {},
            dra_publish_failures=self.dra.publish_failures if self.dra is not None else 0,
        )

    def _remediation_counts(self) -> dict[tuple[str, str], int]:
        settings = self.settings.health.remediation
        if not settings.enabled:
            return dict(self.remediations)
        vendors = {r.vendor.value for r in self.state.snapshot().inventory.reports}
        zeros = {
            (vendor, result): 0
            for vendor in vendors & settings.commands.keys()
            for result in ("reset", "failed", "escalated")
        }
        return zeros | dict(self.remediations)

    def wait_ready(self, timeout: float) -> bool:
        """True once the first tick has served every resource (for embedding and tests)."""
        return self._ready.wait(timeout)

    def ready(self) -> tuple[bool, str]:
        """Readiness for /readyz: every vendor's monitor works and the plugins are served."""
        with self._health_lock:
            failed = self.tracker.monitor_failures()
        if failed:
            reasons = ", ".join(f"{v.value}: {c.reason}" for v, c in failed.items())
            return False, f"health monitor failing ({reasons})"
        if self.nvml is not None and not self.nvml.ready:
            return False, "NVML event loop not running"
        if not self._ready.is_set():
            return False, "starting"
        return self.supervisor.ready()

    def report(self, event: HealthEvent) -> None:
        """The health stream: any watcher or poller, any thread."""
        if event.device_id is None and event.reason == GPU_LOST:
            # A GPU lost before we could read its uuid is not in the inventory at all (discovery
            # reports it as an error); it must not take the vendor's other GPUs down with it.
            event = dataclasses.replace(event, level=Level.WARN)
        with self._health_lock:
            devices = self.state.snapshot().inventory.devices
            changes = self.tracker.observe(event, devices)
            if changes:
                self._publish(changes)
            self._save_quarantine()
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
        if changes and event.vendor is Vendor.NVIDIA and event.device_id is not None:
            self._guarded("reset_baseline", lambda: self._take_baseline(event.device_id or ""))
        if event.level is not Level.IGNORE or changes:
            # A flood of one fault logs its first line, then one line per interval with the
            # number held back; the counters count every event.
            held_back = self._event_log.allow((event.device_id, event.reason, event.cleared))
            if held_back is not None or changes:
                self._log.log(
                    30 if event.level.unhealthy and not event.cleared else 20,
                    "health event",
                    vendor=event.vendor.value,
                    device=event.device_id,
                    reason=event.reason,
                    severity=event.level.value,
                    cleared=event.cleared or None,
                    detail=event.detail or None,
                    repeats_not_logged=held_back or None,
                )

    def unhealthy(self) -> dict[str, Condition]:
        """Unhealthy devices and why (events and vanished device nodes)."""
        with self._health_lock:
            return self.tracker.unhealthy(self.state.snapshot().inventory.devices)

    def tick(self, now: float) -> None:
        """The plugin part's round: device-node presence, quiet periods, kubelet's servers."""
        if self._presence.take(now):
            self._guarded("presence", lambda: self._check_presence(now))
            if self._pending_faults:
                self._guarded("device_faults", self._retry_device_faults)
        self._guarded("recovery", lambda: self._expire(now))
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
                self._publish(self.tracker.clear(back, Evidence.GONE, reasons={NODE_VANISHED}))
        self._rediscover_now.set()  # /dev changed: look at the whole node again

    def _poll_vendor(self, vendor: Vendor) -> None:
        """One poll of one vendor's tool (its own part: a hung tool holds up nothing else)."""
        devices = [d for d in self.state.snapshot().inventory.devices if d.vendor is vendor]
        if not devices:
            return
        result = poll(vendor, self.root, devices, self.settings.health)
        self.polled_telemetry[vendor] = result.telemetry
        for event in result.events:
            self.report(event)
        self._poll_evidence(result)

    def _poll_evidence(self, result: PollResult) -> None:
        """What a working poll shows is over. The vendors' drivers hold a reset-class fault
        (an NPU's RestartNPU code, an XPU/DCU `Fault` state, a volatile ECC count) until the
        device is reset, so a device the tool reads clean again was reset: that is the evidence
        (conditions that wait for a reboot or a person stay)."""
        if not result.ok:
            return
        reported: dict[str, set[str]] = {}
        for event in result.events:
            if event.device_id is not None and event.level.unhealthy:
                reported.setdefault(event.device_id, set()).add(event.reason)
        with self._health_lock:
            self.tracker.monitor_ok(result.vendor)
            changes: list[Transition] = []
            for device_id in result.checked:
                over = {
                    c.reason
                    for c in self.tracker.conditions(device_id)
                    if c.reason.startswith(POLLED_REASON_PREFIXES)
                    and c.reason not in reported.get(device_id, set())
                }
                if over:
                    changes += self.tracker.clear([device_id], Evidence.RESET, reasons=over)
            if changes:
                self._publish(changes)
                self._save_quarantine()

    def _take_baseline(self, device_id: str) -> None:
        """Read the reset marks of a GPU the moment it is quarantined: a reset that follows
        at once must find a baseline to differ from."""
        devices = self.state.snapshot().inventory.devices
        with self._health_lock:
            quarantined = {device_id: self.tracker.quarantined().get(device_id, [])}
            waiting = waiting_for_reset(quarantined, devices)
            if not waiting or device_id in self._baselines:
                return
        readings = read_baselines(self.root, set(waiting.values()))
        with self._health_lock:
            check = check_resets(waiting, {}, readings)
            self._baselines.update(check.baselines)
            self._save_quarantine(force=True)

    def _check_resets(self) -> None:
        """Look for evidence that quarantined NVIDIA devices were reset (NVML) and that the node
        rebooted (its boot id) while this agent ran."""
        boot_id = read_boot_id(self.root.read_optional)
        if boot_id is not None and self.boot_id is not None and boot_id != self.boot_id:
            self._log.warning("node rebooted (new boot id)", was=self.boot_id, now=boot_id)
            self.boot_id = boot_id
            with self._health_lock:
                self._baselines.clear()
                self._publish(self.tracker.reboot())
                self._save_quarantine(force=True)
        devices = self.state.snapshot().inventory.devices
        with self._health_lock:
            waiting = waiting_for_reset(self.tracker.quarantined(), devices)
        if not waiting:
            return
        readings = read_baselines(self.root, set(waiting.values()))
        with self._health_lock:
            check = check_resets(waiting, self._baselines, readings)
            self._baselines = dict(check.baselines)
            changes = self.tracker.clear(check.reset, Evidence.RESET) if check.reset else []
            if changes:
                self._publish(changes)
            self._save_quarantine(force=bool(check.reset) or readings != {})

    def _add_parts(self) -> None:
        """Every periodic job is a part of its own under the supervisor: a vendor tool that
        hangs in a poll or in re-discovery delays neither the other vendors nor kubelet's
        registration (the `plugins` part)."""
        health = self.settings.health
        parts = self.supervisor
        parts.add(Every("plugins", self._plugins_tick_seconds, self._plugins_step, self.stop.wake))
        parts.add(
            Every(
                "rediscovery",
                lambda: self.settings.plugin.rediscover_seconds,
                self._rediscover_step,
                self._rediscover_now,
            )
        )
        for report in self.state.snapshot().inventory.reports:
            if report.vendor in POLLERS:
                parts.add(
                    Every(
                        f"poll-{report.vendor.value}",
                        lambda: health.poll_seconds,
                        functools.partial(self._poll_vendor, report.vendor),
                        self.stop.waker(),
                    )
                )
        parts.add(
            Every(
                "reset-evidence", lambda: health.poll_seconds, self._check_resets, self.stop.waker()
            )
        )
        if self.nvml is not None:
            parts.add(Watched("nvml-watch", self.nvml), critical=False)
        if health.remediation.enabled:
            self._log.info(
                "remediation on: idle devices waiting for a reset are reset",
                vendors=sorted(health.remediation.commands),
                max_per_hour=health.remediation.max_per_hour,
                max_attempts=health.remediation.max_attempts,
            )
            parts.add(
                Every(
                    "remediation",
                    lambda: health.remediation.interval_seconds,
                    self._remediate_now,
                    self.stop.waker(),
                ),
                critical=False,
            )

    def _plugins_tick_seconds(self) -> float:
        if not self._directory_watched or self.plugins.registering:
            tick = TICK_SECONDS
        else:
            tick = min(WATCHED_TICK_SECONDS, self.settings.plugin.health_poll_seconds)
        with self._health_lock:
            quiet_end = self.tracker.next_quiet_end()
        if quiet_end is not None:
            tick = min(tick, max(quiet_end - time.monotonic(), MIN_TICK_SECONDS))
        return tick

    def _plugins_step(self) -> None:
        self.tick(time.monotonic())
        self._ready.set()

    def _rediscover_step(self) -> None:
        if self.rediscoveries:  # the first round's discovery ran in __post_init__
            self._rediscover()
        self.rediscoveries += 1

    def rediscover_now(self) -> None:
        """Run the periodic re-discovery at once (as a change under /dev does)."""
        self._rediscover_now.set()

    def _remediate_now(self) -> None:
        self.remediate(time.monotonic())

    def remediate(self, now: float) -> Outcome | None:
        """Reset one idle device whose quarantine a reset clears, if any may be reset now."""
        snapshot = self.state.snapshot()
        devices = snapshot.inventory.devices
        with self._health_lock:
            quarantined = self.tracker.quarantined()
        waiting_ids = {
            (d.parent or d.id)
            for d in devices
            if any(c.clears_by is ClearsBy.RESET for c in quarantined.get(d.id, ()))
        }
        waiting = [d for d in devices if d.parent is None and d.id in waiting_ids]
        if not waiting:
            return None
        holders = self._pods.pod_devices_known(snapshot.units, self._claimable(snapshot))
        if holders is None:
            self._log.info("no reset: kubelet's pod-resources API does not answer")
            return None
        device = choose(
            waiting=waiting,
            held=held_ids(devices, holders),
            history=self._remediation_history,
            now=now,
            settings=self.settings.health.remediation,
        )
        if device is None:
            return None
        self._log.warning("resetting an idle quarantined device", device=device.id)
        name = device_name(device, device.id)
        self._announce(NORMAL, "AcceleratorResetting", f"{name} idle: reset by the agent")
        outcome = self._remediation.reset(device)
        self._remediation_history = record(
            self._remediation_history,
            Attempt(device.id, now, outcome.ok, outcome.detail),
            now=now,
        )
        family = [d.id for d in devices if device.id in (d.id, d.parent)]
        exhausted = False
        with self._health_lock:
            if outcome.ok:
                self.remediations[(device.vendor.value, "reset")] += 1
                for device_id in family:
                    self._baselines.pop(device_id, None)
                self._publish(self.tracker.clear(family, Evidence.RESET))
            else:
                failures = self._remediation_history.failures.get(device.id, 0)
                exhausted = failures >= self.settings.health.remediation.max_attempts
                self.remediations[(device.vendor.value, "failed")] += 1
                if exhausted:
                    self.remediations[(device.vendor.value, "escalated")] += 1
                    for device_id in family:
                        self.tracker.escalate(device_id)
            self._save_quarantine(force=True)
        if outcome.ok:
            self._announce(NORMAL, "AcceleratorReset", f"{name} reset and validated: in service")
        else:
            self._announce(WARNING, "AcceleratorResetFailed", f"{name}: {outcome.detail}")
        if exhausted:
            self._announce(
                WARNING,
                "AcceleratorResetEscalated",
                f"{name}: {self.settings.health.remediation.max_attempts} resets failed; "
                f"waits for an operator's release ({RELEASE_DEVICES})",
            )
        self._log.log(
            20 if outcome.ok else 40,
            "device reset" if outcome.ok else "device reset failed",
            device=device.id,
            detail=outcome.detail,
            waits_for_release=exhausted or None,
        )
        return outcome

    def _restore_quarantine(self) -> None:
        """Reopen what an earlier run quarantined, before kubelet is first served: a reboot since
        then (a new boot id) ends what a reboot ends; the rest waits as before."""
        if self._store is None:
            return
        saved = self._store.load()
        if saved is None:
            return
        rebooted = saved.boot_id is not None and self.boot_id not in (None, saved.boot_id)
        restored = 0
        for device_id, conditions in saved.conditions.items():
            kept = [c for c in conditions if not rebooted or not ends(c.clears_by, Evidence.REBOOT)]
            if kept:
                self.tracker.restore(device_id, kept)
                restored += 1
        if not rebooted:
            self._baselines = {k: v for k, v in saved.baselines.items() if k in saved.conditions}
        self._log.info(
            "quarantine restored",
            devices=restored,
            rebooted_since=rebooted or None,
            released_by_reboot=(len(saved.conditions) - restored) or None,
        )
        self.state.set_unhealthy(self.tracker.unhealthy(()).keys())
        self._save_quarantine(force=True)

    def _save_quarantine(self, *, force: bool = False) -> None:
        """Keep the quarantine on disk when what is quarantined changed (caller holds the health
        lock). Repeats of an open condition do not write: a flood costs no disk writes."""
        if self._store is None:
            return
        quarantined = self.tracker.quarantined()
        keys = frozenset(
            (device_id, c.reason, c.clears_by.value)
            for device_id, conditions in quarantined.items()
            for c in conditions
        )
        if keys == self._quarantine_keys and not force:
            return
        self._quarantine_keys = keys
        try:
            self._store.save(
                Quarantine(
                    boot_id=self.boot_id,
                    conditions={k: tuple(v) for k, v in quarantined.items()},
                    baselines={k: v for k, v in self._baselines.items() if k in quarantined},
                )
            )
        except OSError as exc:
            self.step_failures["quarantine_save"] += 1
            self._log.error("quarantine not saved", error=str(exc))

    def _expire(self, now: float) -> None:
        with self._health_lock:
            changes = self.tracker.expire(now)
            if changes:
                self._publish(changes)
                self._save_quarantine()

    def _rediscover(self) -> None:
        started = time.monotonic()
        fresh = discover_node(self.settings)
        self.discovery_seconds = time.monotonic() - started
        carried = carry_forward(
            self.state.snapshot().inventory, fresh, carried=self._gone, settings=self.settings
        )
        newly_gone = [d for d in carried.gone if d.id not in self._gone]
        self._gone = frozenset(d.id for d in carried.gone)
        if self.state.set_inventory(carried.inventory):
            self._log.info("inventory changed", devices=len(carried.inventory.devices))
            self.stop.wake.set()  # servers for new resources now, not at the next plugin round
        now = time.monotonic()
        for vendor in {r.vendor for r in carried.inventory.reports}:
            failed = carried.failed.get(vendor)
            if failed is not None:
                self.report(
                    HealthEvent(vendor, None, DISCOVERY_FAILED, Level.WARN, now, detail=failed)
                )
            elif vendor in self._discovery_failed:
                self.report(
                    HealthEvent(vendor, None, DISCOVERY_FAILED, Level.WARN, now, cleared=True)
                )
        self._discovery_failed = frozenset(carried.failed)
        for device in newly_gone:
            detail = "no longer listed by discovery; kept, advertised Unhealthy"
            self.report(
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
        with self._health_lock:
            changes = self.tracker.clear(carried.returned, Evidence.GONE, reasons={DEVICE_GONE})
            self._publish(changes)

    def _publish(self, changes: list[Transition]) -> None:
        """Push the tracker's view into the device state (caller holds the health lock)."""
        devices = self.state.snapshot().inventory.devices
        self.state.set_unhealthy(self.tracker.unhealthy(devices).keys() | self._cordoned)
        if changes:
            self.stop.wake.set()  # the plugin round plans for a quiet period that may have begun
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


POLLED_REASON_PREFIXES = ("XPU_", "DCU_", "NPU_")
EVENT_LOG_SECONDS = 10.0
