"""A Job's worker on a bad GPU, with the Job controller, real kubelets and real exit codes: the
restarter deletes it with DisruptionTarget set and takes it out of its Job's selector, so the
Job releases it and makes the next worker at once, counting no failure (left to the Job, the
deleted worker would be one more failed pod, replaced only after the Job's failure backoff, and
counted unless the Job's podFailurePolicy ignores disruptions). The same worker deleted plainly
fails the whole Job, which is what the condition is for. An exit of a Job's worker is the Job's
to count: the restarter leaves the pod (its logs, its exit code) alone.

kube-controller-manager (Job controller) on a plane of its own, one kubelet v1.37 node whose
runtime runs the pods' processes (a worker that SIGTERM ends exits 143, as a real one does), the
agent (simulated dgx-h100) and the restarter.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, wait_for
from kubelet_helpers import pod_devices
from kubernetes import client, watch
from scheduler import Process
from test_e2e import processes
from test_restarter import GROUP, PLURAL, VERSION
from test_training import policy_crd, start_restarter_and_agents

from edl_agent.faults.pod_faults import DISRUPTION_REASON
from edl_agent.sim import inject

__all__ = ["policy_crd", "processes"]

pytestmark = pytest.mark.kubelet

STEP = 90.0
XID = 95
APP = "mnist"
# Runs until SIGTERM, which ends it with 143 (128 + 15), as a trainer without a handler does.
WORKER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


def job_body(name: str, node: str) -> dict[str, Any]:
    """One worker with one GPU on `node`; backoffLimit 0, and the podFailurePolicy Kubernetes
    documents: a disruption is ignored, any other failure fails the Job."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                    {
                        "action": "FailJob",
                        "onExitCodes": {"operator": "NotIn", "values": [0]},
                    },
                ]
            },
            "template": {
                "metadata": {"labels": {"app": APP, "replica-type": "worker"}},
                "spec": {
                    "nodeName": node,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "worker",
                            "image": "registry.invalid/edl/worker:test",
                            "command": WORKER,
                            "resources": {"limits": {GPU_RESOURCE: "1"}},
                        }
                    ],
                },
            },
        },
    }


def policy(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": APP, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": APP}},
            "jobLabel": "job-name",
            "replicaTypeLabel": "replica-type",
            "faultTolerantPolicy": [
                {"exitCodes": "101", "restartPolicy": "ExitCode", "restartScope": "Pod"},
                {
                    "exceptionalEvent": "deviceUnhealthy",
                    "restartPolicy": "OnNodeFail",
                    "restartScope": "Pod",
                },
            ],
            "restartLimit": 10,
        },
    }


def job_pods(k8s: KwokCluster, job: str) -> list[Any]:
    return list(k8s.core.list_namespaced_pod(k8s.namespace, label_selector=f"job-name={job}").items)


def running_pod(k8s: KwokCluster, job: str, *, other_than: str = "") -> Any:
    pod: Any = wait_for(
        f"a Running pod of Job {job}" + (f" other than {other_than}" if other_than else ""),
        lambda: [p for p in job_pods(k8s, job) if p.metadata.uid != other_than],
        lambda pods: any(p.status.phase == "Running" for p in pods),
        timeout=STEP,
    )
    return next(p for p in pod if p.status.phase == "Running")


def job_condition(k8s: KwokCluster, job: str, kind: str) -> Any:
    read = client.BatchV1Api(k8s.api).read_namespaced_job(job, k8s.namespace)
    return next(
        (c for c in (read.status.conditions or []) if c.type == kind and c.status == "True"),
        None,
    )


@pytest.fixture
def scene(  # noqa: PLR0917 - fixtures
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    policy_crd: None,
    processes: list[Process],
    tmp_path: Path,
) -> tuple[KwokCluster, testnode.Node, Any]:
    node = managed_kubelet_nodes(exec_mode=True)
    _, agents = start_restarter_and_agents(
        k8s_managed, k8s_managed_plane, {node.name: node}, tmp_path, processes
    )
    objects = client.CustomObjectsApi(k8s_managed.api)
    objects.create_namespaced_custom_object(
        GROUP, VERSION, k8s_managed.namespace, PLURAL, policy(k8s_managed.namespace)
    )
    return k8s_managed, node, agents[node.name]


