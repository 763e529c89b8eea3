"""The replacer: carries out a recorded Restart, replacing each of its pods at most once. A pod
already replaced is skipped, a replacement already made is found by its name (the port's
`replace` is idempotent), and each pod is replaced from a whole copy: the one its fault was seen
on, else read afresh, else (gone) its last state or recorded template. What fails stays recorded
in the policy's status and is carried out again later (`recorded.Recorded.check`)."""

from __future__ import annotations

import threading

import structlog

from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.faults.pod_faults import pod_ref
from edl_agent.kube_errors import ApiError
from edl_agent.restarter.metrics import RestarterMetrics
from edl_agent.restarter.pod_cache import is_whole
from edl_agent.restarter.port import ClusterPort, PodView
from edl_agent.restarter.status import PendingRestart
from edl_agent.restarter.templates import GoneTemplates

log = structlog.get_logger(__name__)


class Replacer:
    def __init__(
        self,
        *,
        port: ClusterPort,
        pods: PodView,
        templates: GoneTemplates,
        metrics: RestarterMetrics,
    ) -> None:
        self._port = port
        self._pods = pods
        self._templates = templates
        self._metrics = metrics
        self._lock = threading.Lock()
        self._replacing: set[tuple[str, str, str]] = set()  # (namespace, job, fault id)

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
            force = bool(node) and (
                pods.node_not_ready(node)
                or (pending.fault is FaultKind.NODE_NOT_READY and node == pending.node)
            )
            self._port.replace(
                pod,
                fault_kind=pending.fault,
                failed_node=pending.node,
                force=force,
                why=disruption_message(pending),
            )
        except ApiError as exc:
            self._metrics.replacement_errors.inc()
            log.error(
                "could not replace a pod; trying again later",
                pod=ref.name,
                fault_id=pending.fault_id,
                error=str(exc),
            )


def disruption_message(pending: PendingRestart) -> str:
    """What the DisruptionTarget condition of a deleted controller-owned pod says."""
    where = f" on node {pending.node}" if pending.node else ""
    return (
        f"deleted by edl-restarter for a fault: {pending.fault}{where} (fault {pending.fault_id}, "
        f"job {pending.job})"
    )
