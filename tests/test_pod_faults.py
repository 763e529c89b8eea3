"""Faults read off pod objects: one set of builders (`faults.pod_faults`) for the agent's pod
watcher and the restarter's, so both derive the same faults with the same ids."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes import client

from edl_agent.faults.convert import MAX_ID_LENGTH
from edl_agent.faults.ids import (
    bounded_id,
    container_exit_id,
    device_unhealthy_id,
    observer_scoped_id,
    parse_container_exit_id,
    pod_fault_id,
)
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.pod_exits import container_exits
from edl_agent.faults.pod_faults import (
    DISRUPTION_REASON,
    container_exit_faults,
    eviction_fault,
    force_deletion_fault,
    per_pod_faults,
)
from edl_agent.restarter.adapters.watchers import ClusterWatcher, deleted_by_us

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
FINISHED = "2026-05-01T11:59:58Z"


def pod(uid: str = "u1", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "job-worker-3",
            "namespace": "ns",
            "uid": uid,
            "creationTimestamp": "2026-05-01T11:00:00Z",
        },
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "trainer"}, {"name": "sidecar"}],
            "ephemeralContainers": [{"name": "debug"}],
        },
        "status": {"phase": "Running", **status},
    }


def terminated(code: int, reason: str = "", finished: str | None = FINISHED) -> dict[str, Any]:
    state: dict[str, Any] = {"exitCode": code}
    if reason:
        state["reason"] = reason
    if finished:
        state["finishedAt"] = finished
    return {"terminated": state}


def watcher_faults(*listings: list[dict[str, Any]]) -> list[Fault]:
    """What the restarter's watcher emits for these pod lists, one (re-)list after another."""
    faults: list[Fault] = []
    watcher = ClusterWatcher(client.ApiClient(), on_fault=faults.append, clock=lambda: NOW)
    for items in listings:
        watcher.pods_listed(None, items)
    return faults


def test_exits_in_state_and_last_state_of_init_and_regular_containers() -> None:
    exited = pod(
        initContainerStatuses=[
            {"name": "setup", "restartCount": 0, "state": terminated(0, "Completed")},
        ],
        containerStatuses=[
            {
                "name": "trainer",
                "restartCount": 2,
                "state": terminated(137, "OOMKilled"),
                "lastState": terminated(1, finished=None),
            },
            {"name": "sidecar", "restartCount": 0, "state": terminated(0)},
        ],
    )
    faults = container_exit_faults(exited, now=NOW, source="restarter")
    assert [(f.id, f.exit_code, f.container, f.reason) for f in faults] == [
        (container_exit_id("u1", "trainer", 2), 137, "trainer", "OOMKilled"),
        (container_exit_id("u1", "trainer", 1), 1, "trainer", "Error"),
    ]
    first = faults[0]
    assert first.kind is FaultKind.CONTAINER_EXIT
    assert first.pods == (PodRef("ns", "job-worker-3", "u1"),)
    assert first.observed_at == datetime(2026, 5, 1, 11, 59, 58, tzinfo=UTC)
    assert (first.node, first.source) == ("n1", "restarter")
    assert faults[1].observed_at == NOW  # no finishedAt: when it was seen


def test_the_agent_and_the_restarter_derive_the_same_exits() -> None:
    exited = pod(
        containerStatuses=[
            {"name": "trainer", "restartCount": 1, "state": terminated(137, "OOMKilled")},
        ]
    )
    agent = container_exits(exited, now=lambda: NOW)
    restarter = watcher_faults([exited])
    assert [f.source for f in agent] == ["agent"]
    assert [f.source for f in restarter] == ["restarter"]
    assert [dataclasses.replace(f, source="") for f in agent] == [
        dataclasses.replace(f, source="") for f in restarter
    ]


def test_an_ephemeral_container_s_exit_is_no_fault_on_either_side() -> None:
    debugged = pod(
        ephemeralContainerStatuses=[{"name": "debug", "restartCount": 0, "state": terminated(137)}]
    )
    assert container_exits(debugged) == []
    assert watcher_faults([debugged]) == []


def test_a_re_list_sees_an_exit_kubelet_already_restarted_in_place() -> None:
    """The restarter was down while the container exited and kubelet started it again: only
    `lastState` and `restartCount` tell. A re-list makes it a fault, once per process."""
    restarted = pod(
        containerStatuses=[
            {
                "name": "trainer",
                "restartCount": 1,
                "state": {"running": {"startedAt": "2026-05-01T11:59:59Z"}},
                "lastState": terminated(137, "OOMKilled"),
            }
        ]
    )
    faults = watcher_faults([restarted], [restarted])  # listed, then listed again
    assert [(f.id, f.exit_code, f.reason) for f in faults] == [
        (container_exit_id("u1", "trainer", 0), 137, "OOMKilled")
    ]


