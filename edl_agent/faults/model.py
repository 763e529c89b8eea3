"""The fault model shared by agents (which report), the restarter's watchers (which observe) and
its policy (which decides). Pure data."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime


class FaultKind(enum.StrEnum):
    CONTAINER_EXIT = "ContainerExit"  # a container terminated with a non-zero exit code
    DEVICE_UNHEALTHY = "DeviceUnhealthy"  # an accelerator a pod holds turned unhealthy
    NODE_NOT_READY = "NodeNotReady"  # the node was NotReady/Unknown longer than the grace
    POD_FORCE_DELETED = "PodForceDeleted"  # deleted with grace 0 before it terminated
    POD_EVICTED = "PodEvicted"  # evicted, or DisruptionTarget set
    DEVICE_DEGRADED = "DeviceDegraded"  # an accelerator a pod holds warns of a coming fault


@dataclass(frozen=True, order=True)
class PodRef:
    namespace: str
    name: str
    uid: str = ""


@dataclass(frozen=True)
class Fault:
    """One observed fault. `id` is unique and stable: a fault reported twice (an agent's retry,
    or an agent and a watcher seeing the same exit) carries the same id, so it is acted on once.
    `observed_at` is when it happened (UTC)."""

    id: str
    kind: FaultKind
    node: str
    observed_at: datetime
    pods: tuple[PodRef, ...] = ()
    container: str | None = None
    exit_code: int | None = None
    reason: str = ""  # e.g. OOMKilled, Error, XID79
    device_ids: tuple[str, ...] = ()
    detail: str = ""
    source: str = "agent"  # agent | restarter
