"""What a pod object says about faults: pure functions shared by the node agent and the
restarter's watcher, so that both derive the same faults, with the same ids, from the same pod.

  container terminated with a non-zero code   ContainerExit    `container_exit_faults`
  status.reason Evicted, or DisruptionTarget  PodEvicted       `eviction_fault`
  deleted with grace 0 before it terminated   PodForceDeleted  `force_deletion_fault`
  a node-level fault (NotReady, a device)     one per pod      `per_pod_faults`

Container exits are read from init and regular containers, never from ephemeral ones (a
`kubectl debug` shell that exits non-zero says nothing about the workload), from both `state`
and `lastState`: after kubelet restarted a container in place, `lastState` and `restartCount`
are all that is left of the exit. A fault about a pod is never dated before the pod was created.
`source` is who observed it (`agent`, `restarter`); the ids come from `faults.ids`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from edl_agent.faults.ids import container_exit_id, eviction_id, force_deletion_id, pod_fault_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.kube_time import parse_time

MAX_DETAIL = 512
# Not `ephemeralContainerStatuses`: see the module's docstring.
STATUS_LISTS = ("initContainerStatuses", "containerStatuses")

# The reason of the DisruptionTarget condition the restarter sets on a pod it deletes for a fault
# (as Kubernetes' own controllers name theirs: DeletionByTaintManager, DeletionByPodGC, ...).
DISRUPTION_REASON = "DeletionByEdlRestarter"


def pod_ref(pod: Mapping[str, Any]) -> PodRef:
    meta = pod.get("metadata") or {}
    return PodRef(
        str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))
    )


def pod_node(pod: Mapping[str, Any]) -> str:
    """The node the pod is bound to; "" while it is not bound."""
    return str((pod.get("spec") or {}).get("nodeName") or "")


def controller_owned(pod: Mapping[str, Any]) -> bool:
    """A controller (a Job, a ReplicaSet, a StatefulSet) owns the pod and makes its successor."""
    return pod_controller(pod) is not None


def pod_controller(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the controller that owns the pod; None for a bare pod."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), None)
    if ref is None:
        return None
    return str(ref.get("kind") or ""), str(ref.get("name") or "")


def exit_counting_owner(pod: Mapping[str, Any]) -> str | None:
    """The controller that decides about the pod's exits itself ("Job <namespace>/<name>"):
    the Job controller counts every failed pod against its backoffLimit and podFailurePolicy
    and makes the next pod; None when no such controller owns the pod."""
    owner = pod_controller(pod)
    if owner is None or owner[0] != "Job":
        return None
    namespace = (pod.get("metadata") or {}).get("namespace") or ""
    return f"Job {namespace}/{owner[1]}"


def pod_created(pod: Mapping[str, Any]) -> datetime | None:
    return parse_time((pod.get("metadata") or {}).get("creationTimestamp"))


def terminated_phase(pod: Mapping[str, Any]) -> bool:
    """The pod has finished for good (Succeeded or Failed): kubelet runs nothing of it again."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def container_statuses(pod: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    """The statuses of the pod's init and regular containers (not its ephemeral ones)."""
    status = pod.get("status") or {}
    for key in STATUS_LISTS:
        yield from status.get(key) or ()


def container_exit_faults(pod: Mapping[str, Any], *, now: datetime, source: str) -> list[Fault]:
    """A fault for each non-zero termination in the pod's container statuses, current
    (`state`, numbered `restartCount`) and previous (`lastState`, numbered `restartCount - 1`),
    dated by `finishedAt` (else `now`)."""
    ref = pod_ref(pod)
    node = pod_node(pod)
    faults = []
    for container in container_statuses(pod):
        name = str(container.get("name", ""))
        restarts = int(container.get("restartCount") or 0)
        for which, number in (("state", restarts), ("lastState", restarts - 1)):
            terminated = (container.get(which) or {}).get("terminated")
            if not terminated or number < 0:  # number < 0: a status no kubelet writes
                continue
            exit_code = int(terminated.get("exitCode") or 0)
            if exit_code == 0:
                continue
            faults.append(
                Fault(
                    id=container_exit_id(ref.uid, name, number),
                    kind=FaultKind.CONTAINER_EXIT,
                    node=node,
                    observed_at=parse_time(terminated.get("finishedAt")) or now,
                    pods=(ref,),
                    container=name,
                    exit_code=exit_code,
                    reason=str(terminated.get("reason") or "Error"),
                    detail=str(terminated.get("message") or "")[:MAX_DETAIL],
                    source=source,
                )
            )
    return faults


def eviction_fault(pod: Mapping[str, Any], *, now: datetime, source: str) -> Fault | None:
    """The pod's eviction (`status.reason` Evicted) or disruption (condition DisruptionTarget
    True, dated by its transition); None when it shows neither."""
    status = pod.get("status") or {}
    disruption: Mapping[str, Any] = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        {},
    )
    if status.get("reason") != "Evicted" and (
        not disruption or disruption.get("reason") == DISRUPTION_REASON
    ):
        return None  # nothing, or the restarter's own deletion for a fault it has handled
    ref = pod_ref(pod)
    return Fault(
        id=eviction_id(ref.uid),
        kind=FaultKind.POD_EVICTED,
        node=pod_node(pod),
        observed_at=parse_time(disruption.get("lastTransitionTime")) or now,
        pods=(ref,),
        reason=str(disruption.get("reason") or status.get("reason") or "Evicted"),
        detail=str(disruption.get("message") or status.get("message") or "")[:MAX_DETAIL],
        source=source,
    )


def force_deletion_fault(pod: Mapping[str, Any], *, now: datetime, source: str) -> Fault | None:
    """The pod was deleted with grace 0 (`kubectl delete --force`) while a node ran it; None
    when it was not. A pod no node was given is deleted with grace 0 whatever was asked (the
    API server does that itself: nothing runs it to stop gracefully), so an operator's graceful
    delete of a Pending pod is no force deletion."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionGracePeriodSeconds") != 0 or terminated_phase(pod) or not pod_node(pod):
        return None
    ref = pod_ref(pod)
    return Fault(
        id=force_deletion_id(ref.uid),
        kind=FaultKind.POD_FORCE_DELETED,
        node=pod_node(pod),
        observed_at=now,
        pods=(ref,),
        source=source,
    )


def per_pod_faults(node_fault: Fault, pods: Iterable[Mapping[str, Any]]) -> list[Fault]:
    """What the node-level `node_fault` (a node NotReady since `observed_at`, a device unhealthy
    since then; its `pods` ignored) means for each of `pods`: a copy naming that pod alone, its
    id `pod_fault_id(node_fault.id, pod)`, dated `observed_at` or, for a pod created after
    that, the pod's creation (a fault about a pod is never older than the pod). A pod known only
    by its namespace and name (no uid, no creationTimestamp) is named and dated as such."""
    faults = []
    for pod in pods:
        ref = pod_ref(pod)
        created = pod_created(pod)
        since = node_fault.observed_at
        faults.append(
            dataclasses.replace(
                node_fault,
                id=pod_fault_id(node_fault.id, ref),
                observed_at=max(since, created) if created is not None else since,
                pods=(ref,),
            )
        )
    return faults