def test_a_job_worker_on_a_bad_gpu_is_replaced_by_its_job_which_goes_on(
    scene: tuple[KwokCluster, testnode.Node, Any],
) -> None:
    k8s, node, agent = scene
    client.BatchV1Api(k8s.api).create_namespaced_job(k8s.namespace, job_body("mnist", node.name))
    first = running_pod(k8s, "mnist")
    [gpu] = pod_devices(node, k8s.namespace, first.metadata.name)["worker"][GPU_RESOURCE]
    index = next(d["index"] for d in agent.devices() if d["id"] == gpu)

    inject.inject_xid(agent.tree, index, XID)

    second = running_pod(k8s, "mnist", other_than=first.metadata.uid)
    [gpu_now] = pod_devices(node, k8s.namespace, second.metadata.name)["worker"][GPU_RESOURCE]
    assert gpu_now != gpu, "the Job's new worker must not get the faulty GPU"
    assert job_condition(k8s, "mnist", "Failed") is None
    job = client.BatchV1Api(k8s.api).read_namespaced_job("mnist", k8s.namespace)
    assert not job.status.failed, "an ignored disruption is not counted as a failure"
    # The old worker went as a disruption and was released by its Job before it was gone: no
    # owner, no tracking finalizer, no uid label (left to the Job it would keep all three until
    # the Job had counted it and waited its backoff).
    versions = versions_until_gone(k8s, first)
    assert versions, "the old worker's updates since the fault"
    for pod in versions:
        reasons = [c.reason for c in pod.status.conditions or [] if c.type == "DisruptionTarget"]
        assert reasons in ([], [DISRUPTION_REASON])
    released = [
        pod
        for pod in versions
        if not pod.metadata.owner_references
        and "batch.kubernetes.io/job-tracking" not in (pod.metadata.finalizers or [])
        and "batch.kubernetes.io/controller-uid" not in (pod.metadata.labels or {})
    ]
    assert released, "the Job released the old worker"
    assert [
        c.reason for c in released[0].status.conditions or [] if c.type == "DisruptionTarget"
    ] == [DISRUPTION_REASON]


def versions_until_gone(k8s: KwokCluster, pod: Any) -> list[Any]:
    """Every version of `pod` the API server kept since `pod` was read, up to its deletion (a
    watch from its resourceVersion replays them all)."""
    seen = []
    stream = watch.Watch()
    for event in stream.stream(
        k8s.core.list_namespaced_pod,
        k8s.namespace,
        field_selector=f"metadata.name={pod.metadata.name}",
        resource_version=pod.metadata.resource_version,
        timeout_seconds=int(STEP),
    ):
        found = event["object"]
        if found.metadata.uid == pod.metadata.uid:
            seen.append(found)
        if event["type"] == "DELETED":
            break
    stream.stop()
    return seen


def test_the_same_worker_deleted_without_the_condition_fails_the_job(
    scene: tuple[KwokCluster, testnode.Node, Any],
) -> None:
    """The contrast: what a plain DELETE of the same worker does to the same Job."""
    k8s, node, _ = scene
    client.BatchV1Api(k8s.api).create_namespaced_job(k8s.namespace, job_body("plain", node.name))
    first = running_pod(k8s, "plain")
    k8s.core.delete_namespaced_pod(first.metadata.name, k8s.namespace)
    failed = wait_for(
        "Job plain Failed",
        lambda: job_condition(k8s, "plain", "Failed"),
        bool,
        timeout=STEP,
    )
    assert failed.reason == "PodFailurePolicy", failed


def test_a_job_worker_s_exit_is_left_to_the_job(
    scene: tuple[KwokCluster, testnode.Node, Any],
) -> None:
    """Exit 101 matches the policy's ExitCode rule, but the Job counts its pods' exits: it fails
    the Job by its own policy, and the restarter keeps the pod and its exit code for the
    operator (decision OwnerDecides)."""
    k8s, node, _ = scene
    client.BatchV1Api(k8s.api).create_namespaced_job(k8s.namespace, job_body("exits", node.name))
    first = running_pod(k8s, "exits")
    node.exit_container(k8s.namespace, first.metadata.name, "worker", 101)
    wait_for("Job exits Failed", lambda: job_condition(k8s, "exits", "Failed"), bool, STEP)
    objects = client.CustomObjectsApi(k8s.api)
    status = wait_for(
        "the restarter's decision in the policy's status",
        lambda: objects.get_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, APP),
        lambda body: any(
            a.get("action") == "OwnerDecides"
            for job in (body.get("status") or {}).get("jobs") or []
            for a in job.get("lastActions") or []
        ),
        timeout=STEP,
    )
    assert (status.get("status") or {}).get("restarts", 0) == 0
    pod = k8s.read_pod(first.metadata.name)
    assert pod.metadata.deletion_timestamp is None
    [container] = pod.status.container_statuses
    assert container.state.terminated.exit_code == 101
