"""The agent's Prometheus metrics, read from the agent's parts at scrape time.

`EdlCollector` holds nothing but callables: each scrape asks them for the current snapshot,
telemetry, health totals, agent figures and pod attribution, and renders them. A source that
raises costs only its own families for that scrape (it is logged once until its error changes,
and counted in `edl_metrics_source_errors_total`); the scrape itself never fails.

Label sets: a device's state series carry its identity (vendor, index, device_id, product,
resource) plus the holder (namespace, pod, container; empty when unattributed) — one series per
container holding the device. Figures about the device itself (telemetry, XIDs, health) carry
its identity only, so no figure repeats per pod.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TypeVar

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from edl_agent import __version__
from edl_agent.devices.model import Device
from edl_agent.devices.tool_runs import TOOL_RUNS, ToolCost
from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.state import Snapshot
from edl_agent.kubelet.podresources import PodRef
from edl_agent.metrics.inputs import AgentCounts, HealthCounts
from edl_agent.metrics.wear import TELEMETRY_LABELS, WearFamilies

MIB = 1024 * 1024

DEVICE_LABELS = (
    "vendor",
    "index",
    "device_id",
    "product",
    "resource",
    "namespace",
    "pod",
    "container",
)

T = TypeVar("T")


def _no_telemetry() -> Iterable[DeviceTelemetry]:
    return ()


def _no_pods() -> Mapping[str, Sequence[PodRef]]:
    return {}


class EdlCollector:
    """A prometheus_client custom collector; register it with a registry of its own."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], Snapshot],
        telemetry: Callable[[], Iterable[DeviceTelemetry]] = _no_telemetry,
        health_counts: Callable[[], HealthCounts] = HealthCounts,
        agent_counts: Callable[[], AgentCounts] = AgentCounts,
        pods: Callable[[], Mapping[str, Sequence[PodRef]]] = _no_pods,
        tool_runs: Callable[[], Mapping[str, ToolCost]] = TOOL_RUNS.snapshot,
        version: str = __version__,
    ) -> None:
        self._snapshot = snapshot
        self._telemetry = telemetry
        self._health_counts = health_counts
        self._agent_counts = agent_counts
        self._pods = pods
        self._tool_runs = tool_runs
        self._version = version
        self._lock = threading.Lock()
        self._problems: dict[str, str] = {}
        self._source_errors: dict[str, int] = {}
        self._resources_for: tuple[Snapshot, Mapping[str, str]] | None = None
        self._log = structlog.get_logger()

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so that a registry can refuse clashing names."""
        return [*_Families().all(), *WearFamilies().all()]

    def collect(self) -> Iterator[Metric]:
        snapshot = self._read("snapshot", self._snapshot)
        pods = self._read("pods", self._pods) if snapshot is not None else None
        telemetry = self._read("telemetry", lambda: list(self._telemetry()))
        health = self._read("health_counts", self._health_counts)
        agent = self._read("agent_counts", self._agent_counts)
        tools = self._read("tool_runs", self._tool_runs)

        families = _Families()
        wear = WearFamilies()
        if snapshot is not None:
            self._device_health(families.healthy, snapshot, pods or {})
            for device_id in snapshot.devices:
                worn = 1.0 if device_id in snapshot.degraded_all else 0.0
                wear.degraded.add_metric(_identity(snapshot, device_id), worn)
        if telemetry is not None:
            _telemetry(families, wear, snapshot, telemetry)
        if health is not None:
            _health(families, snapshot, health)
        if agent is not None:
            _agent(families, agent)
        for tool, cost in sorted((tools or {}).items()):
            families.tool_runs.add_metric([tool], cost.runs)
            families.tool_seconds.add_metric([tool], cost.seconds)
        families.info.add_metric([], {"version": self._version})
        with self._lock:
            for source, count in sorted(self._source_errors.items()):
                families.source_errors.add_metric([source], count)
        yield from families.all()
        yield from wear.all()

    def _device_health(
        self, family: GaugeMetricFamily, snapshot: Snapshot, pods: Mapping[str, Sequence[PodRef]]
    ) -> None:
        resources = self._resources(snapshot)
        for device in snapshot.devices.values():
            identity = [device.vendor.value, _index(snapshot, device), device.id, device.product]
            value = 0.0 if device.id in snapshot.unhealthy_all else 1.0
            holders = sorted(set(pods.get(device.id, ())))
            if not holders:
                family.add_metric([*identity, resources.get(device.id, ""), "", "", ""], value)
            for ref in holders:
                family.add_metric(
                    [*identity, ref.resource, ref.namespace, ref.pod, ref.container], value
                )

    def _resources(self, snapshot: Snapshot) -> Mapping[str, str]:
        """Device id → the resources advertising it, comma-joined; computed once per snapshot
        since fractional resources can advertise many thousands of units."""
        with self._lock:
            cached = self._resources_for
            if cached is not None and cached[0] is snapshot:
                return cached[1]
        names: dict[str, set[str]] = {}
        for resource, units in snapshot.units.items():
            for unit in units.values():
                names.setdefault(unit.device_id, set()).add(resource)
        joined = {device_id: ",".join(sorted(found)) for device_id, found in names.items()}
        with self._lock:
            self._resources_for = (snapshot, joined)
        return joined

    def _read(self, source: str, read: Callable[[], T]) -> T | None:
        try:
            value = read()
        except Exception as exc:  # one broken source must not fail the scrape
            problem = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._source_errors[source] = self._source_errors.get(source, 0) + 1
                news = self._problems.get(source) != problem
                self._problems[source] = problem
            if news:
                self._log.warning(
                    "metrics source failed; its metrics are left off",
                    source=source,
                    error=problem,
                    exc_info=True,
                )
            return None
        with self._lock:
            recovered = self._problems.pop(source, None) is not None
        if recovered:
            self._log.info("metrics source answers again", source=source)
        return value


def build_registry(collector: EdlCollector) -> CollectorRegistry:
    """A fresh registry holding only `collector` (never prometheus_client's global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


@dataclass
class _Families:
    """Every family this collector exposes, fresh (without samples) for each scrape."""

    healthy: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_healthy",
            "1 unless the device is unhealthy (itself or its parent): then 0. A degraded device "
            "reads 1 (see edl_device_degraded). "
            "One series per container holding the device; pod labels are empty when none does.",
            labels=DEVICE_LABELS,
        )
    )
    xid: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_xid_errors",
            "NVIDIA XID errors reported for the device since the agent started, per XID code.",
            labels=("device_id", "index", "xid"),
        )
    )
    temperature: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_temperature_celsius",
            "Device temperature in degrees Celsius.",
            labels=TELEMETRY_LABELS,
        )
    )
    power: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_power_watts", "Device power draw in watts.", labels=TELEMETRY_LABELS
        )
    )
    utilization: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_utilization_ratio",
            "Fraction of time the device's compute engines were busy (0 to 1).",
            labels=TELEMETRY_LABELS,
        )
    )
    memory_used: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_memory_used_bytes",
            "Device memory in use, in bytes.",
            labels=TELEMETRY_LABELS,
        )
    )
    memory_total: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_memory_total_bytes",
            "Device memory in all, in bytes.",
            labels=TELEMETRY_LABELS,
        )
    )
    ecc: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_device_ecc_errors",
            "ECC memory errors the device reports, by type (corrected or uncorrected).",
            labels=(*TELEMETRY_LABELS, "type"),
        )
    )
    transitions: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_device_health_transitions",
            "Times the device's health changed, by the health it changed to and why.",
            labels=("device_id", "to", "reason"),
        )
    )
    events: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_health_events",
            "Health events seen, by device (empty for a vendor-wide monitor), reason and level.",
            labels=("device_id", "reason", "level"),
        )
    )
    quarantined: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_quarantined",
            "1 for each open condition keeping a device out of service, by what clears it "
            "(condition, quiet, reset, reboot, release).",
            labels=("device_id", "reason", "clears_by"),
        )
    )
    monitor_up: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_health_monitor_up",
            "1 while the vendor's health monitor works (NVML events, its tool's polls), else 0.",
            labels=("vendor",),
        )
    )
    discovery: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_discovery_duration_seconds", "How long the latest device discovery took."
        )
    )
    nvml_restarts: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_nvml_event_loop_restarts", "Times the NVML event loop was started again."
        )
    )
    registrations: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_plugin_registrations", "Successful device-plugin registrations with kubelet."
        )
    )
    registration_failures: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_plugin_registration_failures",
            "Device-plugin registrations kubelet refused or did not answer.",
        )
    )
    server_restarts: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_plugin_server_restarts",
            "Times a device-plugin server was started again after its socket vanished.",
        )
    )
    step_failures: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_agent_step_failures",
            "Times a supervised step of the agent raised, by step.",
            labels=("step",),
        )
    )
    part_up: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_part_up",
            "1 while a supervised part of the agent runs (plugins, rediscovery, poll-<vendor>, "
            "nvml-watch, node-publisher, ...), 0 while it waits to be started again.",
            labels=("part",),
        )
    )
    part_restarts: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_part_restarts",
            "Times a supervised part of the agent died and was started again.",
            labels=("part",),
        )
    )
    remediations: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_remediations",
            "Resets of idle quarantined devices by the agent, by vendor and result (reset: "
            "validated and back in service; failed; escalated: waits for an operator's release).",
            labels=("vendor", "result"),
        )
    )
    dra_registered: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_dra_plugin_registered",
            "1 when kubelet accepted the DRA plugin of the driver, 0 while it has not.",
            labels=("driver",),
        )
    )
    dra_claims: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_dra_prepared_claims",
            "ResourceClaims prepared on this node for the driver (the checkpoint's count).",
            labels=("driver",),
        )
    )
    dra_publish_failures: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_dra_slice_publish_failures",
            "Failed attempts to publish this node's ResourceSlices (each is retried).",
            labels=(),
        )
    )
    faults_in_memory: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_faults_in_memory",
            "Faults waiting for the restarter that the disk does not hold (a full or read-only "
            "disk): lost if the agent restarts before they are sent or written.",
            labels=(),
        )
    )
    quarantine_unsaved: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_quarantine_unsaved",
            "1 while the quarantine could not be saved (it is kept in memory and tried again).",
            labels=(),
        )
    )
    tool_runs: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_vendor_tool_runs",
            "Vendor tool processes the agent started (health polls, discovery, resets), by tool.",
            labels=("tool",),
        )
    )
    tool_seconds: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_vendor_tool_seconds",
            "Wall-clock seconds the agent's vendor tool processes ran, by tool.",
            labels=("tool",),
        )
    )
    source_errors: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "edl_metrics_source_errors",
            "Scrapes in which a metrics source raised and its metrics were left off, by source.",
            labels=("source",),
        )
    )
    info: InfoMetricFamily = field(
        default_factory=lambda: InfoMetricFamily(
            "edl_agent", "The running edl-agent; the value is always 1.", labels=()
        )
    )

    def all(self) -> list[Metric]:
        return [getattr(self, f.name) for f in fields(self)]


