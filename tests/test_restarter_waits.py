"""Nothing in the restarter wakes without a reason: the dispatcher runs a round only for a fault,
a node change or something due (a backoff, the re-check of pending restarts), and a NotReady
node's pods fault the moment its grace ends. Time is a fake clock that wakes the waiting parts
as it moves (real time ends their timed waits); `idle` says a part has looked and waits again."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.adapters.node_grace import GraceTick, NodeGraceTicker
from edl_agent.restarter.adapters.watchers import ClusterWatcher
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.deadlines import Deadlines
from edl_agent.restarter.core.memory import InMemoryCluster
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.restarter.core.storm import StormGuard
from edl_agent.runtime.supervisor import StopSignal, Supervisor
from tests.waiting import wait_until
from tests.waking_clock import WakingClock

NS = "train"
JOB, TYPE, INDEX = "edl.test/job", "edl.test/replica-type", "edl.test/replica-index"
START = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
SPEC = {
    "selector": {"matchLabels": {"app": "train"}},
    "jobLabel": JOB,
    "replicaTypeLabel": TYPE,
    "replicaIndexLabel": INDEX,
    "backoff": {"initialSeconds": 0, "maxSeconds": 0},
    "faultTolerantPolicy": [{"restartPolicy": "ExitCode", "exitCodes": "1-200"}],
}
FAILED = {
    "phase": "Failed",
    "containerStatuses": [
        {"name": "main", "restartCount": 0, "state": {"terminated": {"exitCode": 137}}}
    ],
}


class CountingCluster(InMemoryCluster):
    """Counts the reads of the node counts (the storm guard's look)."""

    def __init__(self, clock: WakingClock) -> None:
        super().__init__(clock)
        self.node_reads = 0

    def node_counts(self) -> tuple[int, int]:
        self.node_reads += 1
        return super().node_counts()


@pytest.fixture
def clock() -> WakingClock:
    return WakingClock(START)


@pytest.fixture
def cluster(clock: WakingClock) -> CountingCluster:
    cluster = CountingCluster(clock)
    cluster.add_policy(NS, "p", SPEC)
    return cluster


@pytest.fixture
def controller(cluster: CountingCluster, clock: WakingClock) -> Iterator[Controller]:
    running = Controller(
        port=cluster,
        pods=cluster,
        clock=clock,
        storm=StormGuard(max_share=0.5, min_nodes=2),
        settings=ControllerSettings(workers=1, check_every_seconds=0.05, tidy_after_seconds=0.0),
    )
    running.policies.listed(NS, [cluster.read_policy(NS, "p")])
    clock.on_advance(running.wake)
    running.start()
    assert running.recovered.wait(5)
    wait_until(running.dispatcher.idle, what="the dispatcher waiting")
    yield running
    running.stop()


def exit_fault(pod: dict[str, Any]) -> Fault:
    meta = pod["metadata"]
    return Fault(
        id=f"exit/{meta['uid']}/main/0",
        kind=FaultKind.CONTAINER_EXIT,
        node=pod["spec"]["nodeName"],
        observed_at=START,
        pods=(PodRef(NS, meta["name"], meta["uid"]),),
        container="main",
        exit_code=137,
    )


def names(cluster: InMemoryCluster) -> list[str]:
    return [p["metadata"]["name"] for p in cluster.live(NS)]


def round_gauge(controller: Controller) -> float | None:
    return controller.metrics.registry.get_sample_value(
        "edl_restarter_dispatcher_round_timestamp_seconds"
    )


def test_with_nothing_queued_or_due_the_dispatcher_runs_no_round_until_a_backoff_falls_due(
    cluster: CountingCluster, clock: WakingClock, controller: Controller
) -> None:
    dispatcher = controller.dispatcher
    pod = cluster.add_pod(
        NS, "a-0", labels={"app": "train", JOB: "a", TYPE: "w", INDEX: "0"}, status=FAILED
    )
    rounds, looked = dispatcher.rounds, round_gauge(controller)
    assert dispatcher.next_wait() is None  # no timed wake-up at all
    for _ in range(3):
        clock.advance(3600)
        wait_until(dispatcher.idle, what="the dispatcher waiting again")
    assert (dispatcher.rounds, round_gauge(controller)) == (rounds, looked)

    controller.schedule(exit_fault(pod), clock() + timedelta(seconds=30))  # a Backoff's look
    wait_until(dispatcher.idle, what="the dispatcher waiting for the backoff")
    assert dispatcher.next_wait() == pytest.approx(30)
    clock.advance(29.999)
    wait_until(dispatcher.idle, what="the dispatcher waiting for the backoff")
    assert (dispatcher.rounds, names(cluster)) == (rounds, ["a-0"])
    assert dispatcher.next_wait() == pytest.approx(0.001)

    clock.advance(0.001)
    wait_until(lambda: names(cluster) == ["a-0-r1"], what="the replacement, at the backoff's end")
    assert dispatcher.rounds > rounds
    assert round_gauge(controller) == clock().timestamp()


def test_the_storm_guard_looks_at_the_nodes_when_they_change_not_on_a_tick(
    cluster: CountingCluster, clock: WakingClock, controller: Controller
) -> None:
    reads = cluster.node_reads
    clock.advance(3600)
    wait_until(controller.dispatcher.idle, what="the dispatcher waiting")
    assert cluster.node_reads == reads
    cluster.nodes |= {"n1", "n2", "n3"}
    cluster.not_ready |= {"n1", "n2"}
    controller.nodes_changed()
    paused = "edl_restarter_storm_paused"
    wait_until(lambda: controller.metrics.registry.get_sample_value(paused) == 1, what="a storm")
    assert cluster.node_reads == reads + 1
    cluster.not_ready.clear()
    controller.nodes_changed()
    wait_until(lambda: controller.metrics.registry.get_sample_value(paused) == 0, what="no storm")


def test_recorded_restarts_are_looked_at_again_only_while_some_are_pending(
    cluster: CountingCluster, controller: Controller
) -> None:
    dispatcher = controller.dispatcher
    pod = cluster.add_pod(
        NS, "a-0", labels={"app": "train", JOB: "a", TYPE: "w", INDEX: "0"}, status=FAILED
    )
    assert dispatcher.checks == 0
    controller.accept(exit_fault(pod))  # recorded as a pending restart, then carried out
    wait_until(lambda: names(cluster) == ["a-0-r1"], what="the replacement")
    # Looked at again until tidied away (tidy_after 0), then no more.
    wait_until(lambda: not controller.policies.has_pending_restarts(), what="tidied")
    wait_until(lambda: dispatcher.idle() and dispatcher.next_wait() is None, what="quiet")
    assert dispatcher.checks >= 1


# --- the node grace ---------------------------------------------------------------------


def node(name: str, ready: str) -> dict[str, Any]:
    condition = {"type": "Ready", "status": ready, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    return {"metadata": {"name": name}, "status": {"conditions": [condition]}}


def pod_on(node_name: str, uid: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"job-{uid}", "namespace": "ns", "uid": uid, "resourceVersion": "1"},
        "spec": {"nodeName": node_name, "containers": [{"name": "trainer"}]},
        "status": {"phase": "Running"},
    }


@pytest.fixture
def supervised() -> Iterator[Supervisor]:
    supervisor = Supervisor(StopSignal())
    yield supervisor
    supervisor.stop_event.set()
    supervisor.join()


def test_a_not_ready_node_s_pods_fault_the_moment_its_grace_ends(
    clock: WakingClock, supervised: Supervisor
) -> None:
    faults: list[Fault] = []
    watcher = ClusterWatcher(client.ApiClient(), on_fault=faults.append, node_grace=40, clock=clock)
    clock.on_advance(watcher.wake)
    [ticker] = [p for p in watcher.parts() if isinstance(p, NodeGraceTicker)]
    watcher.nodes.listed([node("n1", "True"), node("n2", "True")])
    watcher.pods_listed(None, [pod_on("n1", "u1"), pod_on("n2", "u2")])
    supervised.add(ticker)
    supervised.start()
    idle = ticker.tick.wakeup.idle
    wait_until(idle, what="the ticker waiting")
    assert ticker.tick.seconds_left() is None  # no node NotReady: no timed wake-up

    watcher.nodes.event("MODIFIED", node("n1", "False"))  # seen NotReady now
    clock.advance(10)
    watcher.nodes.event("MODIFIED", node("n2", "Unknown"))  # its grace ends 10 s later
    wait_until(idle, what="the ticker waiting")
    assert ticker.tick.seconds_left() == pytest.approx(30)
    rounds = ticker.rounds
    for _ in range(3):
        clock.advance(9.999)
        wait_until(idle, what="the ticker waiting")
    assert faults == []
    assert ticker.tick.seconds_left() == pytest.approx(0.003)

    clock.advance(0.003)  # n1's grace ends
    wait_until(lambda: [f.pods[0].uid for f in faults] == ["u1"], what="n1's pod faulted")
    assert faults[0].observed_at == START
    wait_until(idle, what="the ticker waiting")
    assert ticker.tick.seconds_left() == pytest.approx(10)  # n2's grace
    assert ticker.rounds > rounds

    watcher.pod_event("ADDED", pod_on("n1", "u3"))  # lands on a node past its grace
    wait_until(lambda: [f.pods[0].uid for f in faults] == ["u1", "u3"], what="u3 faulted")

    watcher.nodes.event("MODIFIED", node("n2", "True"))  # back before its grace ended
    wait_until(idle, what="the ticker waiting")
    assert ticker.tick.seconds_left() is None
    clock.advance(3600)
    wait_until(idle, what="the ticker waiting")
    assert [f.pods[0].uid for f in faults] == ["u1", "u3"]


def test_deadlines_come_earliest_first_and_one_moved_or_dropped_is_skipped() -> None:
    ends: Deadlines[str] = Deadlines()
    for i, name in enumerate(["a", "b", "c", "d"]):
        ends.set(name, START + timedelta(seconds=10 * (i + 1)))
    ends.discard("a")
    ends.set("b", START + timedelta(seconds=35))  # moved behind c
    assert ends.earliest() == START + timedelta(seconds=30)
    assert ends.pop_due(START + timedelta(seconds=35)) == ["c", "b"]
    ends.keep_only({"a", "b"})
    assert (len(ends), ends.earliest()) == (0, None)
    for flap in range(1000):  # a flapping node leaves no heap behind
        ends.set("e", START + timedelta(seconds=flap))
    assert len(ends._heap) < 200
    assert ends.pop_due(START + timedelta(days=1)) == ["e"]


def test_a_grace_tick_says_how_long_until_the_first_grace_ends(clock: WakingClock) -> None:
    tick = GraceTick(40, clock)
    tick.not_ready("n1", clock())
    clock.advance(15)
    tick.not_ready("n2", clock())
    assert tick.seconds_left() == pytest.approx(25)
    clock.advance(25)
    assert tick.past() == {"n1"}
    assert tick.seconds_left() == pytest.approx(15)
    tick.ready("n2")
    assert (tick.seconds_left(), tick.is_past("n1")) == (None, True)
