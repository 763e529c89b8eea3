"""The node agent's own figures for /metrics (`metrics.inputs.AgentCounts`), gathered from the
running parts at scrape time: a new figure is read here, and exported in `metrics/collectors`."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

from edl_agent.health.nvml_watch import NvmlWatcher
from edl_agent.metrics.inputs import AgentCounts

if TYPE_CHECKING:
    from edl_agent.dra.node import DraNode
    from edl_agent.health.state import DeviceState
    from edl_agent.health.wiring import NodeHealth
    from edl_agent.labels.condition import Unsaved
    from edl_agent.plugin.manager import PluginManager
    from edl_agent.runtime.steps import Steps
    from edl_agent.runtime.supervisor import Supervisor


class Running(Protocol):
    """The parts of the agent whose figures are counted."""

    state: DeviceState
    health: NodeHealth
    plugins: PluginManager
    steps: Steps
    supervisor: Supervisor
    dra: DraNode | None

    def unsaved(self) -> Unsaved: ...


def agent_counts(agent: Running) -> AgentCounts:
    health, plugin, dra, unsaved = agent.health, agent.plugins.counters, agent.dra, agent.unsaved()
    failures = Counter(agent.steps.failures)
    if health.writer is not None and health.writer.failures:
        failures["quarantine_save"] = health.writer.failures
    vendors = {r.vendor.value for r in agent.state.snapshot().inventory.reports}
    return AgentCounts(
        discovery_seconds=health.inventory.discovery_seconds,
        nvml_event_loop_restarts=agent.supervisor.restarts(NvmlWatcher.name),
        registrations=plugin.registrations,
        registration_failures=plugin.registration_failures,
        plugin_server_restarts=plugin.server_restarts,
        step_failures=dict(failures),
        remediations=health.remediation.counted(vendors),
        parts={p.name: (p.up, p.restarts) for p in agent.supervisor.statuses()},
        dra_plugins=dra.plugin_counts() if dra is not None else {},
        dra_publish_failures=dra.publish_failures if dra is not None else 0,
        faults_in_memory=unsaved.faults,
        quarantine_unsaved=unsaved.quarantine,
    )
