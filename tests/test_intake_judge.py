"""The intake's judgement of reported faults, without a server: a stand-in gRPC context calls
`Report` directly. What one report may name, which pods and exits an agent is believed about,
ids scoped by observer, "retry later" while the pod cache may lag, and the durable-ack contract
with the sink."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.bounds import MAX_DEVICE_IDS
from edl_agent.faults.convert import to_proto
from edl_agent.faults.ids import container_exit_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.pod_faults import container_exit_faults
from edl_agent.restarter.adapters.intake import (
    CACHE_LAG,
    MAX_FAULTS_PER_CALL,
    MAX_PODS_PER_FAULT,
    FaultIntake,
)
from edl_agent.restarter.core.callers import NODE_NAME_EXTRA, Identity

AGENT = "system:serviceaccount:edl-system:edl-agent"
T0 = datetime(2026, 5, 1, 12, tzinfo=UTC)
FINISHED = "2026-05-01T11:59:58Z"
TOKENS = {
    f"token-{node}": Identity(authenticated=True, username=AGENT, extra={NODE_NAME_EXTRA: (node,)})
    for node in ("node-a", "node-b")
}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


@dataclasses.dataclass
class Context:
    """What `Report` uses of a grpc.ServicerContext."""

    token: str
    remaining: float | None = None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def time_remaining(self) -> float | None:
        return self.remaining

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def worker(
    n: int, node: str, *, restarts: int = 0, code: int = 137, uid: str | None = None
) -> dict[str, Any]:
    """A pod as the restarter's cache holds it: its container `worker` exited with `code`."""
    return {
        "metadata": {"namespace": "ml", "name": f"worker-{n}", "uid": uid or f"uid-{n}"},
        "spec": {"nodeName": node, "containers": [{"name": "worker"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "worker",
                    "restartCount": restarts,
                    "state": {
                        "terminated": {
                            "exitCode": code,
                            "reason": "OOMKilled",
                            "finishedAt": FINISHED,
                        }
                    },
                }
            ],
        },
    }


def exit_of(pod: Mapping[str, Any]) -> Fault:
    """The exit as the agent on the pod's node reports it."""
    [fault] = container_exit_faults(pod, now=T0, source="agent")
    return fault


def device_fault(pods: int, node: str = "node-a", fault_id: str = "") -> Fault:
    return Fault(
        id=fault_id or f"device/{node}/GPU-1/XID79/{pods}",
        kind=FaultKind.DEVICE_UNHEALTHY,
        node=node,
        observed_at=T0,
        pods=tuple(PodRef("ml", f"worker-{i}", f"uid-{i}") for i in range(pods)),
        reason="XID79",
        device_ids=("GPU-1",),
    )


class Restarter:
    """An intake with a pod cache (`pods`, by uid and by name), a recording sink and a clock."""

    def __init__(self, *, sink: Callable[[Fault], None] | None = None) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.received: list[Fault] = []
        self.now = 0.0
        # Told of every pod the intake looks up in the cache, in order.
        self.on_lookup: Callable[[PodRef], None] = lambda _ref: None
        self.intake = FaultIntake(
            review=TOKENS.__getitem__,
            agent_user=AGENT,
            on_fault=sink or self.received.append,
            find_pod=self.find_pod,
            clock=lambda: self.now,
        )

    def cache(self, *pods: dict[str, Any]) -> None:
        for pod in pods:
            self.pods[pod["metadata"]["uid"]] = pod

    def find_pod(self, ref: PodRef) -> dict[str, Any] | None:
        self.on_lookup(ref)
        if ref.uid in self.pods:
            return self.pods[ref.uid]
        by_name = (p for p in self.pods.values() if p["metadata"]["name"] == ref.name)
        return next(by_name, None)

    def report(self, node: str, *faults: Fault, **context: Any) -> list[tuple[str, int, str]]:
        request = fault_pb2.ReportRequest(faults=[to_proto(f) for f in faults])
        response = self.intake.Report(request, Context(f"token-{node}", **context))
        return [(a.fault_id, a.verdict, a.reason) for a in response.acks]

    def ids(self) -> list[str]:
        return [f.id for f in self.received]


