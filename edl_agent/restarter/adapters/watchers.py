"""The restarter's own eyes: list+watch Pods and Nodes (`list_watch.ListWatch`) and turn what
they show into Faults.

`ClusterWatcher` caches pods (and keeps the last state of deleted ones for a while, so the
controller can still read a force-deleted pod's labels) and derives faults (source "restarter")
with the builders the agent uses too (`faults.pod_faults`):

  a container terminated with a non-zero code   ContainerExit  id exit/<uid>/<container>/<restarts>
  deleted with grace 0 before it terminated     PodForceDeleted  id forcedelete/<uid>
  status.reason Evicted or DisruptionTarget     PodEvicted       id evicted/<uid>
  its node Ready False/Unknown for node_grace   NodeNotReady     id notready/<node>/<since>/<uid>

The ids depend only on what happened, so an agent reporting the same exit (same pod uid,
container and restartCount) and a re-list after a reconnect give the same id. Every list and
every event reads exits from `lastState` as well as `state`: a container kubelet restarted in
place while the restarter was down shows its exit only there. An id already emitted by this
process is not emitted again (the newest `KEEP_IDS`); one emitted again after a restart is
harmless downstream (a fault older than its slot's last restart is stale). Pods the actuator
deleted itself (its DisruptionTarget condition of reason `DISRUPTION_REASON`, the annotation
`DELETED_BY_ANNOTATION` of earlier versions, or a uid passed to `ignore_uid`) give no
faults.

`ClusterWatcher.parts()` are supervised parts: each watch (ready once listed) and the node-grace
ticker (`node_grace.NodeGraceTicker`), which faults the pods of a NotReady node the moment its
grace ends. What the node watch shows is kept by `nodes.Nodes` (`ClusterWatcher.nodes`); node
changes are told to `on_nodes` (the controller's storm guard looks again).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client

from edl_agent.faults.ids import node_not_ready_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.pod_faults import (
    DISRUPTION_REASON,
    container_exit_faults,
    eviction_fault,
    force_deletion_fault,
    per_pod_faults,
    pod_node,
    pod_ref,
    terminated_phase,
)
from edl_agent.kube_objects import object_version, version_number
from edl_agent.restarter.adapters.list_watch import Lister, ListWatch
from edl_agent.restarter.adapters.node_grace import NodeGraceTicker
from edl_agent.restarter.adapters.nodes import Nodes
from edl_agent.restarter.core.pod_cache import is_whole, slim_pod
from edl_agent.restarter.core.replacement import (
    DELETED_BY_ANNOTATION,
    REPLACES_UID_ANNOTATION,
    RESTARTER,
)
from edl_agent.runtime.bounded import BoundedMap, BoundedSet
from edl_agent.runtime.supervisor import Part

log = structlog.get_logger(__name__)

KEEP_WHOLE = 1024
KEEP_DELETED = 2048
KEEP_IDS = 100_000
SOURCE = "restarter"

__all__ = [
    "DELETED_BY_ANNOTATION",
    "REPLACES_UID_ANNOTATION",
    "RESTARTER",
    "ClusterWatcher",
    "deleted_by_us",
    "pod_ref",
]


def deleted_by_us(pod: Mapping[str, Any]) -> bool:
    """The restarter set the pod's DisruptionTarget condition before deleting it (or, as
    restarters before it did, the annotation `DELETED_BY_ANNOTATION`)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if annotations.get(DELETED_BY_ANNOTATION) == RESTARTER:
        return True
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == "DisruptionTarget" and c.get("reason") == DISRUPTION_REASON
        for c in conditions
    )


