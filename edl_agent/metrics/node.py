"""The node's metrics endpoint, wired: /metrics (device state, NVML and polled telemetry, health
counters, the agent's own figures, the pods holding each device), /healthz and /readyz, served
by `MetricsServer`, a supervised part. Loaded only once kubelet is served
(prometheus_client takes a moment to import)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.hub import HealthHub
from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.nvml_telemetry import NvmlTelemetry
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.tracker import HealthTracker
from edl_agent.kubelet.podresources import Claimable, PodRef, PodResourcesClient
from edl_agent.metrics.collectors import EdlCollector, build_registry
from edl_agent.metrics.inputs import AgentCounts, HealthCounts
from edl_agent.metrics.server import MetricsServer
from edl_agent.runtime.supervisor import Supervisor


class NodeMetrics:
    def __init__(
        self,
        address: str,
        *,
        root: HostRoot,
        state: DeviceState,
        polled: Callable[[], list[DeviceTelemetry]],
        hub: HealthHub,
        agent_counts: Callable[[], AgentCounts],
        pods: PodResourcesClient,
        claimable: Callable[[Snapshot], Claimable],
        ready: Callable[[], tuple[bool, str]],
    ) -> None:
        reports = state.snapshot().inventory.reports
        nvidia = any(r.vendor is Vendor.NVIDIA for r in reports)
        self._nvml = NvmlTelemetry(root) if nvidia else None
        self._polled = polled
        self._state, self._pods, self._claimable = state, pods, claimable
        collector = EdlCollector(
            snapshot=state.snapshot,
            telemetry=self._telemetry,
            health_counts=lambda: health_counts(hub),
            agent_counts=agent_counts,
            pods=self._holders,
        )
        self.server = MetricsServer(address, build_registry(collector), ready=ready)

    def start(self, supervisor: Supervisor) -> None:
        """Bind now (OSError when the address cannot be bound) and serve under `supervisor`."""
        self.server.bind()
        supervisor.add(self.server, critical=False)

    def stop(self) -> None:
        """Once the supervisor's parts ended: release what is left (the address too, when the
        server never ran)."""
        self.server.close()
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def _holders(self) -> Mapping[str, Sequence[PodRef]]:
        """The pods holding each device, as kubelet tells."""
        snapshot = self._state.snapshot()
        return self._pods.pod_devices(snapshot.units, self._claimable(snapshot))

    def _telemetry(self) -> list[DeviceTelemetry]:
        figures = self._nvml.read() if self._nvml is not None else []
        return figures + self._polled()


def health_counts(hub: HealthHub) -> HealthCounts:
    """The health counters and what is quarantined now, read in one go."""
    inventory = hub.state.snapshot().inventory

    def view(tracker: HealthTracker) -> HealthCounts:
        counts, failing = tracker.counts, tracker.monitor_failures()
        return HealthCounts(
            xid_errors=dict(counts.xid_errors),
            transitions=dict(counts.transitions),
            events=dict(counts.events),
            quarantined=frozenset(
                (device_id, c.reason, c.clears_by.value)
                for device_id in tracker.unhealthy(inventory.devices)
                for c in tracker.conditions(device_id)
            ),
            monitors={r.vendor.value: r.vendor not in failing for r in inventory.reports},
        )

    return hub.read(view)
