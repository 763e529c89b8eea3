"""Pods a controller owns, and pods that must not run twice, with the restarter on a real API
server and KWOK nodes (no controller manager here: the owners are inert objects the pods name).
An exit is a Job's to decide; a node fault deletes the pod as a disruption (DisruptionTarget set
first), which a Job's podFailurePolicy can ignore; the restarter's role may patch that
condition. A StatefulSet's pod on a cut-off node is deleted gracefully, never forced; under
`fence: Wait` a bare pod's replacement waits until the node is known gone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from k8s_test_helpers import KwokCluster, wait_for
from kubernetes import client, watch
from test_restarter import (  # fixtures too: pytest finds them among the module's names
    MakePolicy,
    controller,
    crd,
    job_status,
    labels,
    make_policy,
    objects,
    pod_or_none,
    restarter_rbac,
)

from edl_agent.faults.pod_faults import DISRUPTION_REASON
from edl_agent.restarter.adapters.nodes import OUT_OF_SERVICE_TAINT

__all__ = ["controller", "crd", "make_policy", "objects", "restarter_rbac"]


def owned_pod(k8s: KwokCluster, name: str, node: str, owner: str, *, kind: str) -> Any:
    """A pod bound to `node` that a Job or a ReplicaSet named `owner` (made here, inert: no
    controller runs) owns as its controller."""
    template = {
        "metadata": {"labels": {"owner": owner}},
        "spec": {
            "restartPolicy": "Never" if kind == "Job" else "Always",
            "containers": [{"name": "worker", "image": "registry.invalid/w:1"}],
        },
    }
    if kind == "Job":
        spec = {"suspend": True, "template": template}
        made = client.BatchV1Api(k8s.api).create_namespaced_job(
            k8s.namespace, {"metadata": {"name": owner}, "spec": spec}
        )
        api_version = "batch/v1"
    else:
        spec = {"replicas": 0, "selector": {"matchLabels": {"owner": owner}}, "template": template}
        apps = client.AppsV1Api(k8s.api)
        if kind == "StatefulSet":
            made = apps.create_namespaced_stateful_set(
                k8s.namespace, {"metadata": {"name": owner}, "spec": spec | {"serviceName": owner}}
            )
        else:
            made = apps.create_namespaced_replica_set(
                k8s.namespace, {"metadata": {"name": owner}, "spec": spec}
            )
        api_version = "apps/v1"
    reference = {
        "apiVersion": api_version,
        "kind": kind,
        "name": owner,
        "uid": made.metadata.uid,
        "controller": True,
    }
    managed = node.startswith("gpu-node")
    pod = k8s.create_pod(name, node=node, labels=labels(owner, "worker", 0), wait_running=managed)
    k8s.core.patch_namespaced_pod(
        name, k8s.namespace, {"metadata": {"ownerReferences": [reference]}}
    )
    return pod


def kubelet_reports_exit(k8s: KwokCluster, name: str, code: int) -> None:
    """Write the pod's status as kubelet does when its only container exits with `code` under
    restartPolicy Never (for a pod on a node KWOK does not manage: KWOK completes every pod a
    Job owns at once, so a Job's pod cannot fail there)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    terminated = {"exitCode": code, "reason": "Error", "startedAt": now, "finishedAt": now}
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "worker",
                "ready": False,
                "restartCount": 0,
                "image": "registry.invalid/w:1",
                "imageID": "",
                "state": {"terminated": terminated},
            }
        ],
    }
    k8s.core.patch_namespaced_pod_status(name, k8s.namespace, {"status": status})


def events_about(k8s: KwokCluster, name: str, reason: str) -> list[Any]:
    items = k8s.core.list_namespaced_event(k8s.namespace).items
    return [e for e in items if e.involved_object.name == name and e.reason == reason]


def test_a_job_owned_pods_exit_is_left_to_the_job_and_the_policy_is_warned(
    k8s: KwokCluster, make_policy: MakePolicy, objects: client.CustomObjectsApi
) -> None:
    make_policy(faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "129"}])
    name = "mnist-worker-0"
    owned_pod(k8s, name, k8s.unique_name("unmanaged-node"), "mnist", kind="Job")

    kubelet_reports_exit(k8s, name, 129)

    job = wait_for(
        "the decision in the policy's status",
        lambda: job_status(objects, k8s.namespace, "train"),
        lambda job: job is not None and job.get("lastActions"),
        timeout=10,
    )
    action = job["lastActions"][-1]
    assert action["action"] == "OwnerDecides"
    assert f"Job {k8s.namespace}/mnist owns the pod" in action["reason"]
    assert not job.get("restarts")
    (warning,) = wait_for(
        "the policy warned",
        lambda: events_about(k8s, "train", "OwnerDecidesExits"),
        lambda events: len(events) == 1,
        timeout=10,
    )
    assert warning.type == "Warning"
    assert "podFailurePolicy" in warning.message
    assert not events_about(k8s, "train", "Restarted")
    # The failed pod keeps its logs and exit code: nothing deleted it.
    assert k8s.read_pod(name).metadata.deletion_timestamp is None
    assert pod_or_none(k8s, f"{name}-r1") is None


