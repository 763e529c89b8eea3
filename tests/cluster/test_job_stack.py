"""JobSet's controller and Kueue's manager on a control plane with kube-controller-manager
(tests/cluster/jobstack.py), their webhooks served through the real API server: a JobSet is
defaulted by JobSet's webhook and made into its Job and pods; a JobSet naming a queue is held
suspended until Kueue admits it, and one over the queue's quota waits until quota frees up.

What the training stack does with our faults (a worker replaced without a gang restart, no
quota counted twice): tests/cluster/test_training_jobset.py, on real kubelets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jobstack
import pytest
import testcluster
from k8s_test_helpers import GPU_RESOURCE, KwokCluster
from kubernetes import client
from scheduler import ProcessError

from tests.waiting import wait_for

JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
QUEUE = "gpus"
QUOTA = 3
STEP = 60.0


@pytest.fixture(scope="module")
def stack(
    k8s_managed_plane: testcluster.ControlPlane,
    k8s_managed_api_client: client.ApiClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    try:
        started = jobstack.start_stack(
            k8s_managed_plane, k8s_managed_api_client, tmp_path_factory.mktemp("job-stack")
        )
    except ProcessError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield
    jobstack.stop_stack(started)


def jobset(name: str, *, workers: int, queue: str | None = None) -> dict[str, Any]:
    """One replicated job of `workers` indexed pods with a GPU each (on no node: nothing here
    runs them)."""
    labels = {} if queue is None else {jobstack.QUEUE_LABEL: queue}
    gpu = {GPU_RESOURCE: "1"}
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "worker",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": workers,
                            "completions": workers,
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [
                                        {
                                            "name": "trainer",
                                            "image": "registry.invalid/edl/trainer:test",
                                            "resources": {"requests": gpu, "limits": gpu},
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ]
        },
    }


def read_jobset(k8s: KwokCluster, name: str) -> dict[str, Any]:
    found: dict[str, Any] = client.CustomObjectsApi(k8s.api).get_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, k8s.namespace, "jobsets", name
    )
    return found


def create_jobset(k8s: KwokCluster, body: dict[str, Any]) -> None:
    client.CustomObjectsApi(k8s.api).create_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, k8s.namespace, "jobsets", body
    )


def delete_jobsets(k8s: KwokCluster, *names: str) -> None:
    """Delete these JobSets (their Jobs and pods in the background); one already gone is fine."""
    objects = client.CustomObjectsApi(k8s.api)
    for name in names:
        with contextlib.suppress(client.ApiException):
            objects.delete_namespaced_custom_object(
                JOBSET_GROUP,
                JOBSET_VERSION,
                k8s.namespace,
                "jobsets",
                name,
                propagation_policy="Background",
            )


def jobs_of(k8s: KwokCluster, name: str) -> list[Any]:
    return list(
        client.BatchV1Api(k8s.api)
        .list_namespaced_job(k8s.namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")
        .items
    )


def test_a_jobset_is_defaulted_by_its_webhook_and_made_into_its_job_and_pods(
    stack: None, k8s_managed: KwokCluster
) -> None:
    k8s = k8s_managed
    create_jobset(k8s, jobset("plain", workers=2))
    body = read_jobset(k8s, "plain")
    # Set by JobSet's mutating webhook (the CRD has no such default): its Jobs are Indexed.
    template = body["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert template.get("completionMode") == "Indexed", template
    [job] = wait_for("the JobSet's Job", lambda: jobs_of(k8s, "plain"), bool, STEP)
    assert job.metadata.name == "plain-worker-0"
    pods = wait_for(
        "the Job's two pods",
        lambda: (
            k8s.core.list_namespaced_pod(
                k8s.namespace, label_selector="jobset.sigs.k8s.io/jobset-name=plain"
            ).items
        ),
        lambda found: len(found) == 2,
        STEP,
    )
    indexes = sorted(p.metadata.labels["batch.kubernetes.io/job-completion-index"] for p in pods)
    assert indexes == ["0", "1"]


def test_kueue_admits_a_jobset_within_quota_and_holds_the_one_over_it(
    stack: None, k8s_managed: KwokCluster
) -> None:
    k8s = k8s_managed
    jobstack.gpu_queue(k8s.api, k8s.namespace, QUEUE, QUOTA, GPU_RESOURCE)
    try:
        create_jobset(k8s, jobset("first", workers=QUOTA, queue=QUEUE))
        wait_for(
            "the first JobSet admitted (running, its Job made)",
            lambda: (read_jobset(k8s, "first")["spec"].get("suspend"), jobs_of(k8s, "first")),
            lambda found: found[0] is False and bool(found[1]),
            STEP,
        )
        create_jobset(k8s, jobset("second", workers=QUOTA, queue=QUEUE))
        usage = wait_for(
            "the second JobSet pending in the queue",
            lambda: jobstack.queue_usage(k8s.api, QUEUE, GPU_RESOURCE),
            lambda found: found["pendingWorkloads"] == 1,
            STEP,
        )
        assert usage["flavorsReservation"] == QUOTA, usage
        assert usage["admittedWorkloads"] == 1, usage
        assert read_jobset(k8s, "second")["spec"].get("suspend") is True
        assert not jobs_of(k8s, "second") or all(j.spec.suspend for j in jobs_of(k8s, "second"))

        # Quota freed: the waiting one goes.
        client.CustomObjectsApi(k8s.api).delete_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, k8s.namespace, "jobsets", "first"
        )
        wait_for(
            "the second JobSet admitted once the first is gone",
            lambda: read_jobset(k8s, "second")["spec"].get("suspend"),
            lambda suspend: suspend is False,
            STEP,
        )
    finally:
        delete_jobsets(k8s, "first", "second")
        jobstack.remove_queue(k8s.api, QUEUE)