ACCEPTED = fault_pb2.VERDICT_ACCEPTED
DUPLICATE = fault_pb2.VERDICT_DUPLICATE
REFUSED = fault_pb2.VERDICT_REFUSED
LATER = fault_pb2.VERDICT_UNSPECIFIED


def test_a_fault_naming_more_pods_than_share_a_device_is_refused_quickly() -> None:
    restarter = Restarter()
    restarter.cache(*(worker(i, "node-a") for i in range(MAX_PODS_PER_FAULT)))
    looked_up: list[PodRef] = []
    restarter.on_lookup = looked_up.append
    huge = device_fault(100_000)
    started = time.monotonic()
    [(_, verdict, reason)] = restarter.report("node-a", huge)
    assert (verdict, reason) == (REFUSED, "too_many_pods")
    assert time.monotonic() - started < 5.0
    assert looked_up == []  # refused before a single cache read
    most = device_fault(MAX_PODS_PER_FAULT)
    assert restarter.report("node-a", most)[0][1] == ACCEPTED
    assert [len(f.pods) for f in restarter.received] == [MAX_PODS_PER_FAULT]
    assert restarter.intake.counts().refused == {"too_many_pods": 1}


def test_a_node_a_token_reporting_an_exit_of_a_pod_on_node_b_is_refused() -> None:
    restarter = Restarter()
    on_b = worker(1, "node-b")
    restarter.cache(on_b)
    claimed = dataclasses.replace(exit_of(on_b), node="node-a")  # "about node A"
    assert restarter.report("node-a", claimed) == [(claimed.id, REFUSED, "pod_elsewhere")]
    # B's exit id, naming a pod the cache does not know: not believed, then refused.
    ghost = dataclasses.replace(claimed, pods=(PodRef("ml", "ghost", "uid-ghost"),))
    assert restarter.report("node-a", ghost)[0][1] == LATER
    restarter.now = CACHE_LAG
    assert restarter.report("node-a", ghost) == [(claimed.id, REFUSED, "pod_unknown")]
    assert restarter.received == []
    # The agent on node B is believed about the same exit.
    assert restarter.report("node-b", exit_of(on_b)) == [(claimed.id, ACCEPTED, "")]
    assert restarter.ids() == [container_exit_id("uid-1", "worker", 0)]


def test_a_squatted_exit_id_cannot_make_the_real_fault_a_duplicate() -> None:
    """Node A's agent sends the id of an exit of node B's pod before it happens — as an exit
    of its own pod, and as a device fault. Neither makes B's real exit a duplicate, whether B's
    agent reports it or the restarter's own watcher observes it (same canonical id)."""
    restarter = Restarter()
    mine, theirs = worker(1, "node-a"), worker(2, "node-b", code=1)
    restarter.cache(mine, theirs)
    real_id = container_exit_id("uid-2", "worker", 0)
    as_exit = dataclasses.replace(exit_of(mine), id=real_id)
    as_device = dataclasses.replace(device_fault(0), id=real_id)
    assert restarter.report("node-a", as_exit, as_device) == [
        (real_id, REFUSED, "exit_not_seen"),  # not an id of an exit of the pod it names
        (real_id, ACCEPTED, ""),  # believed as node A's own word, in node A's scope
    ]
    assert restarter.ids() == [f"agent/node-a/{real_id}"]
    assert restarter.report("node-b", exit_of(theirs)) == [(real_id, ACCEPTED, "")]
    assert restarter.ids() == [f"agent/node-a/{real_id}", real_id]
    assert restarter.report("node-b", exit_of(theirs)) == [(real_id, DUPLICATE, "")]