class ClusterWatcher:
    """Pods (in `namespaces`, or all) and Nodes, turned into faults for `on_fault`."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        on_fault: Callable[[Fault], None],
        namespaces: Iterable[str] = (),
        node_grace: float = 40.0,
        on_nodes: Callable[[], None] = lambda: None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`on_nodes()` is called when a node's readiness changes, or a node comes or goes."""
        self._on_fault = on_fault
        self.nodes = Nodes(grace=node_grace, clock=clock, on_change=on_nodes)
        self._grace_tick = self.nodes.grace_tick  # what the node-grace ticker waits for
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}  # uid → pod
        self._deleted: BoundedMap[str, dict[str, Any]] = BoundedMap(KEEP_DELETED)
        # (namespace, name) → uid, of live pods and of the deleted ones kept: `find_pod` by
        # name without a scan (the intake asks it for every pod an agent names).
        self._names: dict[tuple[str, str], str] = {}
        self._deleted_names: BoundedMap[tuple[str, str], str] = BoundedMap(KEEP_DELETED)
        self._ignored = BoundedSet(KEEP_IDS)
        self._emitted = BoundedSet(KEEP_IDS)
        # The pods faults were seen on, whole as sent: replacing them needs no read.
        self._whole: BoundedMap[str, dict[str, Any]] = BoundedMap(KEEP_WHOLE)
        # old pod uid → its replacement's uid (the replacement's REPLACES_UID_ANNOTATION)
        self._replacers: BoundedMap[str, str] = BoundedMap(KEEP_IDS)
        core: Any = client.CoreV1Api(api)
        self._watches: list[ListWatch] = []
        scopes: list[str | None] = [*namespaces] or [None]
        for namespace in scopes:
            call: Lister = (
                core.list_pod_for_all_namespaces
                if namespace is None
                else _bind(core.list_namespaced_pod, namespace)
            )
            self._watches.append(
                ListWatch(
                    f"pods/{namespace or '*'}",
                    call,
                    on_list=functools.partial(self.pods_listed, namespace),
                    on_event=self.pod_event,
                    shrink=slim_pod,
                )
            )
        self._pod_watches = list(self._watches)
        self._watches.append(
            ListWatch("nodes", core.list_node, on_list=self.nodes.listed, on_event=self.nodes.event)
        )

    # --- lifecycle -----------------------------------------------------------------------

    def parts(self) -> list[Part]:
        """The supervised parts: each watch (ready once listed), and the node-grace ticker."""
        return [*self._watches, NodeGraceTicker(self.check_grace, self._grace_tick)]

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.synced.wait(max(0.0, deadline - time.monotonic())) for w in self._watches)

    def stop(self) -> None:
        """End the watches' threads (their parts end with the supervisor's stop)."""
        for watch in self._watches:
            watch.stop()

    def wake(self) -> None:
        """Have the node-grace ticker look now whether a grace has ended (a test's clock
        moved)."""
        self._grace_tick.wakeup.wake()

    # --- what the controller asks --------------------------------------------------------

    def ignore_uid(self, uid: str) -> None:
        """A pod the actuator is about to delete: its deletion and exits are no faults."""
        with self._lock:
            self._ignored.add(uid)

    def find_pod(self, ref: PodRef) -> dict[str, Any] | None:
        """The cached pod (also a recently deleted one), by uid, else namespace and name."""
        with self._lock:
            if ref.uid:
                found = self._pods.get(ref.uid) or self._deleted.get(ref.uid)
                if found is not None:
                    return found
            name = (ref.namespace, ref.name)
            uid = self._names.get(name)
            if uid is not None and uid in self._pods:
                return self._pods[uid]
            uid = self._deleted_names.get(name)
            return self._deleted.get(uid) if uid is not None else None

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self._pods.values() if pod_node(p) == node]

    def node_not_ready(self, node: str) -> bool:
        return self.nodes.not_ready(node)

    def node_gone(self, node: str) -> bool:
        """The node is known gone: deleted (not among the nodes listed and watched), or tainted
        `node.kubernetes.io/out-of-service` (an operator's word that it is down)."""
        return self.nodes.gone(node)

    def node_counts(self) -> tuple[int, int]:
        """(NotReady, all) nodes as the watch shows them now."""
        return self.nodes.counts()

    def replay_pods_from(self, version: str | None) -> None:
        """Before `start`: see the pod events since `version` (an earlier leader's checkpoint)
        after the first list, deletions made while nobody watched among them."""
        for watch in self._pod_watches:
            watch.replay_from = version

    def pods_version(self) -> str | None:
        """The oldest resourceVersion the pod watches have handled (None before they listed)."""
        versions = [w.version for w in self._pod_watches]
        if not versions or any(v is None for v in versions):
            return None
        return min((v for v in versions if v is not None), key=version_number)

    def whole(self, ref: PodRef) -> dict[str, Any] | None:
        with self._lock:
            return self._whole.get(ref.uid)

    def pods_in(self, namespace: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self._pods.values() if pod_ref(p).namespace == namespace]

    def exists(self, ref: PodRef) -> bool:
        with self._lock:
            pod = self._pods.get(ref.uid)
        return pod is not None and not (pod.get("metadata") or {}).get("deletionTimestamp")

    def replaced(self, ref: PodRef) -> bool:
        """Whether the restarter replaced this pod (a replacement names its uid) or deleted it
        (our mark, or a deletion this process made)."""
        with self._lock:
            if ref.uid in self._replacers or ref.uid in self._ignored:
                return True
            pod = self._pods.get(ref.uid) or self._deleted.get(ref.uid)
        return pod is not None and deleted_by_us(pod)

    # --- pods ----------------------------------------------------------------------------

    def pods_listed(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for uid, pod in list(self._pods.items()):
                ref = pod_ref(pod)
                if namespace is None or ref.namespace == namespace:
                    del self._pods[uid]
                    self._names.pop((ref.namespace, ref.name), None)
            for pod in items:
                self._keep(pod)
        for pod in items:
            self._pod_faults(pod, deleted=False)

    def pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        ref = pod_ref(pod)
        with self._lock:
            cached = self._pods.get(ref.uid)
            if (
                kind != "DELETED"
                and cached is not None
                and object_version(cached) >= object_version(pod)
            ):
                return  # a replayed event older than what the list showed
            if kind == "DELETED":
                self._pods.pop(ref.uid, None)
                name = (ref.namespace, ref.name)
                if self._names.get(name) == ref.uid:
                    del self._names[name]
                # Whole only when not ours: a pod deleted by someone else is replaced from
                # this copy, as there is none left to read.
                ours = ref.uid in self._ignored or ref.uid in self._replacers
                self._whole.pop(ref.uid, None)
                self._deleted[ref.uid] = slim_pod(pod) if ours else pod
                self._deleted_names[name] = ref.uid
            else:
                self._keep(pod)
        self._pod_faults(pod, deleted=kind == "DELETED")

    def _keep(self, pod: dict[str, Any]) -> None:
        """Cache a live pod (the lock held)."""
        ref = pod_ref(pod)
        self._pods[ref.uid] = slim_pod(pod)
        self._names[(ref.namespace, ref.name)] = ref.uid
        replaces = ((pod.get("metadata") or {}).get("annotations") or {}).get(
            REPLACES_UID_ANNOTATION
        )
        if replaces:
            self._replacers[str(replaces)] = ref.uid

    def _pod_faults(self, pod: dict[str, Any], *, deleted: bool) -> None:
        with self._lock:
            uid = pod_ref(pod).uid
            if uid in self._ignored or uid in self._replacers:
                return
        if deleted_by_us(pod):
            return
        if not deleted and self._grace_tick.is_past(pod_node(pod)):
            self._grace_tick.wakeup.wake()  # on a node past its grace: its fault is due now
        now = self._clock()
        faults = container_exit_faults(pod, now=now, source=SOURCE)
        evicted = eviction_fault(pod, now=now, source=SOURCE)
        if evicted is not None:
            faults.append(evicted)
        # Deleted with grace 0 while it could still run: whatever exits kubelet restarted it from
        # before (faults of their own, decided already), nothing runs it any more. Seen when it
        # is gone, or before, while a finalizer holds it (a Job's pods carry one): by the time
        # it is gone it has ended Failed, and its Job has counted that failure.
        if evicted is None:
            forced = force_deletion_fault(pod, now=now, source=SOURCE)
            if forced is not None:
                faults.append(forced)
        if faults and is_whole(pod):
            with self._lock:
                self._whole[pod_ref(pod).uid] = pod
        for fault in faults:
            self._emit(fault)

    # --- nodes ---------------------------------------------------------------------------

    def check_grace(self) -> None:
        """Fault every pod on a node NotReady past its grace (the ticker's round)."""
        since = self.nodes.past_grace()
        if not since:
            return
        with self._lock:
            on: dict[str, list[dict[str, Any]]] = {}
            for p in self._pods.values():
                node = pod_node(p)
                if (
                    node in since
                    and not terminated_phase(p)
                    and not deleted_by_us(p)
                    and pod_ref(p).uid not in self._ignored
                ):
                    on.setdefault(node, []).append(p)
        for node, pods in on.items():
            spell = Fault(
                id=node_not_ready_id(node, since[node]),
                kind=FaultKind.NODE_NOT_READY,
                node=node,
                observed_at=since[node],
                detail=f"not Ready since {since[node].isoformat()}",
                source=SOURCE,
            )
            for fault in per_pod_faults(spell, pods):
                self._emit(fault)

    def _emit(self, fault: Fault) -> None:
        with self._lock:
            if not self._emitted.add(fault.id):
                return
        log.info("fault observed", fault_id=fault.id, kind=str(fault.kind), node=fault.node)
        try:
            self._on_fault(fault)
        except Exception:
            with self._lock:
                self._emitted.discard(fault.id)
            log.exception("the fault sink failed", fault_id=fault.id)


def _bind(method: Lister, namespace: str) -> Lister:
    def call(**kwargs: Any) -> Any:
        return method(namespace, **kwargs)

    return call