def test_a_controller_owned_pod_on_a_dead_node_leaves_as_a_disruption(
    k8s: KwokCluster, make_policy: MakePolicy, objects: client.CustomObjectsApi
) -> None:
    make_policy(restartPolicy="OnNodeFail")
    node = k8s.create_gpu_node().metadata.name
    name = "mnist-worker-0"
    owned_pod(k8s, name, node, "mnist", kind="ReplicaSet")  # KWOK would complete a Job's
    since = k8s.read_pod(name).metadata.resource_version

    k8s.make_node_not_ready(node)

    seen: list[dict[str, Any]] = []
    for kind, pod in pod_states(k8s, name, since):
        seen.append(pod)
        if kind == "DELETED":
            break
    else:
        job = job_status(objects, k8s.namespace, "train")
        raise AssertionError(f"pod {name} was not deleted: {job}; seen {seen[-1:]}")
    conditions = [
        c for c in seen[-1]["status"].get("conditions") or [] if c["type"] == "DisruptionTarget"
    ]
    assert [(c["status"], c["reason"]) for c in conditions] == [("True", DISRUPTION_REASON)]
    assert "NodeNotReady" in conditions[0]["message"]
    assert node in conditions[0]["message"]
    # It was marked before it was deleted, and no replacement of ours: the Job makes it.
    first_marked = next(
        i for i, p in enumerate(seen) if any(
            c["type"] == "DisruptionTarget" for c in p["status"].get("conditions") or []
        )
    )  # fmt: skip
    assert all(p["metadata"].get("deletionTimestamp") is None for p in seen[:first_marked])
    assert pod_or_none(k8s, f"{name}-r1") is None
    job = job_status(objects, k8s.namespace, "train")
    assert job["lastActions"][-1]["fault"] == "NodeNotReady"
    # Its own condition is no eviction fault: one decision, no second.
    assert len(job["lastActions"]) == 1


def test_the_restarters_role_may_mark_a_pod_as_a_disruption(
    k8s: KwokCluster, restarter_rbac: None
) -> None:
    review = client.AuthorizationV1Api(k8s.api).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:{k8s.namespace}:edl-restarter",
                "resourceAttributes": {
                    "namespace": k8s.namespace,
                    "verb": "patch",
                    "resource": "pods",
                    "subresource": "status",
                },
            }
        }
    )
    assert review.status.allowed, review.status.reason


def test_a_statefulset_pod_on_a_cut_off_node_is_never_force_deleted(
    k8s: KwokCluster, make_policy: MakePolicy
) -> None:
    make_policy(restartPolicy="OnNodeFail")
    node = k8s.create_gpu_node().metadata.name
    name = "db-worker-0"
    owned_pod(k8s, name, node, "db", kind="StatefulSet")
    since = k8s.read_pod(name).metadata.resource_version

    k8s.make_node_not_ready(node)

    deleting = first_change(k8s, name, since, lambda pod: pod["metadata"].get("deletionTimestamp"))
    assert deleting["metadata"]["deletionGracePeriodSeconds"] > 0  # graceful: it waits for its node
    marks = [c for c in deleting["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert [c["reason"] for c in marks] == [DISRUPTION_REASON]
    (told,) = wait_for(
        "the pod's WaitingForNode event",
        lambda: events_about(k8s, name, "WaitingForNode"),
        lambda events: len(events) == 1,
        timeout=10,
    )
    assert "node.kubernetes.io/out-of-service" in told.message


def test_under_fence_wait_a_bare_pod_is_replaced_once_its_node_is_out_of_service(
    k8s: KwokCluster, make_policy: MakePolicy
) -> None:
    make_policy(restartPolicy="OnNodeFail", fence="Wait")
    node = k8s.create_gpu_node().metadata.name
    name = "bert-worker-0"
    k8s.create_pod(name, node=node, labels=labels("bert", "worker", 0))
    k8s.make_node_not_ready(node)
    wait_for(
        "the pod's WaitingForNode event",
        lambda: events_about(k8s, name, "WaitingForNode"),
        lambda events: len(events) == 1,
        timeout=15,
    )
    assert pod_or_none(k8s, f"{name}-r1") is None  # its decision is recorded, its pod waits
    assert k8s.read_pod(name).metadata.deletion_timestamp is None

    taint = {"key": OUT_OF_SERVICE_TAINT, "value": "nodeshutdown", "effect": "NoExecute"}
    k8s.core.patch_node(node, {"spec": {"taints": [taint]}})

    new = wait_for(f"pod {name}-r1", lambda: pod_or_none(k8s, f"{name}-r1"), bool, timeout=30)
    assert new.spec.node_name is None
    wait_for("the old pod gone", lambda: pod_or_none(k8s, name), lambda pod: pod is None, 15)


def first_change(
    k8s: KwokCluster, name: str, since: str, wanted: Callable[[dict[str, Any]], object]
) -> dict[str, Any]:
    """The first state of pod `name` after resourceVersion `since` for which `wanted` holds."""
    for _kind, pod in pod_states(k8s, name, since):
        if wanted(pod):
            return pod
    raise AssertionError(f"pod {name} never changed as waited for")


def pod_states(k8s: KwokCluster, name: str, since: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, pod) for each change of pod `name` after resourceVersion `since`, for 30 s."""
    stream = watch.Watch().stream(
        k8s.core.list_namespaced_pod,
        k8s.namespace,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=30,
    )
    for event in stream:
        yield event["type"], k8s.api.sanitize_for_serialization(event["object"])
