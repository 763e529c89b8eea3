"""The restarter's own eyes: list+watch Pods and Nodes and turn what they show into Faults.

`ListWatch` keeps one resource's list-then-watch loop alive in a thread: a 410 Gone (too old a
resourceVersion) re-lists, any other failure retries after a backoff (1 s doubling to 30 s).

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

`ClusterWatcher.parts()` are supervised parts: each watch (watched through `Watched`, ready once
listed, its thread's end told at once) and the node-grace ticker (`NodeGraceTicker`), which
faults the pods of nodes NotReady past the grace every `controller.node_grace_tick_seconds`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
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
from edl_agent.kube import call_json, watch_events
from edl_agent.kube_objects import object_version, version_number
from edl_agent.kube_watch import WatchLoop
from edl_agent.restarter.core.pod_cache import is_whole, slim_pod
from edl_agent.restarter.core.replacement import (
    DELETED_BY_ANNOTATION,
    REPLACES_UID_ANNOTATION,
    RESTARTER,
)
from edl_agent.runtime.bounded import BoundedMap, BoundedSet
from edl_agent.runtime.supervisor import Part, Watched

log = structlog.get_logger(__name__)

WATCH_TIMEOUT = 300
MAX_RETRY_DELAY = 30.0
LIST_PAGE = 500
KEEP_WHOLE = 1024
KEEP_DELETED = 2048
KEEP_IDS = 100_000
SOURCE = "restarter"

__all__ = [
    "DELETED_BY_ANNOTATION",
    "REPLACES_UID_ANNOTATION",
    "RESTARTER",
    "ClusterWatcher",
    "ListWatch",
    "deleted_by_us",
    "is_not_ready",
    "pod_ref",
]

Lister = Callable[..., Any]


class ListWatch(WatchLoop):
    """List, then watch from the list's resourceVersion, forever (until `stop`): a `WatchLoop`
    whose retries back off from 1 s, doubling, to 30 s, and which lists again after a 410.

    `list_call(**kwargs)` is a kubernetes client list method bound to its namespace (or cluster
    wide); `on_list(items)` gets every full list, `on_event(type, object)` each watch event."""

    restart_after_crash = True

    def __init__(
        self,
        name: str,
        list_call: Lister,
        *,
        on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        shrink: Callable[[dict[str, Any]], dict[str, Any]] = lambda item: item,
    ) -> None:
        self.name = f"watch-{name}"
        super().__init__(log_context={})
        self._shrink = shrink
        self.version: str | None = None
        """The resourceVersion of the last list or event handled."""
        self.replay_from: str | None = None
        """Set before `start`: after the first list, watch from this older version instead
        of the list's, so that what happened meanwhile (a deletion, say) is seen as events."""
        self._list_call = list_call
        self._on_list = on_list
        self._on_event = on_event
        self.synced = threading.Event()

    def _list(self) -> str | None:
        """List in pages, each item passed through `shrink` as it comes, so that a list of
        many big objects never sits in memory whole."""
        items: list[dict[str, Any]] = []
        version: str | None = None
        token: str | None = None
        while True:
            page = call_json(
                self._list_call, limit=LIST_PAGE, **({"_continue": token} if token else {})
            )
            meta = page.get("metadata") or {}
            version = version or str(meta.get("resourceVersion") or "") or None
            items.extend(self._shrink(item) for item in page.get("items") or [])
            del page
            token = meta.get("continue") or None
            if token is None:
                break
        self._on_list(items)
        replay, self.replay_from = self.replay_from, None
        if replay and version and version_number(replay) < version_number(version):
            log.info("replaying events since an earlier version", watch=self.name, since=replay)
            version = replay  # handled from here on, as the replayed events come
        self.version = version
        self.synced.set()
        return version

    def _watch(self, version: str | None) -> str | None:
        for kind, obj in watch_events(
            self._list_call,
            resource_version=version,
            timeout_seconds=WATCH_TIMEOUT,
            opened=self._opened,
        ):
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind != "BOOKMARK":
                self._on_event(kind, obj)
            self.version = version
        return version

    def _retry_delay(self, failures_in_row: int) -> float:
        return min(2.0 ** (failures_in_row - 1), MAX_RETRY_DELAY)


OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


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


def is_out_of_service(node: Mapping[str, Any]) -> bool:
    """The node carries the `node.kubernetes.io/out-of-service` taint (any effect): an operator
    has said it is down, and what ran there runs no more (Kubernetes' non-graceful shutdown)."""
    taints = (node.get("spec") or {}).get("taints") or []
    return any(t.get("key") == OUT_OF_SERVICE_TAINT for t in taints)


def is_not_ready(node: Mapping[str, Any]) -> bool:
    """The node's Ready condition is False or Unknown (a node without one is taken as Ready).

    When it turned so is not read from the condition: `lastTransitionTime` is the node's own
    clock, and KWOK, say, dates it to the node's creation, so a pod that landed on the node
    after it would look older than its own fault. The grace runs on the restarter's clock from
    when it first saw the node NotReady."""
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") != "True")
    return False


