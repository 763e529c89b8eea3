"""The node agent's composition root: it builds the parts from the settings and hands them to
one supervisor (`runtime.supervisor`), each run on its own thread; it decides nothing itself.

`Agent.discover(settings)` reads the node first (`health.wiring.read_node`: device discovery,
the boot id, the quarantine an earlier run saved); building the agent from that touches no disk.
The node's health (`health/wiring.py`: the hub and the parts that feed or follow it) and the
plugin round (`plugin/round.py`) run from the start; the CLI starts the rest once kubelet is
served: DRA, fault reporting (the sender, the pod-exit watch, device faults), the metrics server,
the node publisher and its Node watch. Readiness is `node_readiness`'s, the agent's own figures
`agent_counts`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from edl_agent.agent_counts import agent_counts
from edl_agent.config import Settings
from edl_agent.devices.names import claimable
from edl_agent.faults.reporting import FaultReporting
from edl_agent.health.state import Snapshot
from edl_agent.health.tracker import Condition
from edl_agent.health.wiring import NodeAtStart, NodeHealth, read_node
from edl_agent.kubelet.podresources import DEFAULT_TIMEOUT_SECONDS, Claimable, PodResourcesClient
from edl_agent.labels.condition import Unsaved
from edl_agent.labels.cordon import RELEASE_DEVICES
from edl_agent.labels.events import EventSpec
from edl_agent.labels.marks import OperatorMarks
from edl_agent.metrics.inputs import AgentCounts
from edl_agent.node_readiness import node_ready, unsaved_now
from edl_agent.plugin.manager import PluginManager
from edl_agent.plugin.round import TICK_SECONDS, WATCHED_TICK_SECONDS, PluginRound
from edl_agent.runtime.steps import Steps
from edl_agent.runtime.supervisor import StopSignal, Supervisor

if TYPE_CHECKING:
    # Imported where they start: registration with kubelet (serve_kubelet) comes first and
    # needs none of the API client, prometheus_client or the outbox.
    from edl_agent.dra.node import DraNode
    from edl_agent.kube import NodeApi
    from edl_agent.labels.publisher import NodePublisher
    from edl_agent.metrics.node import NodeMetrics


class Agent:
    def __init__(
        self,
        settings: Settings,
        node: NodeAtStart,
        *,
        tick_seconds: float = TICK_SECONDS,  # the plugin round while something is under way
        watched_tick_seconds: float = WATCHED_TICK_SECONDS,  # and after a failed round
        evidence_seconds: float = 5.0,  # reset evidence (at least reset_watch's minimum)
        pod_resources_timeout: float = DEFAULT_TIMEOUT_SECONDS,  # one call to kubelet's API
    ) -> None:
        """`node`: what `read_node` found (`Agent.discover` reads it); nothing is read here."""
        self.settings, self.state, self.stop = settings, node.state, StopSignal()
        wake = self.stop.waker()  # the plugin round's, set by a change in kubelet's directory too
        self.supervisor, self.steps = Supervisor(self.stop), Steps()
        self._log = structlog.get_logger()
        # Started later (the CLI's start_*): None until then.
        self.publisher: NodePublisher | None = None
        self.dra: DraNode | None = None
        self.metrics: NodeMetrics | None = None
        self.pods = PodResourcesClient(settings.pod_resources_socket, timeout=pod_resources_timeout)
        self.health = NodeHealth(
            settings,
            node,
            stop=self.stop,
            pods=self.pods,
            claimable=self._claimable,
            announce=lambda kind, reason, message: self._announce(EventSpec(kind, reason, message)),
            release_annotation=RELEASE_DEVICES,
            on_unsaved=self._unsaved_turned,
            inventory_changed=wake.set,  # servers for new resources now
            evidence_seconds=evidence_seconds,
        )
        self.hub, self.root = self.health.hub, self.health.root
        self.plugins = PluginManager(settings=settings.plugin, state=self.state, root=self.root)
        self.round = PluginRound(
            self.plugins,
            wake,
            guarded=self.steps.run,
            tick_seconds=tick_seconds,
            watched_tick_seconds=watched_tick_seconds,
        )
        self.marks = OperatorMarks(self.hub, self._announce)
        self.faults = FaultReporting(settings.faults, self.state.snapshot().inventory.node)

    @classmethod
    def discover(cls, settings: Settings, **tunables: float) -> Agent:
        """The agent for this node: `read_node`, then build (see `__init__` for `tunables`)."""
        return cls(settings, read_node(settings), **tunables)

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
        # Every job is a part of its own: a vendor tool that hangs, or a kubelet that does not
        # answer, delays neither the others nor the health stream.
        self.supervisor.add(self.round)
        self.health.add_parts(self.supervisor, self.steps)
        try:
            self.supervisor.start()
            self.stop.wait()
        finally:
            self.stop.set()
            self.state.wake()  # parts waiting on the device state check `stop`
            self.supervisor.join()
            self.close()

    def close(self) -> None:
        """Release what the parts leave once stopped (after `run`, or instead of it when
        starting failed half-way) and remove our sockets."""
        self.stop.set()
        for started in [part.stop for part in (self.faults, self.dra, self.metrics) if part]:
            started()
        self.state.close()
        self.plugins.close()
        self.pods.close()
        if self.health.writer is not None:
            self.health.writer.flush()
        self._log.info("agent stopped")

    # The parts the CLI starts once kubelet is served.

    def start_publisher(self, api: NodeApi | None) -> None:
        """Publish labels, the node condition and events (only logged when `api` is None), and
        the ConfigMap Volcano's Ascend scheduling reads when `node.volcano_device_info`."""
        from edl_agent.labels.publisher import NodePublisher

        self.publisher = NodePublisher(
            api=api,
            settings=self.settings,
            state=self.state,
            root=self.root,
            unhealthy=self.hub.unhealthy,
            degraded=self.hub.degraded,
            on_cordon=self.marks.cordon,
            on_release=self.marks.release,
            monitors=self.hub.monitor_failures,
            unsaved=self.unsaved,
        )
        self.hub.subscribe(self.publisher.poke_event, lambda change: change.shown, keep=False)
        for part in self.publisher.parts():
            self.supervisor.add(part, critical=False)
        if api is not None and self.settings.node.volcano_device_info:
            from edl_agent.labels.volcano_writer import VolcanoDeviceInfo

            writer = VolcanoDeviceInfo(
                api=api,
                state=self.state,
                conditions=self.hub.withdrawing,
                prefix=self.settings.ascend.resource_prefix,
                overrides=self.settings.health.ascend_code_levels,
            )
            self.hub.subscribe(writer.poke_event, lambda change: change.shown, keep=False)
            self.supervisor.add(writer, critical=False)

    def start_dra(self, api: NodeApi | None) -> None:
        """Serve the vendors whose `serve` is `dra` or `both` through DRA (dra/node.py; only
        logged when `api` is None). OSError when its socket or CDI directory cannot be made."""
        from edl_agent.dra.wiring import start_dra

        self.dra = start_dra(
            self.settings,
            state=self.state,
            root=self.root,
            api=api,
            reasons=self._reasons,
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
        device_faults = DeviceFaults(
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
        self.supervisor.add(device_faults, critical=False)

    def start_metrics(self) -> None:
        """Serve /metrics, /healthz and /readyz; OSError when the address cannot be bound."""
        if not self.settings.metrics_addr:
            return
        from edl_agent.metrics.node import NodeMetrics

        self.metrics = NodeMetrics(
            self.settings.metrics_addr,
            root=self.root,
            state=self.state,
            polled=self.health.polls.all_telemetry,
            hub=self.hub,
            agent_counts=self.agent_counts,
            pods=self.pods,
            claimable=self._claimable,
            ready=self.ready,
        )
        self.metrics.start(self.supervisor)

    # What the parts offer, for the CLI, /metrics, /readyz and tests.

    def unhealthy(self) -> dict[str, Condition]:
        return self.hub.unhealthy()

    def _reasons(self) -> dict[str, str]:
        """Device id → the reason it is unhealthy, or degraded (DRA's health and taints)."""
        found = {**self.hub.degraded(), **self.hub.unhealthy()}
        return {device_id: condition.reason for device_id, condition in found.items()}

    def wait_ready(self, timeout: float) -> bool:
        """True once the first plugin round has served every resource."""
        return self.round.served.wait(timeout)

    def ready(self) -> tuple[bool, str]:
        """Readiness for /readyz (`node_readiness`)."""
        return node_ready(self)

    def unsaved(self) -> Unsaved:
        """What the state directory does not hold now, because it refused the writes."""
        return unsaved_now(self.faults.outbox, self.health.writer)

    def agent_counts(self) -> AgentCounts:
        return agent_counts(self)

    def _unsaved_turned(self) -> None:
        """The disk started or stopped refusing: the node condition says so (any thread)."""
        if self.publisher is not None:
            self.publisher.poke_event.set()

    def _announce(self, event: EventSpec) -> None:
        if self.publisher is not None:
            self.publisher.announce(event)

    def _claimable(self, snapshot: Snapshot) -> Claimable:
        serve = self.settings.serve
        return claimable(snapshot.inventory, lambda v: serve(v.value) != "device-plugin")
