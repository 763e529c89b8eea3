"""What the metrics collectors read at scrape time: plain, immutable data that the agent's
parts produce and the collectors only render."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HealthCounts:
    """Running totals kept by the health watchers since the agent started.

    Device ids are physical device ids; "" stands for events about a whole vendor's monitor.
    """

    xid_errors: Mapping[tuple[str, int], int] = field(default_factory=dict)
    """(device_id, xid) → XID errors seen."""
    transitions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    """(device_id, to_health, reason) → health changes, `to_health` being Healthy/Unhealthy."""
    events: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    """(device_id, reason, level) → health events seen."""
    quarantined: frozenset[tuple[str, str, str]] = frozenset()
    """(device_id, reason, clears_by) of every open condition that keeps a device out."""
    monitors: Mapping[str, bool] = field(default_factory=dict)
    """Vendor → whether its health monitor works (vendors the node has)."""


@dataclass(frozen=True)
class AgentCounts:
    """The agent's own figures."""

    discovery_seconds: float = 0.0
    """How long the latest device discovery took."""
    nvml_event_loop_restarts: int = 0
    registrations: int = 0
    registration_failures: int = 0
    plugin_server_restarts: int = 0
    step_failures: Mapping[str, int] = field(default_factory=dict)
    """Supervised step name → times it raised."""
    parts: Mapping[str, tuple[bool, int]] = field(default_factory=dict)
    """Supervised part → (running now, times it died and was started again)."""
    remediations: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(vendor, result) → resets by the agent; zeros for every result once remediation is on."""
    dra_plugins: Mapping[str, tuple[bool, int]] = field(default_factory=dict)
    """DRA driver → (kubelet accepted its plugin, claims prepared now)."""
    dra_publish_failures: int = 0
    faults_in_memory: int = 0
    """Faults waiting for the restarter that the disk does not hold (lost on a restart)."""
    quarantine_unsaved: bool = False
    """The quarantine's last save failed: it is only in memory."""
