"""What an agent sends can neither stall nor silence the restarter, on a real API server: the
restarter's controller (its API adapters, the policy's status written through the status
subresource) behind the real intake (TokenReview of a token bound to a pod on the node), fed
over gRPC as agents feed it.

- Oversized: device faults naming 1,600 device ids of 1 KB each with a 100 KB detail, sent at
  once with plain faults of the same policy: every pod is replaced once, the status stays small
  (the ids and the text were cut at the intake), nothing waits on a write the API server
  refuses.
- A clock an hour ahead: its fault replaces the pod; the replacement's own exit a moment later
  (seen by the restarter's pod watch, dated by the cluster's clock) replaces it again instead of
  being judged older than the restart; the intake counts the clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from k8s_test_helpers import KwokCluster, wait_for
from kubernetes import client
from test_intake import AGENT_SA, pod_bound_token, report
from test_restarter import (  # fixtures too: pytest finds them among the module's names
    MakePolicy,
    controller,
    crd,
    exit_pod,
    labels,
    make_policy,
    objects,
    pod_or_none,
    wait_pod,
)

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.bounds import MAX_DEVICE_ID
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.adapters.auth import CachedReviewer, TokenReviewer
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.intake_server import IntakeServer
from edl_agent.restarter.core.callers import service_account_user
from edl_agent.restarter.core.controller import Controller

__all__ = ["controller", "crd", "make_policy", "objects"]

GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
RULES = [
    {"restartPolicy": "ExitCode", "exitCodes": "1-200"},
    {"restartPolicy": "OnNodeFail", "exceptionalEvent": "deviceUnhealthy"},
]


@pytest.fixture
def intake(k8s: KwokCluster, controller: Controller) -> Iterator[tuple[FaultIntake, str]]:
    """The intake as the restarter runs it: its sink is the controller, its pod cache the
    controller's."""
    running = FaultIntake(
        review=CachedReviewer(TokenReviewer(k8s.api)),
        agent_user=service_account_user(k8s.namespace, AGENT_SA),
        on_fault=controller.accept,
        find_pod=controller.pods.find_pod,
    )
    server = IntakeServer(running, listen="127.0.0.1:0")
    server.start()
    yield running, f"127.0.0.1:{server.port}"
    server.stop(0)


def device_fault(node: str, pod: Any, n: int, **changes: Any) -> Fault:
    fault = Fault(
        id=f"device/{node}/GPU-{n}/XID79",
        kind=FaultKind.DEVICE_UNHEALTHY,
        node=node,
        observed_at=datetime.now(UTC),
        pods=(PodRef(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid),),
        reason="XID79",
        device_ids=(f"GPU-{n}",),
    )
    return replace(fault, **changes)


def policy_status(objects: client.CustomObjectsApi, namespace: str) -> dict[str, Any]:
    body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "train")
    return body.get("status") or {}


def test_oversized_faults_are_cut_at_the_intake_and_hold_up_no_other_fault(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    intake: tuple[FaultIntake, str],
) -> None:
    running, address = intake
    make_policy(faultTolerantPolicy=RULES)
    node = k8s.create_gpu_node().metadata.name
    token = pod_bound_token(k8s, node)
    pods = [
        k8s.create_pod(f"w{n}-0", node=node, labels=labels(f"w{n}", "worker", 0)) for n in range(8)
    ]
    huge = {
        "device_ids": tuple(f"GPU-{i}-" + "u" * 1000 for i in range(1600)),
        "detail": "x" * 100_000,
        "reason": "XID79" * 500,
    }
    faults = [
        device_fault(node, pod, n, **(huge if n % 2 == 0 else {})) for n, pod in enumerate(pods)
    ]
    with ThreadPoolExecutor(len(faults)) as pool:  # each its own call, all at once
        answers = list(pool.map(lambda f: report(address, [f], token), faults))
    assert [a.acks[0].verdict for a in answers] == [fault_pb2.VERDICT_ACCEPTED] * len(faults)

    for n in range(len(pods)):
        wait_pod(k8s, f"w{n}-0-r1")
    status = policy_status(objects, k8s.namespace)
    assert status["restarts"] == len(pods)
    size = len(json.dumps(status))
    assert size < 64 * 1024, f"the policy's status is {size} bytes"
    reasons = [a["reason"] for job in status["jobs"] for a in job["lastActions"]]
    # Four ids shown (each cut to its bound), and how many more the agent named.
    assert sum("+1596 more" in r for r in reasons) == 4, reasons
    assert max(len(r) for r in reasons) < 5 * MAX_DEVICE_ID + 200, reasons
    assert running.counts().trimmed == {"reason": 4, "detail": 4, "device_ids": 4}


def test_a_clock_an_hour_ahead_cannot_silence_the_replacement_s_faults(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    intake: tuple[FaultIntake, str],
) -> None:
    running, address = intake
    make_policy(faultTolerantPolicy=RULES)
    node = k8s.create_gpu_node().metadata.name
    token = pod_bound_token(k8s, node)
    pod = k8s.create_pod("resnet-0", node=node, labels=labels("resnet", "worker", 0))
    ahead = device_fault(node, pod, 0, observed_at=datetime.now(UTC) + timedelta(hours=1))
    received = datetime.now(UTC)
    [ack] = report(address, [ahead], token).acks
    assert ack.verdict == fault_pb2.VERDICT_ACCEPTED
    assert running.counts().trimmed == {"observed_at": 1}

    wait_pod(k8s, "resnet-0-r1")
    [job] = policy_status(objects, k8s.namespace)["jobs"]
    [last] = job["lastRestarts"]
    recorded = datetime.fromisoformat(last["time"])
    assert recorded < received + timedelta(minutes=1), f"the restart is dated {recorded}"

    # The replacement runs (no scheduler here: bound as one would bind it) and exits.
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name="resnet-0-r1"),
        target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )
    k8s.core.create_namespaced_binding(k8s.namespace, binding, _preload_content=False)
    wait_for(
        "the replacement Running",
        lambda: pod_or_none(k8s, "resnet-0-r1"),
        lambda p: p is not None and p.status.phase == "Running",
        timeout=30,
    )
    exit_pod(k8s, "resnet-0-r1", 137)
    wait_pod(k8s, "resnet-0-r2", timeout=20)
    [job] = policy_status(objects, k8s.namespace)["jobs"]
    assert job["restarts"] == 2
    assert [a["action"] for a in job["lastActions"]][-2:] == ["Restart", "Restart"]