def test_an_exit_the_pod_s_status_does_not_show_is_not_accepted() -> None:
    restarter = Restarter()
    pod = worker(1, "node-a", restarts=3)
    restarter.cache(pod)
    real = exit_of(pod)
    invented = dataclasses.replace(real, id=container_exit_id("uid-1", "worker", 7))
    # The container has run again since exit 1, and nothing of that exit is left: final.
    past = dataclasses.replace(real, id=container_exit_id("uid-1", "worker", 1))
    other = dataclasses.replace(real, container="sidecar", id=container_exit_id("uid-1", "x", 3))
    acks = restarter.report("node-a", past, other, invented)
    assert acks == [
        (past.id, REFUSED, "exit_not_seen"),
        (other.id, REFUSED, "exit_not_seen"),
        (invented.id, LATER, "retry_later: exit_not_seen"),  # the cache may be behind
    ]
    restarter.now = CACHE_LAG
    assert restarter.report("node-a", invented) == [(invented.id, REFUSED, "exit_not_seen")]
    assert restarter.received == []
    # What is handed on is the exit as the status tells it, not as the agent does.
    lying = dataclasses.replace(real, exit_code=0, reason="Completed")
    assert restarter.report("node-a", lying) == [(real.id, ACCEPTED, "")]
    [handed] = restarter.received
    assert (handed.exit_code, handed.reason, handed.source) == (137, "OOMKilled", "agent")
    assert restarter.intake.counts().refused == {"exit_not_seen": 3}


def test_an_ephemeral_container_s_exit_is_refused() -> None:
    restarter = Restarter()
    pod = worker(1, "node-a")
    pod["spec"]["ephemeralContainers"] = [{"name": "debug"}]
    restarter.cache(pod)
    debug = dataclasses.replace(
        exit_of(pod), container="debug", id=container_exit_id("uid-1", "debug", 0)
    )
    assert restarter.report("node-a", debug) == [(debug.id, REFUSED, "exit_not_seen")]


def test_a_pod_the_cache_does_not_show_yet_is_asked_for_again_then_refused() -> None:
    """The cache trails the agent a moment: no real fault is lost to that (the agent keeps a
    "retry later" fault); a pod it never shows is refused once the lag is over."""
    restarter = Restarter()
    late = worker(1, "node-a")
    fault = exit_of(late)
    assert restarter.report("node-a", fault) == [(fault.id, LATER, "retry_later: pod_unknown")]
    restarter.now = 5.0
    restarter.cache(late)  # the watch caught up
    assert restarter.report("node-a", fault) == [(fault.id, ACCEPTED, "")]

    never = device_fault(1, fault_id="device/node-a/GPU-9/XID79/1")
    assert restarter.report("node-a", never)[0][1:] == (LATER, "retry_later: pod_unknown")
    restarter.now += CACHE_LAG - 0.1
    assert restarter.report("node-a", never)[0][1] == LATER
    restarter.now += 0.1
    assert restarter.report("node-a", never) == [(never.id, REFUSED, "pod_unknown")]
    counts = restarter.intake.counts()
    assert (counts.accepted, counts.deferred, counts.refused) == (1, 3, {"pod_unknown": 1})


@pytest.mark.parametrize(
    ("cached", "verdict", "reason"),
    [
        (worker(0, "node-b"), REFUSED, "pod_elsewhere"),  # that very pod, bound to node B
        (worker(0, "node-b", uid="uid-other"), LATER, "retry_later: pod_elsewhere"),
        (worker(0, "node-a", uid="uid-other"), LATER, "retry_later: pod_elsewhere"),
        (worker(0, ""), LATER, "retry_later: pod_unknown"),  # its binding not seen yet
        (worker(0, "node-a"), ACCEPTED, ""),
    ],
)
def test_which_pods_an_agent_is_believed_about(
    cached: dict[str, Any], verdict: int, reason: str
) -> None:
    restarter = Restarter()
    restarter.cache(cached)
    assert restarter.report("node-a", device_fault(1))[0][1:] == (verdict, reason)


def test_a_pod_named_without_uid_is_handed_on_with_the_cache_s_uid() -> None:
    restarter = Restarter()
    restarter.cache(worker(0, "node-a"))
    by_name = dataclasses.replace(device_fault(1), pods=(PodRef("ml", "worker-0"),))
    assert restarter.report("node-a", by_name)[0][1] == ACCEPTED
    [handed] = restarter.received
    assert handed.pods == (PodRef("ml", "worker-0", "uid-0"),)
    assert handed.id == f"agent/node-a/{by_name.id}"