def test_eviction_and_force_deletion() -> None:
    deleted = pod()
    deleted["metadata"]["deletionGracePeriodSeconds"] = 0
    forced = force_deletion_fault(deleted, now=NOW, source="restarter")
    assert forced is not None
    assert (forced.kind, forced.id, forced.observed_at) == (
        FaultKind.POD_FORCE_DELETED,
        "forcedelete/u1",
        NOW,
    )
    graceful = pod()
    graceful["metadata"]["deletionGracePeriodSeconds"] = 30
    assert force_deletion_fault(graceful, now=NOW, source="restarter") is None
    unscheduled = pod()
    unscheduled["spec"].pop("nodeName")
    unscheduled["metadata"]["deletionGracePeriodSeconds"] = 0  # the API server's, for any delete
    assert force_deletion_fault(unscheduled, now=NOW, source="restarter") is None
    deleted["status"]["phase"] = "Failed"  # it had terminated already
    assert force_deletion_fault(deleted, now=NOW, source="restarter") is None

    assert eviction_fault(pod(), now=NOW, source="restarter") is None
    evicted = eviction_fault(
        pod(reason="Evicted", message="low on memory"), now=NOW, source="restarter"
    )
    assert evicted is not None
    assert (evicted.kind, evicted.id, evicted.detail, evicted.observed_at) == (
        FaultKind.POD_EVICTED,
        "evicted/u1",
        "low on memory",
        NOW,
    )
    condition = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "PreemptionByScheduler",
        "lastTransitionTime": "2026-05-01T11:58:00Z",
    }
    disrupted = eviction_fault(pod(conditions=[condition]), now=NOW, source="restarter")
    assert disrupted is not None
    assert disrupted.reason == "PreemptionByScheduler"
    assert disrupted.observed_at == datetime(2026, 5, 1, 11, 58, tzinfo=UTC)
    # The restarter's own condition, set as it deletes a pod for a fault, is no new fault; the
    # watcher knows the deletion for its own whichever restarter made it.
    ours = pod(conditions=[condition | {"reason": DISRUPTION_REASON}])
    assert eviction_fault(ours, now=NOW, source="restarter") is None
    assert deleted_by_us(ours)
    assert not deleted_by_us(pod(conditions=[condition]))


def test_a_node_fault_becomes_one_fault_per_pod_never_older_than_the_pod() -> None:
    since = NOW
    spell = Fault(
        id=device_unhealthy_id("n1", "GPU-1", "XID79", 12.5),
        kind=FaultKind.DEVICE_UNHEALTHY,
        node="n1",
        observed_at=since,
        pods=(PodRef("ignored", "ignored"),),
        reason="XID79",
        device_ids=("GPU-1",),
    )
    older = pod("u-old")
    newer = pod("u-new")
    newer["metadata"]["creationTimestamp"] = "2026-05-01T12:00:30Z"  # after the spell began
    named_only = {"metadata": {"namespace": "ns", "name": "held"}}  # pod-resources: no uid
    faults = per_pod_faults(spell, [older, newer, named_only])
    assert [(f.id, f.pods, f.observed_at) for f in faults] == [
        (f"{spell.id}/u-old", (PodRef("ns", "job-worker-3", "u-old"),), since),
        (
            f"{spell.id}/u-new",
            (PodRef("ns", "job-worker-3", "u-new"),),
            since + timedelta(seconds=30),
        ),
        (f"{spell.id}/ns/held", (PodRef("ns", "held"),), since),
    ]
    assert {(f.kind, f.reason, f.device_ids, f.source) for f in faults} == {
        (FaultKind.DEVICE_UNHEALTHY, "XID79", ("GPU-1",), "agent")
    }


def test_ids_are_bounded_and_exit_ids_read_back() -> None:
    assert parse_container_exit_id(container_exit_id("u-1", "worker", 3)) == ("u-1", "worker", 3)
    for not_an_exit in ("exit/u-1/worker", "exit/u-1/worker/x", "evicted/u-1", "exit//w/1"):
        assert parse_container_exit_id(not_an_exit) is None
    long = "notready/" + "n" * 300
    assert len(bounded_id(long)) <= MAX_ID_LENGTH
    assert bounded_id(long).startswith("notready/")
    assert bounded_id(long) == bounded_id(long) != bounded_id(long + "x")
    assert len(pod_fault_id("device/" + "d" * 250, PodRef("ns", "p", "u"))) <= MAX_ID_LENGTH
    assert observer_scoped_id("node-a", "f-1") == "agent/node-a/f-1"
    assert len(observer_scoped_id("n" * 253, "f" * 256)) <= MAX_ID_LENGTH


@given(st.text(min_size=1, max_size=400), st.text(max_size=300))
def test_scoped_ids_of_two_nodes_never_meet(fault_id: str, node: str) -> None:
    assert observer_scoped_id(node, fault_id) != observer_scoped_id(node + "x", fault_id)


@pytest.mark.parametrize("count", [0, 1, 17])
def test_exit_ids_round_trip(count: int) -> None:
    assert parse_container_exit_id(container_exit_id("uid", "a/b", count)) == ("uid", "a/b", count)
