"""The restarter's own eyes: list+watch Pods and Nodes and turn what they show into Faults.

`ListWatch` keeps one resource's list-then-watch loop alive in a thread: a 410 Gone (too old a
resourceVersion) re-lists, any other failure retries after a backoff (1 s doubling to 30 s).

`ClusterWatcher` caches pods (and keeps the last state of deleted ones for a while, so the
controller can still read a force-deleted pod's labels) and derives faults (source "restarter"):

  a container terminated with a non-zero code   ContainerExit  id exit/<uid>/<container>/<restarts>
  deleted with grace 0 before it terminated     PodForceDeleted  id forcedelete/<uid>
  status.reason Evicted or DisruptionTarget     PodEvicted       id evicted/<uid>
  its node Ready False/Unknown for node_grace   NodeNotReady     id notready/<node>/<since>/<uid>

The ids depend only on what happened, so an agent reporting the same exit (same pod uid,
container and restartCount) and a re-list after a reconnect give the same id. Pods the actuator
deleted itself (annotation `DELETED_BY_ANNOTATION`, or a uid passed to `ignore_uid`) give no
faults.
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

from edl_agent.bounded import BoundedMap, BoundedSet
from edl_agent.faults.ids import container_exit_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.kube import call_json, watch_events
from edl_agent.kube_time import parse_time
from edl_agent.kube_watch import WatchLoop

log = structlog.get_logger(__name__)

DELETED_BY_ANNOTATION = "edl.io/deleted-by"
RESTARTER = "edl-restarter"
WATCH_TIMEOUT = 300
MAX_RETRY_DELAY = 30.0
KEEP_DELETED = 2048
KEEP_IDS = 100_000

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
    ) -> None:
        self.name = f"watch-{name}"
        super().__init__(log_context={})
        self._list_call = list_call
        self._on_list = on_list
        self._on_event = on_event
        self.synced = threading.Event()

    def _list(self) -> str | None:
        data = call_json(self._list_call)
        self._on_list(list(data.get("items") or []))
        self.synced.set()
        return str((data.get("metadata") or {}).get("resourceVersion") or "") or None

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
        return version

    def _retry_delay(self, failures_in_row: int) -> float:
        return min(2.0 ** (failures_in_row - 1), MAX_RETRY_DELAY)


def pod_ref(pod: Mapping[str, Any]) -> PodRef:
    meta = pod.get("metadata") or {}
    return PodRef(
        str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))
    )


def deleted_by_us(pod: Mapping[str, Any]) -> bool:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations.get(DELETED_BY_ANNOTATION) == RESTARTER


def terminated_phase(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def exit_faults(pod: Mapping[str, Any], now: datetime, *, last: bool = True) -> list[Fault]:
    """A fault for each container whose current (and with `last`, last) state is a non-zero
    termination. A list passes last=False: a container kubelet restarted in place before the
    restarter (re)started is running again, and its old exits are history, not faults."""
    ref = pod_ref(pod)
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    status = pod.get("status") or {}
    faults = []
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        restarts = int(cs.get("restartCount") or 0)
        states = (("state", restarts), ("lastState", restarts - 1))
        for key, count in states if last else states[:1]:
            term = (cs.get(key) or {}).get("terminated")
            if not term or int(term.get("exitCode") or 0) == 0 or count < 0:
                continue
            faults.append(
                Fault(
                    id=container_exit_id(ref.uid, str(cs.get("name")), count),
                    kind=FaultKind.CONTAINER_EXIT,
                    node=node,
                    observed_at=parse_time(term.get("finishedAt")) or now,
                    pods=(ref,),
                    container=str(cs.get("name")),
                    exit_code=int(term["exitCode"]),
                    reason=str(term.get("reason") or ""),
                    source="restarter",
                )
            )
    return faults


def eviction_fault(pod: Mapping[str, Any], now: datetime) -> Fault | None:
    status = pod.get("status") or {}
    disruption = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        None,
    )
    if status.get("reason") != "Evicted" and disruption is None:
        return None
    ref = pod_ref(pod)
    at = parse_time((disruption or {}).get("lastTransitionTime")) or now
    return Fault(
        id=f"evicted/{ref.uid}",
        kind=FaultKind.POD_EVICTED,
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        observed_at=at,
        pods=(ref,),
        reason=str((disruption or {}).get("reason") or status.get("reason") or "Evicted"),
        detail=str((disruption or {}).get("message") or status.get("message") or ""),
        source="restarter",
    )


def force_delete_fault(pod: Mapping[str, Any], now: datetime) -> Fault | None:
    meta = pod.get("metadata") or {}
    if meta.get("deletionGracePeriodSeconds") != 0 or terminated_phase(pod):
        return None
    ref = pod_ref(pod)
    return Fault(
        id=f"forcedelete/{ref.uid}",
        kind=FaultKind.POD_FORCE_DELETED,
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        observed_at=now,
        pods=(ref,),
        source="restarter",
    )


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
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._on_fault = on_fault
        self._node_grace = node_grace
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}  # uid → pod
        self._deleted: BoundedMap[str, dict[str, Any]] = BoundedMap(KEEP_DELETED)
        self._ignored = BoundedSet(KEEP_IDS)
        self._emitted = BoundedSet(KEEP_IDS)
        self._not_ready: dict[str, datetime] = {}  # node → since
        self._nodes: set[str] = set()
        self._stopping = threading.Event()
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
                    on_list=functools.partial(self._pods_listed, namespace),
                    on_event=self._pod_event,
                )
            )
        self._watches.append(
            ListWatch(
                "nodes", core.list_node, on_list=self._nodes_listed, on_event=self._node_event
            )
        )
        self._ticker = threading.Thread(target=self._tick, name="node-grace", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        for watch in self._watches:
            watch.start()
        self._ticker.start()

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.synced.wait(max(0.0, deadline - time.monotonic())) for w in self._watches)

    def stop(self) -> None:
        self._stopping.set()
        for watch in self._watches:
            watch.stop()
        self._ticker.join(timeout=5)

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
            for pod in (*self._pods.values(), *reversed(self._deleted.values())):
                if (pod_ref(pod).namespace, pod_ref(pod).name) == (ref.namespace, ref.name):
                    return pod
        return None

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [p for p in self._pods.values() if (p.get("spec") or {}).get("nodeName") == node]

    def node_not_ready(self, node: str) -> bool:
        with self._lock:
            return node in self._not_ready

    def node_counts(self) -> tuple[int, int]:
        """(NotReady, all) nodes as the watch shows them now."""
        with self._lock:
            return len(self._not_ready), len(self._nodes)

    # --- pods ----------------------------------------------------------------------------

    def _pods_listed(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for uid, pod in list(self._pods.items()):
                if namespace is None or pod_ref(pod).namespace == namespace:
                    del self._pods[uid]
            for pod in items:
                self._pods[pod_ref(pod).uid] = pod
        for pod in items:
            self._pod_faults(pod, deleted=False, listed=True)

    def _pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod_ref(pod).uid
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
                self._deleted[uid] = pod
            else:
                self._pods[uid] = pod
        self._pod_faults(pod, deleted=kind == "DELETED")

    def _pod_faults(self, pod: dict[str, Any], *, deleted: bool, listed: bool = False) -> None:
        with self._lock:
            if pod_ref(pod).uid in self._ignored:
                return
        if deleted_by_us(pod):
            return
        now = self._clock()
        faults = exit_faults(pod, now, last=not listed)
        evicted = eviction_fault(pod, now)
        if evicted is not None:
            faults.append(evicted)
        if deleted and not faults:
            forced = force_delete_fault(pod, now)
            if forced is not None:
                faults.append(forced)
        for fault in faults:
            self._emit(fault)

    # --- nodes ---------------------------------------------------------------------------

    def _nodes_listed(self, items: list[dict[str, Any]]) -> None:
        listed = {str((n.get("metadata") or {}).get("name", "")) for n in items}
        with self._lock:
            # A re-list keeps when a node still NotReady was first seen so: its grace goes on.
            self._not_ready = {n: s for n, s in self._not_ready.items() if n in listed}
            self._nodes.clear()
        for node in items:
            self._node_event("ADDED", node)

    def _node_event(self, kind: str, node: dict[str, Any]) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        not_ready = kind != "DELETED" and is_not_ready(node)
        with self._lock:
            if kind == "DELETED":
                self._nodes.discard(name)
            else:
                self._nodes.add(name)
            if not_ready:
                self._not_ready.setdefault(name, self._clock())
            else:
                self._not_ready.pop(name, None)

    def _tick(self) -> None:
        while not self._stopping.wait(0.5):
            self.check_grace()

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
            for pod in self.pods_on(node):
                if terminated_phase(pod) or deleted_by_us(pod):
                    continue
                ref = pod_ref(pod)
                with self._lock:
                    if ref.uid in self._ignored:
                        continue
                # A fault about a pod is never older than the pod.
                created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
                self._emit(
                    Fault(
                        id=f"notready/{node}/{since.isoformat()}/{ref.uid}",
                        kind=FaultKind.NODE_NOT_READY,
                        node=node,
                        observed_at=max(since, created) if created else since,
                        pods=(ref,),
                        detail=f"not Ready since {since.isoformat()}",
                        source="restarter",
                    )
                )

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