def _telemetry(
    families: _Families,
    wear: WearFamilies,
    snapshot: Snapshot | None,
    telemetry: Iterable[DeviceTelemetry],
) -> None:
    latest = {reading.device_id: reading for reading in telemetry}
    for device_id, reading in sorted(latest.items()):
        labels = _identity(snapshot, device_id)
        utilization = reading.utilization_percent
        for family, value in (
            (families.temperature, reading.temperature_c),
            (families.power, reading.power_w),
            (families.utilization, None if utilization is None else _ratio(utilization)),
            (families.memory_used, _bytes(reading.memory_used_mib)),
            (families.memory_total, _bytes(reading.memory_total_mib)),
        ):
            if value is not None:
                family.add_metric(labels, value)
        for kind, total in (
            ("corrected", reading.ecc_corrected_total),
            ("uncorrected", reading.ecc_uncorrected_total),
        ):
            if total is not None:
                families.ecc.add_metric([*labels, kind], total)
        wear.add(labels, reading)


def _health(families: _Families, snapshot: Snapshot | None, counts: HealthCounts) -> None:
    for (device_id, xid), count in sorted(counts.xid_errors.items()):
        index = _identity(snapshot, device_id)[1]
        families.xid.add_metric([device_id, index, str(xid)], count)
    for (device_id, to, reason), count in sorted(counts.transitions.items()):
        families.transitions.add_metric([device_id, to, reason], count)
    for (device_id, reason, level), count in sorted(counts.events.items()):
        families.events.add_metric([device_id, reason, str(level)], count)
    for device_id, reason, clears_by in sorted(counts.quarantined):
        families.quarantined.add_metric([device_id, reason, clears_by], 1)
    for vendor, up in sorted(counts.monitors.items()):
        families.monitor_up.add_metric([vendor], 1.0 if up else 0.0)


