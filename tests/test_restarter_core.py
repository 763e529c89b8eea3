"""The restarter's orchestration on the in-memory cluster: faults recorded before they are
acknowledged, decided in batches with one status write, replaced once; backoffs and restarts
recorded by one controller carried out by the next; API errors delay a fault and lose none."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import structlog.testing

import edl_agent.restarter.core
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.pod_faults import force_deletion_fault
from edl_agent.restarter.core.checkpoint import ANNOTATION as CHECKPOINT
from edl_agent.restarter.core.checkpoint import Checkpoint
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.covering import PolicyIndex
from edl_agent.restarter.core.decide import Action
from edl_agent.restarter.core.dispatch import Admission, Dispatch
from edl_agent.restarter.core.dispatcher import NotRecorded
from edl_agent.restarter.core.memory import InMemoryCluster
from edl_agent.restarter.core.plan import Plan, Task, plan
from edl_agent.restarter.core.replacement import REPLACES_UID_ANNOTATION
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.restarter.core.spec import parse_policy
from edl_agent.restarter.core.storm import StormGuard
from tests.waiting import wait_until
from tests.waking_clock import WakingClock as Clock

NS = "train"
JOB, TYPE, INDEX = "edl.test/job", "edl.test/replica-type", "edl.test/replica-index"
START = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def spec(**extra: Any) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"app": "train"}},
        "jobLabel": JOB,
        "replicaTypeLabel": TYPE,
        "replicaIndexLabel": INDEX,
        "backoff": {"initialSeconds": 0, "maxSeconds": 0},
        "faultTolerantPolicy": [
            {"restartPolicy": "ExitCode", "exitCodes": "1-200"},
            {"restartPolicy": "OnNodeFail", "exceptionalEvent": "nodeNotReady"},
        ],
        **extra,
    }


def labels(job: str, index: int, replica_type: str = "worker") -> dict[str, str]:
    return {"app": "train", JOB: job, TYPE: replica_type, INDEX: str(index)}


@pytest.fixture
def clock() -> Clock:
    return Clock(START)


@pytest.fixture
def cluster(clock: Clock) -> InMemoryCluster:
    return InMemoryCluster(clock)


@pytest.fixture
def start(cluster: InMemoryCluster, clock: Clock) -> Iterator[Callable[[], Controller]]:
    running: list[Controller] = []

    def make() -> Controller:
        controller = Controller(
            port=cluster,
            pods=cluster,
            clock=clock,
            settings=ControllerSettings(workers=2, tidy_after_seconds=0.5),
        )
        for (namespace, _), obj in list(cluster.policies.items()):
            controller.policies.listed(
                namespace, [cluster.read_policy(namespace, obj["metadata"]["name"])]
            )
        clock.on_advance(controller.wake)
        controller.start()
        assert controller.recovered.wait(5)
        running.append(controller)
        return controller

    yield make
    for controller in running:
        controller.stop()


def exit_fault(
    pod: dict[str, Any], code: int = 137, *, at: datetime = START, count: int = 0
) -> Fault:
    meta = pod["metadata"]
    return Fault(
        id=f"exit/{meta['uid']}/main/{count}",
        kind=FaultKind.CONTAINER_EXIT,
        node=pod["spec"]["nodeName"],
        observed_at=at,
        pods=(PodRef(NS, meta["name"], meta["uid"]),),
        container="main",
        exit_code=code,
        source="agent",
    )


def failed(pod_status_code: int = 137) -> dict[str, Any]:
    return {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "main",
                "restartCount": 0,
                "state": {"terminated": {"exitCode": pod_status_code}},
            }
        ],
    }


def one_failed_pod(
    cluster: InMemoryCluster, start: Callable[[], Controller], **policy: Any
) -> tuple[dict[str, Any], Controller]:
    """A policy, one pod of job `a` whose container failed, and a controller started."""
    cluster.add_policy(NS, "p", spec(**policy))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), status=failed())
    return pod, start()


def names(cluster: InMemoryCluster) -> list[str]:
    return [p["metadata"]["name"] for p in cluster.live(NS)]


def dispatcher_round(controller: Controller) -> float:
    """When (on the controller's clock) its dispatcher last ran a round."""
    value = controller.metrics.registry.get_sample_value(
        "edl_restarter_dispatcher_round_timestamp_seconds"
    )
    return value or 0.0


def job_entry(cluster: InMemoryCluster, job: str) -> dict[str, Any]:
    status = cluster.policies[(NS, "p")].get("status") or {}
    return next(j for j in status.get("jobs", []) if j["name"] == job)


def test_an_accepted_fault_is_recorded_before_the_ack_and_replaced_with_three_writes(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    pod, controller = one_failed_pod(cluster, start)
    controller.accept(exit_fault(pod))
    # Acknowledged: the decision is in the policy's status already.
    assert job_entry(cluster, "a")["restarts"] == 1
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    new = cluster.live(NS)[0]
    assert new["metadata"]["annotations"][REPLACES_UID_ANNOTATION] == pod["metadata"]["uid"]
    # One status write (decision and pending restart), a create, a delete.
    assert cluster.writes() == 3
    # The pending restart is dropped by the next tidy pass, once its pod is gone.
    wait_until(lambda: "pendingRestarts" not in job_entry(cluster, "a"), timeout=5)


def test_a_fault_that_cannot_be_recorded_is_not_acknowledged_and_its_resend_is_decided(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    pod, controller = one_failed_pod(cluster, start)
    cluster.failing.add("write_status")
    with pytest.raises(NotRecorded):
        controller.accept(exit_fault(pod))
    assert names(cluster) == ["a-0"]
    cluster.failing.clear()
    controller.accept(exit_fault(pod))  # not "duplicate": it was never recorded
    wait_until(lambda: names(cluster) == ["a-0-r1"])


def test_the_same_exit_from_the_agent_and_the_watcher_replaces_the_pod_once(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    pod, controller = one_failed_pod(cluster, start)
    fault = exit_fault(pod)
    controller.submit(fault)
    controller.accept(fault)
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    with structlog.testing.capture_logs() as logs:
        controller.accept(fault)  # answered once the dispatcher has judged this copy
    # Every copy decided about and what was decided done: a second replacement would be here.
    wait_until(lambda: controller.queue_depth() == 0, what="nothing left in hand")
    assert [e["fault_id"] for e in logs if e["event"] == "duplicate fault"] == [fault.id]
    assert names(cluster) == ["a-0-r1"]
    assert job_entry(cluster, "a")["restarts"] == 1


def test_the_old_pod_s_exit_as_it_is_deleted_is_no_second_fault(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    pod, controller = one_failed_pod(cluster, start)
    controller.accept(exit_fault(pod))
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    later = exit_fault(pod, 143, at=START + timedelta(minutes=1), count=1)
    controller.accept(later)
    assert names(cluster) == ["a-0-r1"]
    assert job_entry(cluster, "a")["restarts"] == 1


def test_a_burst_in_one_policy_is_recorded_in_a_few_writes_and_each_pod_replaced_once(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    cluster.add_policy(NS, "p", spec())
    pods = [
        cluster.add_pod(NS, f"j{i}-0", labels=labels(f"j{i}", 0), status=failed())
        for i in range(200)
    ]
    controller = start()
    threads = [threading.Thread(target=controller.accept, args=(exit_fault(p),)) for p in pods]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wait_until(lambda: all(n.endswith("-r1") for n in names(cluster)))
    assert sorted(names(cluster)) == sorted(f"j{i}-0-r1" for i in range(200))
    status_writes = cluster.calls["write_status"]
    # Batched: fewer writes than faults (6 here with a Go build beside it; how many faults one batch
    # takes depends on how fast the deciders run, so a loaded machine writes more).
    assert status_writes < len(pods), status_writes
    assert cluster.policies[(NS, "p")]["status"]["restarts"] == 200


def test_a_backoff_is_recorded_and_carried_out_by_the_next_controller_at_its_time(
    cluster: InMemoryCluster, clock: Clock, start: Callable[[], Controller]
) -> None:
    pod, first = one_failed_pod(cluster, start, backoff={"initialSeconds": 30, "maxSeconds": 60})
    first.accept(exit_fault(pod))
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    clock.advance(5)
    stored = cluster.pods[cluster.live(NS)[0]["metadata"]["uid"]]
    stored["spec"]["nodeName"], stored["status"] = "node-1", failed()
    replacement = cluster.live(NS)[0]
    first.accept(exit_fault(replacement, at=clock()))  # the second in a row: waits 30 s
    entry = job_entry(cluster, "a")
    assert entry["lastActions"][-1]["action"] == "Backoff"
    assert [b["faultId"] for b in entry["pendingBackoffs"]] == [exit_fault(replacement).id]
    first.stop()  # as if killed: the backoff lives on only in the status

    second = start()
    clock.advance(20)
    # The dispatcher has looked at the time, found nothing due, and waits again.
    wait_until(second.dispatcher.idle, what="the dispatcher waiting at +25 s")
    wait_until(lambda: second.queue_depth() == 0, what="nothing left in hand")
    assert names(cluster) == ["a-0-r1"]  # not before its time
    assert [b["faultId"] for b in job_entry(cluster, "a")["pendingBackoffs"]] == [
        exit_fault(replacement).id
    ]
    clock.advance(11)
    wait_until(lambda: names(cluster) == ["a-0-r2"])
    assert "pendingBackoffs" not in job_entry(cluster, "a")
    assert job_entry(cluster, "a")["restarts"] == 2
    assert second.workers_alive()


def test_a_restart_recorded_but_not_carried_out_is_finished_once_by_the_next_controller(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    pod, first = one_failed_pod(cluster, start)
    cluster.failing.add("create_pod")
    first.accept(exit_fault(pod))  # recorded; the replacement fails
    assert job_entry(cluster, "a")["pendingRestarts"]
    first.stop()
    cluster.failing.clear()
    start()
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    wait_until(lambda: "pendingRestarts" not in job_entry(cluster, "a"))
    assert job_entry(cluster, "a")["restarts"] == 1


def test_an_exit_kubelet_restarts_in_place_is_recorded_but_not_replaced(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    cluster.add_policy(NS, "p", spec())
    running = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "main",
                "restartCount": 1,
                "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 3}},
            }
        ],
    }
    pod = cluster.add_pod(
        NS, "a-0", labels=labels("a", 0), spec={"restartPolicy": "OnFailure"}, status=running
    )
    controller = start()
    controller.accept(exit_fault(pod, 3))
    assert job_entry(cluster, "a")["lastActions"][-1]["action"] == "InPlace"
    assert names(cluster) == ["a-0"]
    assert job_entry(cluster, "a")["restarts"] == 0


def test_a_scope_all_restart_replaces_every_pod_of_the_job_once(
    cluster: InMemoryCluster, clock: Clock, start: Callable[[], Controller]
) -> None:
    rules = [{"restartPolicy": "ExitCode", "exitCodes": "137", "restartScope": "All"}]
    cluster.add_policy(NS, "p", spec(faultTolerantPolicy=rules))
    pods = [cluster.add_pod(NS, f"a-{i}", labels=labels("a", i), status=failed()) for i in range(3)]
    cluster.add_pod(NS, "b-0", labels=labels("b", 0))
    # The pods are older than the restart: made in its second they would be its replacements,
    # and a-1's fault (dispatched before a-1 is replaced) would not be stale.
    clock.advance(1)
    controller = start()
    controller.accept(exit_fault(pods[0]))
    controller.accept(exit_fault(pods[1]))  # the same restart replaced it: stale
    wait_until(lambda: sorted(names(cluster)) == ["a-0-r1", "a-1-r1", "a-2-r1", "b-0"])
    assert job_entry(cluster, "a")["restarts"] == 1


def test_the_dispatch_holds_node_faults_in_a_storm_and_releases_those_still_failing() -> None:
    dispatch: Dispatch[str] = Dispatch(StormGuard(max_share=0.1, min_nodes=2))
    assert dispatch.nodes_seen(3, 10, lambda _: True) is not None
    faults = [Fault(f"notready/n{i}", FaultKind.NODE_NOT_READY, f"n{i}", START) for i in range(3)]
    assert [dispatch.admit(f) for f in faults] == [Admission.HELD] * 3
    change = dispatch.nodes_seen(1, 10, lambda node: node == "n1")
    assert change is not None
    assert not change.storming
    assert [f.id for f in change.released] == ["notready/n1"]
    assert change.dropped == 2


def test_the_dispatch_joins_copies_in_hand_and_forgets_what_was_not_recorded() -> None:
    dispatch: Dispatch[str] = Dispatch()
    fault = Fault("x", FaultKind.CONTAINER_EXIT, "n", START)
    assert dispatch.admit(fault, "first") is Admission.NEW
    assert dispatch.admit(fault, "second") is Admission.JOINED
    assert dispatch.settle("x", recorded=False) == ["first", "second"]
    assert dispatch.admit(fault) is Admission.NEW  # forgotten: decided again
    dispatch.settle("x", recorded=True)
    assert dispatch.admit(fault) is Admission.DUPLICATE
    assert dispatch.admit(fault, retry=True) is Admission.NEW
    dispatch.schedule(fault, START + timedelta(seconds=5))
    assert dispatch.due(START) == []
    assert dispatch.due(START + timedelta(seconds=5)) == [fault]


def test_the_policy_index_finds_the_covering_policies_among_many() -> None:
    index = PolicyIndex()
    for i in range(1000):
        selector = {"matchLabels": {"app": "train", JOB: f"j{i}"}}
        index.put(NS, f"p{i:04d}", parse_policy(spec(selector=selector)))
    everything = parse_policy(
        spec(selector={"matchExpressions": [{"key": "app", "operator": "Exists"}]})
    )
    index.put(NS, "all", everything)
    index.put(NS, "broken", None)
    ref = PodRef(NS, "j7-0", "u")
    assert [name for name, _ in index.covering(NS, ref, labels("j7", 0))] == ["all", "p0007"]
    assert index.covering("elsewhere", ref, labels("j7", 0)) == []
    # Refiled under its new selector, and no longer under the old one.
    index.put(NS, "p0007", parse_policy(spec(selector={"matchLabels": {JOB: "other"}})))
    assert [name for name, _ in index.covering(NS, ref, labels("j7", 0))] == ["all"]
    assert [name for name, _ in index.covering(NS, ref, labels("other", 0))] == ["all", "p0007"]
    index.remove(NS, "all")
    assert index.covering(NS, ref, labels("j7", 0)) == []


def test_an_in_place_exit_seen_again_is_not_written_again(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    cluster.add_policy(NS, "p", spec())
    running = {
        "phase": "Running",
        "containerStatuses": [
            {"name": "main", "restartCount": 1, "lastState": {"terminated": {"exitCode": 3}}}
        ],
    }
    pod = cluster.add_pod(
        NS, "a-0", labels=labels("a", 0), spec={"restartPolicy": "Always"}, status=running
    )
    first = start()
    first.accept(exit_fault(pod, 3))
    writes = cluster.calls["write_status"]
    first.stop()
    start().accept(exit_fault(pod, 3))  # a new leader derives it again from lastState
    assert cluster.calls["write_status"] == writes
    assert [a["action"] for a in job_entry(cluster, "a")["lastActions"]] == ["InPlace"]


def test_a_replacement_that_fails_within_the_second_of_its_restart_is_restarted_again(
    cluster: InMemoryCluster, clock: Clock, start: Callable[[], Controller]
) -> None:
    """Exit times have whole seconds: the replacement's exit reads as older than the restart
    that made it, and must not be taken as stale."""
    pod, controller = one_failed_pod(cluster, start)
    clock.advance(0.5)
    controller.accept(exit_fault(pod, at=START))  # restarted at 12:00:00.5
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    stored = cluster.pods[cluster.live(NS)[0]["metadata"]["uid"]]
    stored["spec"]["nodeName"], stored["status"] = "node-1", failed()
    controller.accept(exit_fault(cluster.live(NS)[0], at=START))  # finishedAt 12:00:00
    wait_until(lambda: names(cluster) == ["a-0-r2"])
    assert job_entry(cluster, "a")["restarts"] == 2


def force_fault(pod: dict[str, Any], at: datetime) -> Fault:
    """The watcher's fault for a pod `InMemoryCluster.force_delete` deleted."""
    fault = force_deletion_fault(pod, now=at, source="restarter")
    assert fault is not None
    return fault


def test_a_force_deleted_pod_is_replaced_by_the_next_controller_from_the_recorded_template(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    cluster.add_policy(NS, "p", spec(faultTolerantPolicy=[{"restartPolicy": "OnNodeFail"}]))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0))
    first = start()
    gone = cluster.force_delete(NS, "a-0")
    cluster.failing.add("create_pod")
    first.accept(force_fault(gone, START))  # recorded; the replacement fails
    [pending] = job_entry(cluster, "a")["pendingRestarts"]
    assert pending["pods"][0]["template"]["spec"]["containers"][0]["image"] == "busybox"
    first.stop()
    cluster.failing.clear()
    cluster.forget_gone()  # the next controller never saw the pod: the API has nothing of it
    start()
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    assert cluster.live(NS)[0]["metadata"]["labels"] == pod["metadata"]["labels"]


def test_a_backoff_of_a_force_deleted_pod_is_carried_out_after_a_failover(
    cluster: InMemoryCluster, clock: Clock, start: Callable[[], Controller]
) -> None:
    rules = [{"restartPolicy": "OnNodeFail"}]
    cluster.add_policy(
        NS, "p", spec(faultTolerantPolicy=rules, backoff={"initialSeconds": 30, "maxSeconds": 60})
    )
    cluster.add_pod(NS, "a-0", labels=labels("a", 0))
    first = start()
    first.accept(force_fault(cluster.force_delete(NS, "a-0"), START))
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    clock.advance(5)
    stored = cluster.pods[cluster.live(NS)[0]["metadata"]["uid"]]
    stored["spec"]["nodeName"] = "node-1"
    first.accept(force_fault(cluster.force_delete(NS, "a-0-r1"), clock()))  # waits 30 s
    [backoff] = job_entry(cluster, "a")["pendingBackoffs"]
    assert backoff["template"]["metadata"]["name"] == "a-0-r1"
    first.stop()
    cluster.forget_gone()
    start()
    clock.advance(31)
    wait_until(lambda: names(cluster) == ["a-0-r2"])
    assert job_entry(cluster, "a")["restarts"] == 2


def test_the_checkpoint_lags_behind_the_watch_and_falls_back_on_the_inherited_one() -> None:
    handed_down = Checkpoint(inherited="50", lag=30)
    assert handed_down.value(0) == "50"  # nothing listed yet: the predecessor's
    handed_down.observe(0, "50")  # replaying from there
    handed_down.observe(20, "200")
    assert handed_down.value(20) == "50"  # our events are too fresh: faults may be in flight
    handed_down.observe(40, "300")
    assert handed_down.value(40) == "50"  # handled 40 s ago
    handed_down.observe(61, "400")
    assert handed_down.value(61) == "200"  # the newest handled at least 30 s before
    assert handed_down.annotations(61, lambda: None) == {CHECKPOINT: "200"}


def test_the_core_loads_no_client_library() -> None:
    """The pure core (every module of its package, the in-memory cluster among them) runs
    without kubernetes, grpc or urllib3: only the adapters import them. A fresh interpreter,
    since this one has them loaded."""
    package = pathlib.Path(edl_agent.restarter.core.__file__).parent
    names = sorted(path.stem for path in package.glob("*.py") if path.stem != "__init__")
    assert {"decide", "plan", "memory", "callers"} <= set(names)
    imports = "; ".join(f"import edl_agent.restarter.core.{name}" for name in names)
    check = "import sys; print(sorted({'kubernetes', 'grpc', 'urllib3'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", f"{imports}; {check}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "[]"


class BrokenTicks(InMemoryCluster):
    """A cluster whose node counts (read by the dispatcher's first round, and for every fault)
    raise while `broken`."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.broken = threading.Event()
        self.broken.set()

    def node_counts(self) -> tuple[int, int]:
        if self.broken.is_set():
            msg = "the node counts broke"
            raise RuntimeError(msg)
        return super().node_counts()


def supervised(cluster: InMemoryCluster, clock: Clock, backoff: float) -> Controller:
    settings = ControllerSettings(
        workers=2, part_backoff_seconds=backoff, part_backoff_max_seconds=backoff
    )
    controller = Controller(port=cluster, pods=cluster, clock=clock, settings=settings)
    for (namespace, name), _ in list(cluster.policies.items()):
        controller.policies.listed(namespace, [cluster.read_policy(namespace, name)])
    controller.start()
    return controller


def dispatcher(controller: Controller) -> tuple[bool, int]:
    assert controller.supervisor is not None
    [status] = [s for s in controller.supervisor.statuses() if s.name == "dispatcher"]
    return status.up, status.restarts


def test_a_round_that_raises_restarts_the_dispatcher_and_the_next_fault_is_decided(
    clock: Clock,
) -> None:
    cluster = BrokenTicks(clock)
    cluster.add_policy(NS, "p", spec())
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), status=failed())
    with structlog.testing.capture_logs() as logs:
        controller = supervised(cluster, clock, backoff=0.01)
        try:
            wait_until(lambda: dispatcher(controller)[1] >= 2)  # died and ran again, twice
            cluster.broken.clear()
            wait_until(lambda: controller.ready() == (True, "ok"))
            controller.accept(exit_fault(pod))
            wait_until(lambda: names(cluster) == ["a-0-r1"])
        finally:
            controller.stop()
    died = [e for e in logs if e["event"] == "part died" and e.get("name") == "dispatcher"]
    assert len(died) >= 2


def test_the_controller_is_not_ready_while_its_dispatcher_is_down(clock: Clock) -> None:
    cluster = BrokenTicks(clock)
    controller = supervised(cluster, clock, backoff=3600)  # down until stopped
    try:
        wait_until(lambda: dispatcher(controller) == (False, 1))
        assert controller.ready() == (False, "parts not ready: dispatcher")
        assert not controller.workers_alive()
    finally:
        controller.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("part-")]


def test_under_fence_wait_a_pod_on_a_cut_off_node_is_replaced_only_once_the_node_is_gone(
    cluster: InMemoryCluster, clock: Clock
) -> None:
    cluster.add_policy(NS, "p", spec(fence="Wait"))
    pod = cluster.add_pod(NS, "a-0", node="node-7", labels=labels("a", 0))
    cluster.not_ready.add("node-7")
    controller = Controller(
        port=cluster,
        pods=cluster,
        clock=clock,
        settings=ControllerSettings(workers=1, check_every_seconds=0.05),
    )
    controller.policies.listed(NS, [cluster.read_policy(NS, "p")])
    controller.start()
    try:
        assert controller.recovered.wait(5)
        ref = PodRef(NS, "a-0", pod["metadata"]["uid"])
        fault = Fault("notready/node-7/a-0", FaultKind.NODE_NOT_READY, "node-7", START, pods=(ref,))
        controller.accept(fault)
        assert job_entry(cluster, "a")["pendingRestarts"][0]["fence"] == "Wait"
        wait_until(lambda: controller.metrics.node_waits._value.get() == 1, 10, what="a wait")
        clock.advance(30)  # past resume_after: the recorded restart is looked at again
        checks = controller.checks
        wait_until(lambda: controller.checks >= checks + 2, 10, what="two more checks")
        assert (names(cluster), cluster.calls["create_pod"]) == (["a-0"], 0)  # it waits

        cluster.out_of_service.add("node-7")  # the operator says the node is down

        wait_until(lambda: names(cluster) == ["a-0-r1"], 10, what="the replacement")
        assert controller.metrics.node_waits._value.get() == 1  # told once
    finally:
        controller.stop()


def test_a_decision_the_api_server_refuses_to_record_does_not_hold_up_the_others(
    cluster: InMemoryCluster, start: Callable[[], Controller]
) -> None:
    """A batch whose status write is refused for its size is recorded one decision at a time:
    the one that cannot be written fails alone, the others of its policy are recorded and
    their pods replaced."""
    rules = [{"restartPolicy": "ExitCode", "exitCodes": "1-200"}, {"restartPolicy": "OnNodeFail"}]
    cluster.add_policy(NS, "p", spec(faultTolerantPolicy=rules))
    cluster.max_request_bytes = 64 * 1024
    blob = {"name": "BLOB", "value": "x" * 100_000}
    cluster.add_pod(
        NS,
        "big-0",
        labels=labels("big", 0),
        spec={"containers": [{"name": "main", "image": "busybox", "env": [blob]}]},
    )
    small = [
        cluster.add_pod(NS, f"s{i}-0", labels=labels(f"s{i}", 0), status=failed()) for i in range(3)
    ]
    controller = start()
    gone = cluster.force_delete(NS, "big-0")  # its template goes into the status
    faults = [force_fault(gone, START), *(exit_fault(p) for p in small)]
    tasks = [task for fault in faults for task in controller.deciders.tasks_of(fault)]
    assert len(tasks) == 4
    controller.deciders.decide_batch(NS, "p", tasks)
    wait_until(lambda: names(cluster) == ["s0-0-r1", "s1-0-r1", "s2-0-r1"])
    status = cluster.policies[(NS, "p")]["status"]
    assert status["restarts"] == 3
    assert not any(job["name"] == "big" for job in status["jobs"])


def test_a_fault_sent_again_after_its_restart_was_recorded_is_stale_whatever_its_time(
    cluster: InMemoryCluster,
) -> None:
    """An agent resends a fault a killed leader recorded but never acknowledged; dated on
    receipt (its clock ran ahead), it comes with a later time than the restart it caused. Its
    id, in the job's last actions, says it was acted on."""
    cluster.add_policy(NS, "p", spec())
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), status=failed())
    ref = PodRef(NS, "a-0", pod["metadata"]["uid"])
    fault = exit_fault(pod)
    obj = cluster.read_policy(NS, "p")

    def decide_at(fault: Fault, seconds: float) -> Plan:
        return plan(
            obj,
            [Task(fault, pod, ref, "p")],
            members=lambda *_: [],
            replaced=lambda _ref: False,
            now=START + timedelta(seconds=seconds),
        )

    first = decide_at(fault, 0)
    assert [d.action for _, d in first.decisions] == [Action.RESTART]
    obj["status"] = first.status
    again = decide_at(dataclasses.replace(fault, observed_at=START + timedelta(seconds=30)), 30)
    assert [d.action for _, d in again.decisions] == [Action.STALE]
    assert again.restarts == []
    assert again.status is None  # nothing more to record
