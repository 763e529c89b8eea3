"""kube-controller-manager beside the test platform (testcluster.start(controller_manager=True)):
its controllers act on a plane of their own, with KWOK nodes and real kubelets.

Each test asserts what only a controller does: no test here passes against the session's plane,
where nothing turns a Job into pods, a ResourceClaimTemplate into a claim, or a NotReady node
into a NoExecute taint and an eviction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import (
    FAKE_IMAGE,
    NOT_FOUND,
    POD_FAIL_EXIT_CODE,
    POD_FAIL_LABEL,
    KwokCluster,
    container_state,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.waiting import wait_for

RESOURCE_GROUP, RESOURCE_VERSION = "resource.k8s.io", "v1"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
StartNode = Callable[..., testnode.Node]


def _job(name: str, node: str, *, labels: dict[str, str], annotations: dict[str, str]) -> Any:
    """A Job of one pod bound to ``node`` (no scheduler runs), failed at its first failure."""
    return client.V1Job(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1JobSpec(
            backoff_limit=0,
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels, annotations=annotations),
                spec=client.V1PodSpec(
                    node_name=node,
                    restart_policy="Never",
                    containers=[client.V1Container(name="worker", image=FAKE_IMAGE)],
                ),
            ),
        ),
    )


def _job_pods(k8s: KwokCluster, job: str) -> list[Any]:
    return list(k8s.core.list_namespaced_pod(k8s.namespace, label_selector=f"job-name={job}").items)


def _condition(job: Any, kind: str) -> Any:
    for condition in (job.status and job.status.conditions) or []:
        if condition.type == kind and condition.status == "True":
            return condition
    return None


def _wait_job_failed(k8s: KwokCluster, name: str, timeout: float = 60.0) -> Any:
    batch = client.BatchV1Api(k8s.api)
    return wait_for(
        f"Job {k8s.namespace}/{name} to fail",
        lambda: batch.read_namespaced_job(name, k8s.namespace),
        lambda job: _condition(job, "Failed") is not None,
        timeout,
    )


def _assert_failed_at_backoff_limit(k8s: KwokCluster, job: Any, exit_code: int) -> None:
    failed = _condition(job, "Failed")
    assert failed.reason == "BackoffLimitExceeded"
    assert job.status.failed == 1
    assert not job.status.active
    # backoffLimit 0: the failed pod is the only one, made and owned by the Job controller.
    pods = _job_pods(k8s, job.metadata.name)
    assert len(pods) == 1
    owner = pods[0].metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "Job",
        job.metadata.name,
        job.metadata.uid,
        True,
    )
    assert container_state(pods[0]).terminated.exit_code == exit_code


def test_job_pod_is_created_and_its_failure_fails_the_job(k8s_managed: KwokCluster) -> None:
    node = k8s_managed.create_gpu_node().metadata.name
    name = k8s_managed.unique_name("job")
    # kwok runs the pod, then its chaos stage makes the container exit 3.
    body = _job(name, node, labels={POD_FAIL_LABEL: "true"}, annotations={POD_FAIL_EXIT_CODE: "3"})

    client.BatchV1Api(k8s_managed.api).create_namespaced_job(k8s_managed.namespace, body)

    _assert_failed_at_backoff_limit(k8s_managed, _wait_job_failed(k8s_managed, name), 3)


def test_claim_template_becomes_a_claim_of_the_pod_and_goes_with_it(
    k8s_managed: KwokCluster,
) -> None:
    custom = client.CustomObjectsApi(k8s_managed.api)
    namespace = k8s_managed.namespace
    template = k8s_managed.unique_name("gpu-template")
    custom.create_namespaced_custom_object(
        RESOURCE_GROUP,
        RESOURCE_VERSION,
        namespace,
        "resourceclaimtemplates",
        {
            "apiVersion": f"{RESOURCE_GROUP}/{RESOURCE_VERSION}",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": template},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}
                        ]
                    }
                }
            },
        },
    )
    pod_name = k8s_managed.unique_name("claimer")
    # No scheduler runs: the pod stays Pending, which is when the controller makes its claim.
    pod = k8s_managed.core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name},
            "spec": {
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                "containers": [
                    {
                        "name": "worker",
                        "image": FAKE_IMAGE,
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        },
    )

    named = wait_for(
        f"the claim of pod {namespace}/{pod_name} in its status",
        lambda: k8s_managed.read_pod(pod_name),
        lambda p: bool(p.status and p.status.resource_claim_statuses),
    )

    [entry] = named.status.resource_claim_statuses
    assert entry.name == "gpu"
    claim = custom.get_namespaced_custom_object(
        RESOURCE_GROUP, RESOURCE_VERSION, namespace, "resourceclaims", entry.resource_claim_name
    )
    [owner] = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "Pod",
        pod_name,
        pod.metadata.uid,
        True,
    )
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpu"
    assert claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == (
        "gpu.example.com"
    )

    k8s_managed.force_delete_pod(pod_name)

    def claim_exists() -> bool:
        try:
            custom.get_namespaced_custom_object(
                RESOURCE_GROUP,
                RESOURCE_VERSION,
                namespace,
                "resourceclaims",
                entry.resource_claim_name,
            )
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return False
            raise
        return True

    wait_for(
        f"claim {entry.resource_claim_name} to go with its pod",
        claim_exists,
        lambda exists: not exists,
    )


def test_not_ready_node_is_tainted_and_its_intolerant_pod_evicted(
    k8s_managed: KwokCluster,
) -> None:
    # A zone whose every node is NotReady puts the node lifecycle controller in its "full
    # disruption" mode, in which it taints and evicts nothing: one node stays Ready.
    k8s_managed.create_gpu_node()
    node = k8s_managed.create_gpu_node().metadata.name
    intolerant = k8s_managed.unique_name("intolerant")
    k8s_managed.core.create_namespaced_pod(
        k8s_managed.namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name=intolerant),
            spec=client.V1PodSpec(
                node_name=node,
                restart_policy="Never",
                containers=[client.V1Container(name="worker", image=FAKE_IMAGE)],
                # Without it the API server gives the pod 300 s of toleration.
                tolerations=[
                    client.V1Toleration(
                        key=NOT_READY_TAINT,
                        operator="Exists",
                        effect="NoExecute",
                        toleration_seconds=0,
                    )
                ],
            ),
        ),
    )
    k8s_managed.wait_pod_phase(intolerant, "Running")
    patient = k8s_managed.create_pod(node=node).metadata.name

    k8s_managed.make_node_not_ready(node)

    wait_for(
        f"node {node} to get the {NOT_READY_TAINT} taints, NoSchedule and NoExecute",
        lambda: k8s_managed.core.read_node(node),
        lambda n: (
            {t.effect for t in n.spec.taints or [] if t.key == NOT_READY_TAINT}
            == {"NoSchedule", "NoExecute"}
        ),
    )
    evictions = wait_for(
        f"the eviction of pod {intolerant}",
        lambda: (
            k8s_managed.core.list_namespaced_event(
                k8s_managed.namespace,
                field_selector=f"involvedObject.name={intolerant},reason=TaintManagerEviction",
            ).items
        ),
        bool,
    )
    assert "Marking for deletion" in evictions[0].message
    wait_for(
        f"pod {intolerant} to be gone",
        lambda: [
            p.metadata.name
            for p in k8s_managed.core.list_namespaced_pod(k8s_managed.namespace).items
        ],
        lambda names: intolerant not in names,
    )
    # The pod with the API server's default 300 s toleration stays for now.
    assert k8s_managed.read_pod(patient).metadata.deletion_timestamp is None

    k8s_managed.make_node_ready(node)

    wait_for(
        f"node {node} to lose its not-ready taints",
        lambda: k8s_managed.core.read_node(node),
        lambda n: not any(t.key == NOT_READY_TAINT for t in n.spec.taints or []),
    )


@pytest.mark.kubelet
def test_job_pod_on_a_real_kubelet_fails_the_job_with_its_exit_code(
    k8s_managed: KwokCluster, managed_kubelet_nodes: StartNode
) -> None:
    node = managed_kubelet_nodes()
    name = k8s_managed.unique_name("job")
    client.BatchV1Api(k8s_managed.api).create_namespaced_job(
        k8s_managed.namespace, _job(name, node.name, labels={}, annotations={})
    )
    [pod] = wait_for(
        f"the pod of Job {name} to run on kubelet {node.name}",
        lambda: _job_pods(k8s_managed, name),
        lambda pods: len(pods) == 1 and pods[0].status.phase == "Running",
    )

    node.exit_container(k8s_managed.namespace, pod.metadata.name, "worker", 3)

    _assert_failed_at_backoff_limit(k8s_managed, _wait_job_failed(k8s_managed, name), 3)


def test_plane_runs_the_controller_manager_with_its_own_credentials(
    k8s_managed_plane: testcluster.ControlPlane,
) -> None:
    assert sorted(k8s_managed_plane.pids) == sorted(testcluster.PROCESS_ORDER)
    kubeconfig = k8s_managed_plane.directory / f"{testcluster.CONTROLLER_MANAGER}.kubeconfig"
    assert "client-certificate" in kubeconfig.read_text()
    assert k8s_managed_plane.token not in kubeconfig.read_text()