class ClusterWatcher:
    """Pods (in `namespaces`, or all) and Nodes, turned into faults for `on_fault`."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        on_fault: Callable[[Fault], None],
        namespaces: Iterable[str] = (),
        node_grace: float = 40.0,
        grace_tick: float = 0.5,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`grace_tick`: how often NotReady nodes are checked against `node_grace`."""
        self._on_fault = on_fault
        self._node_grace = node_grace
        self._grace_tick = grace_tick
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
        self._not_ready: dict[str, datetime] = {}  # node → since
        self._nodes: set[str] = set()
        self._out_of_service: set[str] = set()  # tainted node.kubernetes.io/out-of-service
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
            ListWatch("nodes", core.list_node, on_list=self.nodes_listed, on_event=self.node_event)
        )

    # --- lifecycle -----------------------------------------------------------------------

    def parts(self) -> list[Part]:
        """The supervised parts: each watch (ready once listed), and the node-grace ticker."""
        watched: list[Part] = [Watched(w.name, w, is_ready=w.synced.is_set) for w in self._watches]
        return [*watched, NodeGraceTicker(self.check_grace, self._grace_tick)]

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.synced.wait(max(0.0, deadline - time.monotonic())) for w in self._watches)

    def stop(self) -> None:
        """End the watches' threads (their parts end with the supervisor's stop)."""
        for watch in self._watches:
            watch.stop()

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
        with self._lock:
            return node in self._not_ready

    def node_gone(self, node: str) -> bool:
        """The node is known gone: deleted (not among the nodes listed and watched), or tainted
        `node.kubernetes.io/out-of-service` (an operator's word that it is down)."""
        with self._lock:
            return node not in self._nodes or node in self._out_of_service

    def node_counts(self) -> tuple[int, int]:
        """(NotReady, all) nodes as the watch shows them now."""
        with self._lock:
            return len(self._not_ready), len(self._nodes)

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
        now = self._clock()
        faults = container_exit_faults(pod, now=now, source=SOURCE)
        evicted = eviction_fault(pod, now=now, source=SOURCE)
        if evicted is not None:
            faults.append(evicted)
        # Gone with grace 0 while it could still run: whatever exits kubelet restarted it from
        # before (faults of their own, decided already), nothing runs it any more.
        if deleted and evicted is None:
            forced = force_deletion_fault(pod, now=now, source=SOURCE)
            if forced is not None:
                faults.append(forced)
        if faults and is_whole(pod):
            with self._lock:
                self._whole[pod_ref(pod).uid] = pod
        for fault in faults:
            self._emit(fault)

    # --- nodes ---------------------------------------------------------------------------

    def nodes_listed(self, items: list[dict[str, Any]]) -> None:
        listed = {str((n.get("metadata") or {}).get("name", "")) for n in items}
        with self._lock:
            # A re-list keeps when a node still NotReady was first seen so: its grace goes on.
            self._not_ready = {n: s for n, s in self._not_ready.items() if n in listed}
            self._nodes.clear()
            self._out_of_service.clear()
        for node in items:
            self.node_event("ADDED", node)

    def node_event(self, kind: str, node: dict[str, Any]) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        not_ready = kind != "DELETED" and is_not_ready(node)
        out_of_service = kind != "DELETED" and is_out_of_service(node)
        with self._lock:
            if kind == "DELETED":
                self._nodes.discard(name)
            else:
                self._nodes.add(name)
            if out_of_service:
                self._out_of_service.add(name)
            else:
                self._out_of_service.discard(name)
            if not_ready:
                self._not_ready.setdefault(name, self._clock())
            else:
                self._not_ready.pop(name, None)

    def check_grace(self) -> None:
        """Fault every pod on a node NotReady for longer than the grace (the ticker's round)."""
        now = self._clock()
        with self._lock:
            due = [
                (n, s)
                for n, s in self._not_ready.items()
                if (now - s).total_seconds() >= self._node_grace
            ]
        for node, since in due:
            spell = Fault(
                id=node_not_ready_id(node, since),
                kind=FaultKind.NODE_NOT_READY,
                node=node,
                observed_at=since,
                detail=f"not Ready since {since.isoformat()}",
                source=SOURCE,
            )
            with self._lock:
                pods = [
                    p
                    for p in self._pods.values()
                    if pod_node(p) == node
                    and not terminated_phase(p)
                    and not deleted_by_us(p)
                    and pod_ref(p).uid not in self._ignored
                ]
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


@dataclass
class NodeGraceTicker:
    """The part that faults the pods of nodes NotReady past the grace, every `interval`
    seconds. A round that raises kills the part; the supervisor runs it again."""

    check: Callable[[], None]
    interval: float
    name: str = "node-grace"

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        while not stop.wait(self.interval):
            self.check()
