"""The restarter's slim pods: every answer the restarter draws from a pod is the same from the
slim copy as from the pod the API sent, at a fraction of the size."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from edl_agent.faults.in_place import restarts_in_place
from edl_agent.faults.pod_faults import (
    container_exit_faults,
    eviction_fault,
    exit_counting_owner,
    force_deletion_fault,
    pod_created,
    pod_node,
    pod_ref,
)
from edl_agent.restarter.core.pod_cache import slim_pod

NOW = datetime(2026, 11, 24, tzinfo=UTC)


def big_pod(**overrides: Any) -> dict[str, Any]:
    container = {
        "name": "trainer",
        "image": "registry.example/train:1" * 4,
        "command": ["python", "-m", "train", *[f"--flag-{i}" for i in range(40)]],
        "env": [{"name": f"VAR_{i}", "value": "x" * 40} for i in range(60)],
        "resources": {"limits": {"nvidia.com/gpu": "8"}},
        "volumeMounts": [{"name": f"v{i}", "mountPath": f"/mnt/{i}"} for i in range(10)],
        "restartPolicy": "Never",
        "restartPolicyRules": [
            {"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}
        ],
    }
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llm-worker-3",
            "namespace": "train",
            "uid": "u-3",
            "resourceVersion": "77",
            "creationTimestamp": "2026-11-23T10:00:00Z",
            "deletionTimestamp": "2026-11-24T00:00:00Z",
            "deletionGracePeriodSeconds": 0,
            "labels": {"app": "train", "edl.test/job": "llm"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{" + "x" * 4000 + "}",
                "edl.io/restart-count": "2",
                "edl.io/replaces-uid": "u-1",
            },
            "ownerReferences": [{"kind": "Job", "name": "j", "uid": "o", "controller": True}],
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {"x": {}}}}] * 5,
        },
        "spec": {
            "nodeName": "gpu-7",
            "restartPolicy": "OnFailure",
            "containers": [container],
            "initContainers": [{**container, "name": "setup", "restartPolicy": "Always"}],
            "ephemeralContainers": [{"name": "debugger", "image": "busybox"}],
            "volumes": [{"name": f"v{i}", "emptyDir": {}} for i in range(10)],
        },
        "status": {
            "phase": "Running",
            "reason": "Evicted",
            "message": "the node was low on memory",
            "conditions": [
                {"type": "Ready", "status": "False"},
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "lastTransitionTime": "2026-11-24T00:00:01Z",
                },
            ],
            "containerStatuses": [
                {
                    "name": "trainer",
                    "image": "registry.example/train:1",
                    "imageID": "sha256:" + "f" * 64,
                    "containerID": "containerd://" + "a" * 64,
                    "restartCount": 3,
                    "state": {
                        "terminated": {"exitCode": 137, "finishedAt": "2026-11-24T00:00:02Z"}
                    },
                    "lastState": {
                        "terminated": {
                            "exitCode": 42,
                            "reason": "Error",
                            "finishedAt": "2026-11-24T00:00:00Z",
                            "message": "m" * 2000,
                        }
                    },
                }
            ],
            "initContainerStatuses": [
                {"name": "setup", "restartCount": 0, "state": {"running": {"startedAt": "x"}}}
            ],
            "ephemeralContainerStatuses": [{"name": "debugger", "restartCount": 0}],
        },
    }
    pod.update(overrides)
    return pod


@pytest.mark.parametrize("phase", ["Running", "Failed"])
def test_a_slim_pod_gives_every_answer_the_full_pod_gives(phase: str) -> None:
    full = big_pod()
    full["status"]["phase"] = phase
    slim = slim_pod(full)
    assert container_exit_faults(slim, now=NOW, source="x") == container_exit_faults(
        full, now=NOW, source="x"
    )
    assert container_exit_faults(slim, now=NOW, source="x")  # not vacuous
    assert eviction_fault(slim, now=NOW, source="x") == eviction_fault(full, now=NOW, source="x")
    assert force_deletion_fault(slim, now=NOW, source="x") == force_deletion_fault(
        full, now=NOW, source="x"
    )
    assert (pod_ref(slim), pod_node(slim), pod_created(slim)) == (
        pod_ref(full),
        pod_node(full),
        pod_created(full),
    )
    for container in ("trainer", "setup"):
        for code in (0, 1, 42, 137):
            assert restarts_in_place(slim, container, code) == restarts_in_place(
                full, container, code
            ), (container, code)
    assert slim["metadata"]["labels"] == full["metadata"]["labels"]
    assert slim["metadata"]["annotations"] == {
        "edl.io/restart-count": "2",
        "edl.io/replaces-uid": "u-1",
    }
    assert slim["metadata"]["ownerReferences"] == [{"controller": True, "kind": "Job", "name": "j"}]
    assert exit_counting_owner(slim) == exit_counting_owner(full) == "Job train/j"
    assert [c["name"] for c in slim["spec"]["ephemeralContainers"]] == ["debugger"]


def test_a_slim_pod_is_a_small_part_of_the_pod() -> None:
    full, slim = big_pod(), slim_pod(big_pod())
    assert len(json.dumps(slim)) * 8 < len(json.dumps(full))
