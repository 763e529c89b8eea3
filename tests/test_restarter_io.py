"""The restarter's pure I/O helpers: node readiness and grace, the replacement pod. (Faults
read off pod objects: tests/test_pod_faults.py.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client

from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.restarter.adapters.nodes import is_not_ready
from edl_agent.restarter.adapters.watchers import DELETED_BY_ANNOTATION, RESTARTER, ClusterWatcher
from edl_agent.restarter.core.replacement import (
    AVOIDED_NODE_ANNOTATION,
    BASE_NAME_ANNOTATION,
    RESTART_COUNT_ANNOTATION,
    RESTART_COUNT_ENV,
    release_patch,
    replacement_pod,
)

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def pod(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "job-worker-3",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "42",
            "labels": {"job": "job"},
            "annotations": {"keep": "me"},
            "ownerReferences": [],
        },
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "trainer", "env": [{"name": "A", "value": "1"}]},
                {"name": "sidecar"},
            ],
            "ephemeralContainers": [{"name": "debug"}],
        },
        "status": {"phase": "Running", **status},
    }


def test_node_readiness() -> None:
    def node(status: str) -> dict[str, Any]:
        condition = {
            "type": "Ready",
            "status": status,
            "lastTransitionTime": "2026-05-01T11:00:00Z",
        }
        return {"status": {"conditions": [condition]}}

    assert not is_not_ready(node("True"))
    assert is_not_ready(node("Unknown"))
    assert is_not_ready(node("False"))
    assert not is_not_ready({"status": {}})


def test_a_node_s_grace_runs_on_the_restarter_s_clock_and_a_fault_is_never_older_than_its_pod() -> (
    None
):
    """KWOK dates Ready's last transition to the node's creation: a pod that landed on the node
    later, when the node then goes NotReady, gets a fault dated no earlier than itself (else the
    controller calls it stale and the pod stays on the dead node)."""
    clock = [NOW]
    faults: list[Any] = []
    watcher = ClusterWatcher(
        client.ApiClient(), on_fault=faults.append, node_grace=40.0, clock=lambda: clock[0]
    )

    def n1(status: str) -> dict[str, Any]:
        ready = {"type": "Ready", "status": status, "lastTransitionTime": "2026-01-01T00:00:00Z"}
        return {"metadata": {"name": "n1"}, "status": {"conditions": [ready]}}

    ready, down = n1("True"), n1("False")
    replacement = pod()
    replacement["metadata"]["creationTimestamp"] = "2026-05-01T11:59:00Z"
    watcher.nodes.listed([ready])
    watcher.pods_listed(None, [replacement])
    watcher.nodes.event("MODIFIED", down)  # seen NotReady at NOW
    clock[0] = NOW + timedelta(seconds=39)
    watcher.check_grace()
    assert faults == []  # the grace counts from when the restarter saw it, not from January
    watcher.nodes.listed([down])  # a re-list keeps that moment
    clock[0] = NOW + timedelta(seconds=40)
    watcher.check_grace()
    [fault] = faults
    assert fault.kind is FaultKind.NODE_NOT_READY
    assert fault.pods == (PodRef("ns", "job-worker-3", "u1"),)
    assert fault.observed_at == NOW
    assert fault.id == f"notready/n1/{NOW.isoformat()}/u1"

    late = pod()
    late["metadata"] |= {"uid": "u2", "creationTimestamp": "2026-05-01T12:00:30Z"}
    watcher.pod_event("ADDED", late)  # landed on the node after it went NotReady
    watcher.check_grace()
    assert faults[-1].pods[0].uid == "u2"
    assert faults[-1].observed_at == datetime(2026, 5, 1, 12, 0, 30, tzinfo=UTC)


def test_a_force_delete_is_seen_after_in_place_restarts() -> None:
    """A pod whose container kubelet restarted in place (an exit in `lastState`, already
    decided) and which is then force-deleted is gone for good: a PodForceDeleted fault."""
    faults: list[Any] = []
    watcher = ClusterWatcher(client.ApiClient(), on_fault=faults.append, clock=lambda: NOW)
    restarted = pod(
        containerStatuses=[
            {
                "name": "trainer",
                "restartCount": 1,
                "state": {"running": {"startedAt": "2026-05-01T11:59:30Z"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
            }
        ]
    )
    watcher.pods_listed(None, [restarted])
    assert [f.kind for f in faults] == [FaultKind.CONTAINER_EXIT]
    restarted["metadata"] |= {
        "deletionTimestamp": "2026-05-01T12:00:00Z",
        "deletionGracePeriodSeconds": 0,
    }
    watcher.pod_event("DELETED", restarted)
    assert [f.kind for f in faults[1:]] == [FaultKind.POD_FORCE_DELETED]


def test_a_force_delete_is_seen_while_a_finalizer_holds_the_pod() -> None:
    """A Job's pod carries the Job's tracking finalizer: force-deleted, it stays until the Job
    has counted it Failed. The fault is seen on the update that starts its deletion, while the
    pod still runs; the same fault (one id) again when it is gone. A graceful delete is none."""
    faults: list[Any] = []
    watcher = ClusterWatcher(client.ApiClient(), on_fault=faults.append, clock=lambda: NOW)
    held = pod()
    held["metadata"]["finalizers"] = ["batch.kubernetes.io/job-tracking"]
    watcher.pods_listed(None, [held])
    graceful = {
        **held,
        "metadata": held["metadata"]
        | {
            "resourceVersion": "43",
            "deletionTimestamp": "2026-05-01T12:00:30Z",
            "deletionGracePeriodSeconds": 30,
        },
    }
    watcher.pod_event("MODIFIED", graceful)
    assert faults == []
    forced = {
        **held,
        "metadata": held["metadata"]
        | {
            "resourceVersion": "44",
            "deletionTimestamp": "2026-05-01T12:00:00Z",
            "deletionGracePeriodSeconds": 0,
        },
    }
    watcher.pod_event("MODIFIED", forced)
    assert [f.kind for f in faults] == [FaultKind.POD_FORCE_DELETED]
    watcher.pod_event("DELETED", forced)
    assert {f.id for f in faults} == {faults[0].id}


def test_the_replacement_keeps_the_pod_and_drops_its_binding() -> None:
    old = pod()
    old["metadata"]["annotations"][DELETED_BY_ANNOTATION] = RESTARTER
    new = replacement_pod(old, avoid_node=None)
    meta = new["metadata"]
    assert meta["name"] == "job-worker-3-r1"
    assert meta["labels"] == {"job": "job"}
    assert meta["annotations"] == {
        "keep": "me",
        RESTART_COUNT_ANNOTATION: "1",
        BASE_NAME_ANNOTATION: "job-worker-3",
        "edl.io/replaces": "job-worker-3",
        "edl.io/replaces-uid": old["metadata"]["uid"],  # its end is ours, for every restarter
    }
    assert set(meta) == {"name", "labels", "annotations"}
    assert "nodeName" not in new["spec"]
    assert "ephemeralContainers" not in new["spec"]
    assert "status" not in new
    assert new["spec"]["containers"][0]["env"] == [
        {"name": "A", "value": "1"},
        {"name": RESTART_COUNT_ENV, "value": "1"},
    ]
    assert new["spec"]["containers"][1]["env"] == [{"name": RESTART_COUNT_ENV, "value": "1"}]
    assert "affinity" not in new["spec"]
    assert old["spec"]["nodeName"] == "n1"  # the input is not changed

    again = replacement_pod(
        {**new, "metadata": {**meta, "name": "job-worker-3-r1"}}, avoid_node="n2"
    )
    assert again["metadata"]["name"] == "job-worker-3-r2"
    assert again["spec"]["containers"][0]["env"][-1] == {"name": RESTART_COUNT_ENV, "value": "2"}
    terms = again["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}]}
    ]
    assert again["metadata"]["annotations"][AVOIDED_NODE_ANNOTATION] == "n2"
    # The last failed node only: in a pool of a few nodes, avoiding each one a predecessor
    # failed on would soon leave the job's replacement nowhere to run.
    third = replacement_pod(again, avoid_node="n3")
    (term,) = third["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["n3"]}]
    assert third["metadata"]["annotations"][AVOIDED_NODE_ANNOTATION] == "n3"
    assert replacement_pod(third, avoid_node="n3")["spec"]["affinity"] == third["spec"]["affinity"]
    # A replacement for a fault that names no node keeps avoiding the last failed one.
    exited = replacement_pod(third, avoid_node=None)
    assert exited["spec"]["affinity"] == third["spec"]["affinity"]
    assert exited["metadata"]["annotations"][AVOIDED_NODE_ANNOTATION] == "n3"


def test_a_pods_own_affinity_outlives_the_nodes_it_was_moved_off() -> None:
    old = pod()
    own = {"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    old["spec"]["affinity"] = {
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchFields": [own]}]
            }
        },
    }
    first = replacement_pod(old, avoid_node="n1")
    second = replacement_pod(first, avoid_node="n2")
    assert second["spec"]["affinity"]["nodeAffinity"] == {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [zone], "matchFields": [_not_on("n2")]},
                {"matchFields": [own, _not_on("n2")]},
            ]
        }
    }
    assert (
        second["spec"]["affinity"]["podAntiAffinity"] == old["spec"]["affinity"]["podAntiAffinity"]
    )
    # Avoiding a node the pod's own rule avoids already adds nothing, and nothing to forget.
    third = replacement_pod(second, avoid_node="n9")
    assert (
        _not_on("n2")
        not in third["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][1]["matchFields"]
    )
    # With no affinity of its own, a pod moved on twice has exactly the last requirement.
    bare = replacement_pod(replacement_pod(pod(), avoid_node="n1"), avoid_node="n2")
    assert bare["spec"]["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [_not_on("n2")]}]
            }
        }
    }


def _not_on(node: str) -> dict[str, Any]:
    return {"key": "metadata.name", "operator": "NotIn", "values": [node]}


def test_the_anti_affinity_is_added_to_every_existing_term() -> None:
    old = pod()
    terms = [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
    ]
    old["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
        }
    }
    new = replacement_pod(old, avoid_node="n1")
    got = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [t["matchExpressions"][0]["values"] for t in got] == [["a"], ["b"]]
    assert all(
        t["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}]
        for t in got
    )


def job_pod(*, owner: dict[str, Any] | None = None, **labels: str) -> dict[str, Any]:
    body = pod()
    body["metadata"]["labels"] = {"job-name": "mnist", **labels}
    body["metadata"]["ownerReferences"] = [
        owner
        or {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "mnist",
            "uid": "job-uid",
            "controller": True,
        }
    ]
    return body


def test_a_job_s_pod_is_released_by_the_labels_its_job_selects_it_by() -> None:
    patch = release_patch(
        job_pod(**{"batch.kubernetes.io/controller-uid": "job-uid", "controller-uid": "job-uid"})
    )
    assert patch == [
        {"op": "test", "path": "/metadata/uid", "value": "u1"},
        {"op": "remove", "path": "/metadata/labels/batch.kubernetes.io~1controller-uid"},
        {"op": "remove", "path": "/metadata/labels/controller-uid"},
    ]
    # Only the labels that hold its Job's uid; the job-name label (our policies group by it) stays.
    only_new = release_patch(job_pod(**{"batch.kubernetes.io/controller-uid": "job-uid"}))
    assert only_new is not None
    assert [op["path"] for op in only_new][1:] == [
        "/metadata/labels/batch.kubernetes.io~1controller-uid"
    ]


def test_what_is_not_a_job_s_pod_by_its_uid_labels_is_never_released() -> None:
    uid_labels = {"batch.kubernetes.io/controller-uid": "job-uid"}
    # A manual selector: the Job selects its pods by labels of the user's, not its uid.
    assert release_patch(job_pod(**{"batch.kubernetes.io/controller-uid": "other"})) is None
    assert release_patch(job_pod()) is None
    for owner in (
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": "s",
            "uid": "job-uid",
            "controller": True,
        },
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "r",
            "uid": "job-uid",
            "controller": True,
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "mnist",
            "uid": "job-uid",
        },  # not its controller
    ):
        assert release_patch(job_pod(owner=owner, **uid_labels)) is None, owner
    bare = pod()
    bare["metadata"]["labels"] = uid_labels
    assert release_patch(bare) is None
