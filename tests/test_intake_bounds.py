"""The intake's judgement of one reported fault, without a server: what one report may name."""

from __future__ import annotations

from datetime import UTC, datetime

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