def test_faults_are_judged_then_handed_on_and_remembered_only_once_recorded() -> None:
    order: list[str] = []
    failing = {"yes": False}
    restarter: Restarter

    def sink(fault: Fault) -> None:
        order.append(f"record {fault.id}")
        if failing["yes"]:
            msg = "the API server is down"
            raise RuntimeError(msg)
        restarter.received.append(fault)

    restarter = Restarter(sink=sink)
    pods = [worker(n, "node-a") for n in range(3)]
    restarter.cache(*pods)
    restarter.on_lookup = lambda ref: order.append(f"judge {ref.name}")
    faults = [exit_of(p) for p in pods]
    acks = restarter.report("node-a", *faults, faults[0])  # the first one twice
    assert [verdict for _, verdict, _ in acks] == [ACCEPTED, ACCEPTED, ACCEPTED, DUPLICATE]
    assert order == [
        *(f"judge worker-{n}" for n in (0, 1, 2, 0)),
        *(f"record {f.id}" for f in faults),
    ]

    failing["yes"] = True
    fresh = worker(3, "node-a")
    restarter.cache(fresh)
    with pytest.raises(Aborted) as aborted:
        restarter.report("node-a", exit_of(fresh))
    assert aborted.value.code is grpc.StatusCode.UNAVAILABLE
    assert restarter.intake.counts().sink_errors == 1
    failing["yes"] = False  # recorded on the agent's retry: not a duplicate of the failure
    assert restarter.report("node-a", exit_of(fresh))[0][1] == ACCEPTED
    assert restarter.intake.counts().accepted == 4


def test_per_call_work_is_bounded_and_the_rest_left_for_the_next_call() -> None:
    restarter = Restarter()
    pod = worker(0, "node-a")
    restarter.cache(pod)
    many = [
        dataclasses.replace(device_fault(0), id=f"f-{n}") for n in range(MAX_FAULTS_PER_CALL + 5)
    ]
    acks = restarter.report("node-a", *many)
    assert len(acks) == MAX_FAULTS_PER_CALL  # the last five unanswered: the agent sends them again
    # Near the caller's deadline nothing more is handed on; nothing is acknowledged unrecorded.
    assert restarter.report("node-a", exit_of(pod), remaining=0.1) == []
    assert len(restarter.received) == MAX_FAULTS_PER_CALL


def test_an_oversized_fault_is_accepted_cut_to_its_bounds_and_counted() -> None:
    restarter = Restarter()
    restarter.cache(worker(0, "node-a"))
    huge = dataclasses.replace(
        device_fault(1),
        reason="XID79" * 1000,
        detail="x" * 1_000_000,
        device_ids=tuple(f"GPU-{i}-" + "u" * 1000 for i in range(1600)),
    )
    assert restarter.report("node-a", huge)[0][1] == ACCEPTED
    [handed] = restarter.received
    assert len(handed.device_ids) == MAX_DEVICE_IDS + 1
    assert handed.device_ids[-1] == f"… (+{1600 - MAX_DEVICE_IDS} more)"
    assert len(handed.reason) < 200
    assert len(handed.detail) < 1100
    assert restarter.intake.counts().trimmed == {"reason": 1, "detail": 1, "device_ids": 1}


def test_a_name_longer_than_kubernetes_allows_is_an_invalid_fault() -> None:
    restarter = Restarter()
    restarter.cache(worker(0, "node-a"))
    long_pod = dataclasses.replace(device_fault(1), pods=(PodRef("ml", "w" * 300, "uid-0"),))
    [(_, verdict, reason)] = restarter.report("node-a", long_pod)
    assert (verdict, reason) == (REFUSED, "invalid_fault")
    assert restarter.received == []


def test_a_fault_from_a_clock_ahead_is_taken_as_received_now_and_counted() -> None:
    restarter = Restarter()
    restarter.cache(worker(0, "node-a"), worker(1, "node-a"))
    before = datetime.now(UTC)
    ahead = dataclasses.replace(device_fault(1), observed_at=before + timedelta(hours=1))
    slightly = dataclasses.replace(
        device_fault(1, fault_id="slightly"), observed_at=before + timedelta(seconds=1)
    )
    assert [a[1] for a in restarter.report("node-a", ahead, slightly)] == [ACCEPTED, ACCEPTED]
    after = datetime.now(UTC)
    for handed in restarter.received:
        assert before <= handed.observed_at <= after
    assert restarter.intake.counts().trimmed == {"observed_at": 1}  # drift is not counted
