"""What the restarter's orchestration needs of a cluster, as two small interfaces of our own.

`ClusterPort` reads and writes: a policy and its status (conditional on the resourceVersion
read), a pod, a pod's replacement. `PodView` answers from what the restarter has seen of pods
and nodes, without a call. `actuator.Actuator` with `watchers.ClusterWatcher` implement them on
a real API server; `memory.InMemoryCluster` implements both in memory, for tests and for trying
policies without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from edl_agent.faults.model import FaultKind, PodRef


class Conflict(Exception):
    """The policy changed since it was read: read it again and decide again."""


class EvictionRefused(Exception):
    """The Eviction API refused to evict the pod now (a PodDisruptionBudget allows no more
    disruptions): nothing was done; try again later."""


@dataclass(frozen=True)
class Replacement:
    old: str
    new: str | None  # None: deleted only (controller-owned), or nothing to replace
    forced: bool


class ClusterPort(Protocol):
    def read_policy(self, namespace: str, name: str) -> dict[str, Any]:
        """The policy object; ApiError when it cannot be read."""
        ...

    def write_status(self, policy: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the status of `policy` (as read); `Conflict` when it changed since."""
        ...

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as it is now (None: no such pod)."""
        ...

    def replace(
        self,
        pod: Mapping[str, Any],
        *,
        fault_kind: FaultKind,
        failed_node: str,
        force: bool,
        why: str = "",
        graceful: bool = False,
        release: bool = True,
    ) -> Replacement:
        """Create the replacement of `pod` (its name fixed by the restart count, so a second
        try finds the first), then delete `pod` (conditional on its uid). A pod a controller
        owns is only deleted, marked DisruptionTarget first with `why` (the fault); a Job's pod
        is then taken out of its Job's selector unless `release` is False (it waits for its
        node), so that the Job replaces it without waiting for its end and its backoff.

        `graceful`: `pod` is evicted through the Eviction API instead, with its own grace, and
        only then replaced (a bare pod); `EvictionRefused` when a disruption budget says not
        now."""
        ...


class PodView(Protocol):
    def find_pod(self, ref: PodRef) -> dict[str, Any] | None:
        """The pod as last seen (a recently deleted one too), by uid, else by name."""
        ...

    def whole(self, ref: PodRef) -> dict[str, Any] | None:
        """The pod (that uid) as last sent whole, when that is at hand (a pod a fault was just
        seen on); None otherwise: read it."""
        ...

    def pods_in(self, namespace: str) -> list[dict[str, Any]]:
        """Every live pod seen in `namespace`."""
        ...

    def node_not_ready(self, node: str) -> bool: ...

    def node_gone(self, node: str) -> bool:
        """The node is known gone: deleted, or tainted `node.kubernetes.io/out-of-service`."""
        ...

    def node_counts(self) -> tuple[int, int]:
        """(NotReady, all) nodes."""
        ...

    def exists(self, ref: PodRef) -> bool:
        """Whether the pod (that uid) is live: seen, and neither deleted nor being deleted."""
        ...

    def replaced(self, ref: PodRef) -> bool:
        """Whether the restarter replaced or deleted the pod (a replacement names its uid, or
        it carries the restarter's deletion mark)."""
        ...
