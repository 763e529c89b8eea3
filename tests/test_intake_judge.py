"""The intake's judgement of one reported fault, without a server: what one report may name, and
which pods an agent is believed about."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.convert import to_proto
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.auth import NODE_NAME_EXTRA, Identity
from edl_agent.restarter.intake import MAX_PODS_PER_FAULT, FaultIntake

AGENT = "system:serviceaccount:edl-system:edl-agent"
ON_NODE_A = Identity(authenticated=True, username=AGENT, extra={NODE_NAME_EXTRA: ("node-a",)})


def device_fault(pods: int) -> Fault:
    return Fault(
        id=f"device/node-a/GPU-1/XID79/{pods}",
        kind=FaultKind.DEVICE_UNHEALTHY,
        node="node-a",
        observed_at=datetime(2026, 5, 1, 12, tzinfo=UTC),
        pods=tuple(PodRef("ml", f"worker-{i}", f"uid-{i}") for i in range(pods)),
        reason="XID79",
        device_ids=("GPU-1",),
    )


def test_a_fault_naming_more_pods_than_share_a_device_is_refused_and_counted() -> None:
    received: list[Fault] = []
    intake = FaultIntake(
        review=lambda _token: ON_NODE_A, agent_user=AGENT, on_fault=received.append
    )
    too_many = intake._judge(to_proto(device_fault(100_000)), ON_NODE_A, "peer")
    assert (too_many.verdict, too_many.reason) == (fault_pb2.VERDICT_REFUSED, "too_many_pods")
    most = intake._judge(to_proto(device_fault(MAX_PODS_PER_FAULT)), ON_NODE_A, "peer")
    assert most.verdict == fault_pb2.VERDICT_ACCEPTED
    assert [len(f.pods) for f in received] == [MAX_PODS_PER_FAULT]
    assert intake.counts().refused == {"too_many_pods": 1}


def cached(node: str, uid: str = "uid-0") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "worker-0", "uid": uid},
        "spec": {"nodeName": node},
    }


def test_an_agent_is_believed_only_about_pods_on_its_own_node() -> None:
    """A node-A token reporting a pod the cache shows on node B (the reproduced cross-node
    replacement, and the squatted exit id) is refused; an unknown pod is let through."""
    cache: dict[str, dict[str, Any] | None] = {}
    received: list[Fault] = []
    intake = FaultIntake(
        review=lambda _token: ON_NODE_A,
        agent_user=AGENT,
        on_fault=received.append,
        find_pod=lambda ref: cache.get(ref.name),
    )

    def judge(n: int) -> fault_pb2.Ack:
        fault = dataclasses.replace(device_fault(1), id=f"f-{n}")
        return intake._judge(to_proto(fault), ON_NODE_A, "peer")

    cache["worker-0"] = cached("node-b")
    elsewhere = judge(1)
    assert (elsewhere.verdict, elsewhere.reason) == (fault_pb2.VERDICT_REFUSED, "pod_elsewhere")
    cache["worker-0"] = cached("node-a", uid="uid-other")  # another pod by that name
    assert judge(2).reason == "pod_elsewhere"
    cache["worker-0"] = cached("node-a")
    assert judge(3).verdict == fault_pb2.VERDICT_ACCEPTED
    cache["worker-0"] = None  # not in the cache (yet): no evidence against the agent
    assert judge(4).verdict == fault_pb2.VERDICT_ACCEPTED
    assert [f.id for f in received] == ["f-3", "f-4"]
    assert intake.counts().refused == {"pod_elsewhere": 2}
