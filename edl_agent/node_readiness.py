"""Whether the node agent is ready (/readyz), and what its state directory does not hold: read
from the running parts each time it is asked, never stored.

Ready means every vendor's health monitor works, the NVML event loop runs (on an NVIDIA node),
every resource is served to kubelet and every critical part runs. A disk that refuses writes is
said in the detail, ready or not, and fails nothing: it is no reason to stop serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from edl_agent.labels.condition import Unsaved

if TYPE_CHECKING:
    from edl_agent.faults.outbox import Outbox
    from edl_agent.health.quarantine_writer import QuarantineWriter
    from edl_agent.health.wiring import NodeHealth
    from edl_agent.plugin.manager import PluginManager
    from edl_agent.plugin.round import PluginRound
    from edl_agent.runtime.steps import Steps
    from edl_agent.runtime.supervisor import Supervisor


class Running(Protocol):
    """The parts of the agent that readiness reads."""

    health: NodeHealth
    round: PluginRound
    plugins: PluginManager
    steps: Steps
    supervisor: Supervisor

    def unsaved(self) -> Unsaved: ...


def node_ready(agent: Running) -> tuple[bool, str]:
    """(ready, why) for /readyz."""
    ready, detail = _readiness(agent)
    unsaved = agent.unsaved()
    if unsaved:
        refused = f"the disk refuses writes: {unsaved.describe()} kept in memory only"
        detail = f"{detail}, but {refused}" if ready else f"{detail}; {refused}"
    return ready, detail


def unsaved_now(outbox: Outbox | None, writer: QuarantineWriter | None) -> Unsaved:
    """What the state directory does not hold now, because it refused the writes."""
    return Unsaved(
        faults=outbox.counts().in_memory if outbox is not None else 0,
        quarantine=writer is not None and writer.unsaved,
    )


def _readiness(agent: Running) -> tuple[bool, str]:
    failed = agent.health.hub.monitor_failures()
    if failed:
        reasons = ", ".join(f"{v.value}: {c.reason}" for v, c in failed.items())
        return False, f"health monitor failing ({reasons})"
    nvml = agent.health.nvml
    if nvml is not None and not nvml.ready:
        return False, "NVML event loop not running"
    starting = not agent.round.served.is_set() and not agent.steps.failing("plugins")
    unserved = [] if starting else agent.plugins.unserved()
    if starting or unserved:
        return False, f"no socket served for {', '.join(unserved)}" if unserved else "starting"
    return agent.supervisor.ready()