def _agent(families: _Families, counts: AgentCounts) -> None:
    families.discovery.add_metric([], counts.discovery_seconds)
    families.nvml_restarts.add_metric([], counts.nvml_event_loop_restarts)
    families.registrations.add_metric([], counts.registrations)
    families.registration_failures.add_metric([], counts.registration_failures)
    families.server_restarts.add_metric([], counts.plugin_server_restarts)
    for step, count in sorted(counts.step_failures.items()):
        families.step_failures.add_metric([step], count)
    for part, (up, restarts) in sorted(counts.parts.items()):
        families.part_up.add_metric([part], 1.0 if up else 0.0)
        families.part_restarts.add_metric([part], restarts)
    for (vendor, result), count in sorted(counts.remediations.items()):
        families.remediations.add_metric([vendor, result], count)
    for driver, (registered, claims) in sorted(counts.dra_plugins.items()):
        families.dra_registered.add_metric([driver], 1.0 if registered else 0.0)
        families.dra_claims.add_metric([driver], claims)
    if counts.dra_plugins:
        families.dra_publish_failures.add_metric([], counts.dra_publish_failures)
    families.faults_in_memory.add_metric([], counts.faults_in_memory)
    families.quarantine_unsaved.add_metric([], 1.0 if counts.quarantine_unsaved else 0.0)


def _identity(snapshot: Snapshot | None, device_id: str) -> list[str]:
    """[vendor, index, device_id]; vendor and index are empty for a device no longer known."""
    device = None if snapshot is None else snapshot.devices.get(device_id)
    if snapshot is None or device is None:
        return ["", "", device_id]
    return [device.vendor.value, _index(snapshot, device), device_id]


def _index(snapshot: Snapshot, device: Device) -> str:
    """A partition's index is only unique within its parent: `<parent index>/<index>` keeps
    `index="3"` meaning the third physical device on the node."""
    parent = snapshot.devices.get(device.parent) if device.parent is not None else None
    return str(device.index) if parent is None else f"{_index(snapshot, parent)}/{device.index}"


def _ratio(percent: float) -> float:
    return min(max(percent / 100, 0.0), 1.0)


def _bytes(mib: float | None) -> float | None:
    return None if mib is None else mib * MIB
