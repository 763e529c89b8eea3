"""The replacer: carries out a recorded Restart, replacing each of its pods at most once. A pod
already replaced is skipped, a replacement already made is found by its name (the port's
`replace` is idempotent), and each pod is replaced from a whole copy: the one its fault was seen
on, else read afresh, else (gone) its last state or recorded template. What fails stays recorded
in the policy's status and is carried out again later (`recorded.Recorded.check`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.faults.pod_faults import controller_owned, pod_controller, pod_ref
from edl_agent.kube_errors import ApiError
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.pod_cache import is_whole
from edl_agent.restarter.core.policy import Fence
from edl_agent.restarter.core.port import ClusterPort, EvictionRefused, PodView
from edl_agent.restarter.core.status import PendingRestart
from edl_agent.restarter.core.templates import GoneTemplates
from edl_agent.runtime.bounded import BoundedSet

log = structlog.get_logger(__name__)

TOLD = 10_000
# (kind, reason, message, the object it is about)
Announce = Callable[[str, str, str, Mapping[str, str]], None]


class Replacer:
    def __init__(
        self,
        *,
        port: ClusterPort,
        pods: PodView,
        templates: GoneTemplates,
        metrics: RestarterMetrics,
        announce: Announce | None = None,
    ) -> None:
        """`announce(kind, reason, message, about)`: an Event for the operator about a pod that
        waits for its node."""
        self._port = port
        self._pods = pods
        self._templates = templates
        self._metrics = metrics
        self._lock = threading.Lock()
        self._replacing: set[tuple[str, str, str]] = set()  # (namespace, job, fault id)
        self._announce = announce
        self._told = BoundedSet(TOLD)  # pod uids whose wait for their node was told

    def busy(self, namespace: str, pending: PendingRestart) -> bool:
        """Whether that restart is being carried out right now."""
        with self._lock:
            return (namespace, pending.job, pending.fault_id) in self._replacing

    def replace_all(self, pending: PendingRestart, namespace: str) -> None:
        """Replace the pods of a recorded Restart (once at a time per restart)."""
        key = (namespace, pending.job, pending.fault_id)
        with self._lock:
            if key in self._replacing:
                return
            self._replacing.add(key)
        try:
            for ref in pending.pods:
                self._replace_one(pending, ref)
        finally:
            with self._lock:
                self._replacing.discard(key)

    def _fence_waits(self, pending: PendingRestart, ref: PodRef, node: str) -> None:
        with self._lock:
            first = self._told.add(ref.uid or f"{ref.namespace}/{ref.name}")
        if not first:
            return
        self._metrics.node_waits.inc()
        message = (
            f"pod {ref.namespace}/{ref.name} of job {pending.job} waits for node {node}: it is "
            "NotReady but not known gone, so its pod may still run; delete the Node or taint "
            "it node.kubernetes.io/out-of-service once it is down, and the pod is replaced"
        )
        log.warning("a pod waits for its node to be known gone", pod=ref.name, node=node)
        if self._announce is not None:
            about = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": ref.name,
                "namespace": ref.namespace,
            }
            if ref.uid:
                about["uid"] = ref.uid
            self._announce("Warning", "WaitingForNode", message, about)

    def _eviction_waits(self, pending: PendingRestart, ref: PodRef, why: str) -> None:
        """A graceful restart's eviction was refused (a PodDisruptionBudget): it is tried again
        with the recorded restarts; the operator is told once per pod."""
        self._metrics.evictions_refused.inc()
        with self._lock:
            first = self._told.add(f"evict/{ref.uid or ref.namespace + '/' + ref.name}")
        log.info("eviction refused; trying again later", pod=ref.name, reason=why)
        if not first or self._announce is None:
            return
        about = {"apiVersion": "v1", "kind": "Pod", "name": ref.name, "namespace": ref.namespace}
        if ref.uid:
            about["uid"] = ref.uid
        message = (
            f"pod {ref.namespace}/{ref.name} of job {pending.job} is to leave gracefully for "
            f"{pending.fault} (fault {pending.fault_id}), but its eviction was refused ({why}); "
            "tried again until a disruption budget allows it"
        )
        self._announce("Warning", "EvictionRefused", message, about)

    def _replace_one(self, pending: PendingRestart, ref: PodRef) -> None:
        pods = self._pods
        try:
            if pods.replaced(ref) and not pods.exists(ref):
                return  # an earlier try got as far as deleting it
            # The pod as the fault showed it saves a read; the delete is conditional on its
            # uid, and a replacement made already is found by its name.
            pod = pods.whole(ref) or self._port.read_pod(ref.namespace, ref.name)
            if pod is not None and not (ref.uid and pod_ref(pod).uid != ref.uid):
                deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
                if deleting and pods.replaced(ref):
                    return  # an earlier try got as far as deleting it
            else:
                if pods.replaced(ref):
                    return  # an earlier try finished
                # Gone, and not by our hand (force-deleted, evicted): replaced from its last
                # state as seen. A replacement made already is found by its name.
                pod = pods.find_pod(ref)
                if pod is None or (ref.uid and pod_ref(pod).uid != ref.uid) or not is_whole(pod):
                    template = pending.templates.get(ref.uid) or self._templates.get(ref.uid)
                    pod = None if template is None else dict(template)
                if pod is None:
                    log.info("a pod gone without a copy to replace it from", pod=ref.name)
                    return
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            force = (
                not pending.graceful
                and bool(node)
                and (
                    pods.node_not_ready(node)
                    or (pending.fault is FaultKind.NODE_NOT_READY and node == pending.node)
                )
            )
            fenced = force and must_wait(pod, pending) and not pods.node_gone(node)
            if fenced:
                if not controller_owned(pod):
                    self._fence_waits(pending, ref, node)
                    return  # looked at again with the recorded restarts, until the node is gone
                # Deleted gracefully and left to its controller: it stays Terminating while its
                # node is cut off, and its controller makes no second copy until the pod is gone
                # (Kubernetes' own garbage collection removes it once the node is deleted or out
                # of service).
                force = False
                self._fence_waits(pending, ref, node)
            self._port.replace(
                pod,
                fault_kind=pending.fault,
                failed_node=pending.node,
                force=force,
                why=disruption_message(pending),
                graceful=pending.graceful,
                release=not fenced,
            )
        except EvictionRefused as exc:
            self._eviction_waits(pending, ref, str(exc))
        except ApiError as exc:
            self._metrics.replacement_errors.inc()
            log.error(
                "could not replace a pod; trying again later",
                pod=ref.name,
                fault_id=pending.fault_id,
                error=str(exc),
            )


def must_wait(pod: Mapping[str, Any], pending: PendingRestart) -> bool:
    """Whether the pod may be replaced only once its NotReady node is known gone: a
    StatefulSet's pod always (two pods of one identity must never run), another by its policy's
    `fence: Wait`."""
    owner = pod_controller(pod)
    return (owner is not None and owner[0] == "StatefulSet") or pending.fence is Fence.WAIT


def disruption_message(pending: PendingRestart) -> str:
    """What the DisruptionTarget condition of a deleted controller-owned pod says."""
    where = f" on node {pending.node}" if pending.node else ""
    return (
        f"deleted by edl-restarter for a fault: {pending.fault}{where} (fault {pending.fault_id}, "
        f"job {pending.job})"
    )
