"""The restarter's pure safety rules: the Lease protocol, the storm guard, pending restarts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.core.decide import Action, Decision
from edl_agent.restarter.core.lease import (
    LeaseRecord,
    lease_spec,
    next_record,
    read_lease,
    released,
)
from edl_agent.restarter.core.policy import PodIdentity, RestartScope
from edl_agent.restarter.core.record import JobRecord
from edl_agent.restarter.core.status import finish_restart, pending_restarts, record_decision
from edl_agent.restarter.core.storm import StormGuard

T0 = datetime(2026, 11, 22, 8, 0, tzinfo=UTC)


def held_by(holder: str, *, duration: int = 15, transitions: int = 3) -> LeaseRecord:
    return LeaseRecord(holder, duration, acquired=T0, renewed=T0, transitions=transitions)


# --- the Lease -------------------------------------------------------------------------


def test_a_missing_lease_is_created_for_me() -> None:
    record = next_record(None, me="a", now=T0, duration_seconds=15, unchanged_for=0)
    assert record == LeaseRecord("a", 15, acquired=T0, renewed=T0, transitions=0)


def test_another_holders_lease_is_waited_for_until_it_stood_still_for_its_duration() -> None:
    other = held_by("b", duration=15)
    later = T0 + timedelta(hours=1)  # their clock or ours: only how long we watched counts
    assert next_record(other, me="a", now=later, duration_seconds=15, unchanged_for=14.9) is None
    taken = next_record(other, me="a", now=later, duration_seconds=15, unchanged_for=15.0)
    assert taken is not None
    assert (taken.holder, taken.acquired, taken.renewed, taken.transitions) == (
        "a",
        later,
        later,
        4,
    )


def test_the_holders_own_duration_counts_not_mine() -> None:
    other = held_by("b", duration=40)
    assert next_record(other, me="a", now=T0, duration_seconds=5, unchanged_for=30) is None


def test_the_holder_renews_without_a_transition() -> None:
    mine = held_by("a", transitions=7)
    later = T0 + timedelta(seconds=2)
    renewed = next_record(mine, me="a", now=later, duration_seconds=15, unchanged_for=0)
    assert renewed == LeaseRecord("a", 15, acquired=T0, renewed=later, transitions=7)


def test_a_released_lease_is_taken_at_once() -> None:
    free = released(held_by("b"))
    assert not free.held
    taken = next_record(free, me="a", now=T0, duration_seconds=15, unchanged_for=0)
    assert taken is not None
    assert taken.holder == "a"


def test_the_lease_round_trips_through_its_api_spec() -> None:
    record = LeaseRecord(
        "restarter-0",
        15,
        acquired=T0,
        renewed=T0 + timedelta(microseconds=123),
        transitions=2,
    )
    spec = lease_spec(record)
    assert spec["renewTime"] == "2026-11-22T08:00:00.000123Z"
    assert read_lease({"spec": spec}) == record
    assert read_lease(None) is None
    assert read_lease({"spec": {}}) == LeaseRecord("", 0)


@given(
    holder=st.sampled_from(["", "a", "b"]),
    duration=st.integers(1, 60),
    watched=st.floats(0, 120),
)
def test_a_live_foreign_holder_is_never_overwritten(
    holder: str, duration: int, watched: float
) -> None:
    current = held_by(holder, duration=duration)
    record = next_record(current, me="a", now=T0, duration_seconds=15, unchanged_for=watched)
    if holder == "b" and watched < duration:
        assert record is None
    else:
        assert record is not None
        assert record.holder == "a"


# --- the storm guard -------------------------------------------------------------------


def test_the_storm_guard_needs_both_the_share_and_the_minimum() -> None:
    guard = StormGuard(max_share=0.1, min_nodes=3)
    assert not guard.storming(2, 10)  # 20 % but only 2 nodes
    assert guard.storming(3, 10)
    assert not guard.storming(10, 100)  # exactly 10 % is not more than 10 %
    assert guard.storming(11, 100)
    assert not guard.storming(0, 0)
    assert not StormGuard(max_share=1.0, min_nodes=1).storming(100, 100)
    assert "11 of 100" in guard.describe(11, 100)


@given(failing=st.integers(0, 1000), total=st.integers(0, 1000))
def test_a_storm_is_never_below_the_minimum(failing: int, total: int) -> None:
    guard = StormGuard(max_share=0.05, min_nodes=5)
    if guard.storming(failing, total):
        assert failing >= 5
        assert failing > 0.05 * total


# --- pending restarts ------------------------------------------------------------------


def restart(fault_id: str, job: str = "resnet") -> Decision:
    ref = PodRef("ns", "worker-1", "uid-1")
    fault = Fault(id=fault_id, kind=FaultKind.NODE_NOT_READY, node="node-3", observed_at=T0)
    identity = PodIdentity(job=job, replica_type="worker", replica_index=1, pod=ref)
    return Decision(
        Action.RESTART, "rule 0", fault, identity, JobRecord(), rule=0, scope=RestartScope.ALL
    )


def test_a_restart_stays_pending_with_its_pods_until_finished() -> None:
    targets = [PodRef("ns", "worker-1", "uid-1"), PodRef("ns", "worker-0", "uid-0")]
    status = record_decision(None, restart("f1"), now=T0, targets=targets)
    status = record_decision(status, restart("f2", job="bert"), now=T0, targets=targets[:1])
    policy = {"metadata": {"namespace": "ns", "name": "p"}, "status": status}
    pending = pending_restarts(policy)
    assert [(p.job, p.fault_id, p.node, p.fault) for p in pending] == [
        ("resnet", "f1", "node-3", FaultKind.NODE_NOT_READY),
        ("bert", "f2", "node-3", FaultKind.NODE_NOT_READY),
    ]
    assert pending[0].pods == tuple(targets)
    done = finish_restart(status, "resnet", ["f1"])
    assert [p.fault_id for p in pending_restarts({"metadata": {}, "status": done})] == ["f2"]
    assert "pendingRestarts" not in done["jobs"][0]
    assert done["jobs"][0]["restarts"] == status["jobs"][0]["restarts"]


def test_only_a_restart_with_targets_is_pending() -> None:
    status = record_decision(None, restart("f1"), now=T0)
    assert pending_restarts({"status": status}) == []
