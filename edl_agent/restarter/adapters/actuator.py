"""What the restarter does to the cluster: write a policy's status, replace pods.

Order matters (see `decide`): the controller persists a decision's record through `write_status`
(a PUT of the status subresource carrying the resourceVersion it read, so a concurrent writer
makes it fail with `Conflict` and the caller re-reads and decides again) and only then calls
`replace`. A bare pod is created again under a new name, `<base>-r<count>`, and then deleted
(grace 0 when its node is gone). The replacement has the same labels (but those on the drop
list, `replacement.drop_labels`: what controllers stamp on one specific pod), annotations and
spec without the node binding, the restart count in annotation `edl.io/restart-count` and env
`EDL_RESTART_COUNT` of every container, and for node and device faults a required node
affinity away from the failed node. The name depends only on the count, so a retried
replacement finds its pod already there (AlreadyExists) instead of making a second. A pod a
controller owns (a Job, a StatefulSet) is only deleted: its controller makes the replacement.
A Job's pod is then also taken out of its Job's selector (`release`): the Job releases it and
makes the next pod at once, where it would otherwise wait for the pod to end and for its failure
backoff (10 s and more), and count a failure; not while the pod waits for its cut-off node.

A graceful restart (a Graceful rule) evicts the pod through the Eviction API instead of deleting
it: its own termination grace applies, PodDisruptionBudgets hold (a refusal, 429, is
`EvictionRefused` and nothing else is done), and the API server sets DisruptionTarget itself. A
bare pod's replacement is created only once its eviction was accepted, so a refused eviction
leaves no second copy running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client

from edl_agent.faults.model import FaultKind
from edl_agent.faults.pod_faults import DISRUPTION_REASON, controller_owned
from edl_agent.kube import CONFLICT, NOT_FOUND, ApiError
from edl_agent.kube import call_json as _call
from edl_agent.kube_time import format_time
from edl_agent.restarter.core.port import Conflict, EvictionRefused, Replacement
from edl_agent.restarter.core.replacement import (
    BASE_NAME_ANNOTATION,
    NODE_FAULTS,
    REPLACES_ANNOTATION,
    REPLACES_UID_ANNOTATION,
    RESTART_COUNT_ANNOTATION,
    RESTART_COUNT_ENV,
    release_patch,
    replacement_pod,
)
from edl_agent.restarter.core.settings import DEFAULT_DROP_LABELS

UNPROCESSABLE = 422
MESSAGE_LIMIT = 1024
# The names of a replacement, as the tests and deployments know them from here.
__all__ = [
    "BASE_NAME_ANNOTATION",
    "REPLACES_ANNOTATION",
    "REPLACES_UID_ANNOTATION",
    "RESTART_COUNT_ANNOTATION",
    "RESTART_COUNT_ENV",
    "Actuator",
    "replacement_pod",
]

log = structlog.get_logger(__name__)

GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
ALREADY_EXISTS = 409
TOO_MANY_REQUESTS = 429  # the Eviction API's answer when a disruption budget allows none


class Actuator:
    def __init__(
        self,
        api: client.ApiClient,
        *,
        before_delete: Callable[[str], None] = lambda _uid: None,
        drop_labels: Iterable[str] | None = None,
        on_write: Callable[[str], None] = lambda _what: None,
    ) -> None:
        """`before_delete(uid)` runs before each deletion (the watcher's `ignore_uid`);
        `drop_labels`: the labels replacements do not get (None: `DEFAULT_DROP_LABELS`);
        `on_write(what)` counts each write (`status`, `create`, `disruption`, `delete`,
        `evict`, `release`)."""
        self._on_write = on_write
        self._core: Any = client.CoreV1Api(api)
        self._objects: Any = client.CustomObjectsApi(api)
        self._before_delete = before_delete
        self._drop_labels = tuple(DEFAULT_DROP_LABELS if drop_labels is None else drop_labels)

    # --- policies ------------------------------------------------------------------------

    def read_policy(self, namespace: str, name: str) -> dict[str, Any]:
        return _call(
            self._objects.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
        )

    def write_status(self, policy: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the status of `policy` (as read); `Conflict` when it changed since."""
        meta = policy["metadata"]
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FaultTolerancePolicy",
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "resourceVersion": meta["resourceVersion"],
            },
            "spec": policy.get("spec", {}),
            "status": dict(status),
        }
        self._on_write("status")
        try:
            return _call(
                self._objects.replace_namespaced_custom_object_status,
                GROUP,
                VERSION,
                meta["namespace"],
                PLURAL,
                meta["name"],
                body,
            )
        except ApiError as exc:
            if exc.status == CONFLICT:
                raise Conflict(str(exc)) from None
            raise

    # --- pods ----------------------------------------------------------------------------

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        data = _call(self._core.list_namespaced_pod, namespace, label_selector=selector)
        return list(data.get("items") or [])

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _call(self._core.read_namespaced_pod, name, namespace)
        except ApiError as exc:
            if exc.status == NOT_FOUND:
                return None
            raise

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
        """Create the replacement of `pod` (unless a controller owns it), then delete `pod`.

        Creating first means that whenever this stops half way, `pod` is still there to be
        replaced again, and doing so finds the replacement made already. `graceful`: evict
        `pod` first (see the module). `release`: a Job's pod, once deleted or evicted, is also
        taken out of its Job's selector, so the Job replaces it at once (`release_patch`)."""
        meta = pod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        if graceful:
            self.evict(pod)
            if controller_owned(pod):
                if release:
                    self.release(pod)
                log.info("evicted a controller-owned pod", pod=f"{namespace}/{name}")
                return Replacement(name, None, False)
        elif controller_owned(pod):
            # An exit is the pod's own failure, not a disruption: the pod ended already.
            exited = fault_kind is FaultKind.CONTAINER_EXIT
            self.delete(pod, force=force, disruption=None if exited else why or str(fault_kind))
            if release and not exited:
                self.release(pod)
            log.info("deleted a controller-owned pod", pod=f"{namespace}/{name}", force=force)
            return Replacement(name, None, force)
        avoid = failed_node if fault_kind in NODE_FAULTS and failed_node else None
        body = replacement_pod(pod, avoid_node=avoid, drop_labels=self._drop_labels)
        new_name = body["metadata"]["name"]
        self._on_write("create")
        try:
            _call(self._core.create_namespaced_pod, namespace, body)
        except ApiError as exc:
            if exc.status != ALREADY_EXISTS:
                raise
            log.info("replacement exists already", pod=f"{namespace}/{new_name}")
        # No deletion mark: the replacement names this pod's uid, which tells any restarter
        # that its end is ours (one write fewer per restart).
        if not graceful:
            self.delete(pod, force=force)
        log.info(
            "pod replaced", old=f"{namespace}/{name}", new=f"{namespace}/{new_name}", force=force
        )
        return Replacement(name, new_name, force)

    def delete(self, pod: Mapping[str, Any], *, force: bool, disruption: str | None = None) -> None:
        """Delete `pod` if it is still the pod of that uid. With `disruption` (why), first set
        its DisruptionTarget condition, as Kubernetes' own controllers do before they delete a
        pod: its owner (a Job's podFailurePolicy) then knows the pod failed for a disruption,
        not on its own, and the restarter's watchers know the deletion for ours."""
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        self._before_delete(uid)
        try:
            if disruption is not None:
                self._on_write("disruption")
                _call(
                    self._core.patch_namespaced_pod_status,
                    name,
                    namespace,
                    disruption_patch(uid, disruption, now=datetime.now(UTC)),
                    _content_type="application/strategic-merge-patch+json",
                )
            body = client.V1DeleteOptions(
                grace_period_seconds=0 if force else None,
                preconditions=client.V1Preconditions(uid=uid) if uid else None,
            )
            self._on_write("delete")
            _call(self._core.delete_namespaced_pod, name, namespace, body=body)
        except ApiError as exc:
            # Gone, or another pod by that name: the delete's uid precondition answers 409, the
            # status patch's uid (immutable) 422.
            if exc.status not in (NOT_FOUND, CONFLICT, UNPROCESSABLE):
                raise
            log.info("pod already gone or replaced; left alone", pod=f"{namespace}/{name}", uid=uid)

    def release(self, pod: Mapping[str, Any]) -> None:
        """Take a Job's pod (deleted or evicted already) out of its Job's selector; nothing for
        a pod no Job owns by its uid labels, or one gone or replaced meanwhile."""
        patch = release_patch(pod)
        if patch is None:
            return
        meta = pod["metadata"]
        self._on_write("release")
        try:
            _call(
                self._core.patch_namespaced_pod,
                meta["name"],
                meta["namespace"],
                patch,
                _content_type="application/json-patch+json",
            )
        except ApiError as exc:
            # Gone (404), another pod by that name (the uid test: 422), or the labels removed
            # already (422): the Job has what it needs either way.
            if exc.status not in (NOT_FOUND, CONFLICT, UNPROCESSABLE):
                raise
            log.info("pod not released: gone or released already", pod=meta["name"])
        else:
            log.info("released a Job's pod for its Job to replace", pod=meta["name"])

    def evict(self, pod: Mapping[str, Any]) -> None:
        """Evict `pod` if it is still the pod of that uid, with its own grace period;
        `EvictionRefused` when a disruption budget allows none now."""
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        self._before_delete(uid)
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=uid) if uid else None
            ),
        )
        self._on_write("evict")
        try:
            _call(self._core.create_namespaced_pod_eviction, name, namespace, body)
        except ApiError as exc:
            if exc.status == TOO_MANY_REQUESTS:
                raise EvictionRefused(str(exc)) from None
            if exc.status not in (NOT_FOUND, CONFLICT):
                raise
            log.info("pod already gone or replaced; left alone", pod=f"{namespace}/{name}", uid=uid)


def disruption_patch(uid: str, why: str, *, now: datetime) -> dict[str, Any]:
    """A strategic merge patch of pods/status setting DisruptionTarget=True (conditions merge
    by type). The uid makes it conditional: a pod that reuses the name is never touched."""
    condition = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": DISRUPTION_REASON,
        "message": why[:MESSAGE_LIMIT],
        "lastTransitionTime": format_time(now),
    }
    patch: dict[str, Any] = {"status": {"conditions": [condition]}}
    if uid:
        patch["metadata"] = {"uid": uid}
    return patch
