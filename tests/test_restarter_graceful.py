"""Graceful restarts on the in-memory cluster: a degraded device's pod is evicted (never
deleted), a refused eviction waits and is tried again with an Event, and only a rule that names
`deviceDegraded` (or a Graceful one) acts on a degraded device."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.memory import InMemoryCluster
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.restarter.core.spec import parse_policy
from edl_agent.typed import SchemaError
from tests.test_restarter_core import JOB, NS, START, job_entry, labels, names, spec
from tests.waiting import wait_until
from tests.waking_clock import WakingClock as Clock


class Events:
    """An EventSink that keeps what it is given."""

    name = "events"

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        stop.wait()

    def stop(self) -> None:
        pass

    def emit(self, involved: Mapping[str, str], kind: str, reason: str, message: str) -> None:
        self.sent.append((kind, reason, involved.get("name", "")))


@pytest.fixture
def clock() -> Clock:
    return Clock(START)


@pytest.fixture
def cluster(clock: Clock) -> InMemoryCluster:
    return InMemoryCluster(clock)


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def controller(
    cluster: InMemoryCluster, clock: Clock, events: Events
) -> Iterator[Callable[[dict[str, Any]], Controller]]:
    running: list[Controller] = []

    def make(policy: dict[str, Any]) -> Controller:
        cluster.add_policy(NS, "p", policy)
        made = Controller(
            port=cluster,
            pods=cluster,
            clock=clock,
            events=events,
            settings=ControllerSettings(workers=2, tidy_after_seconds=0.5),
        )
        made.policies.listed(NS, [cluster.read_policy(NS, "p")])
        clock.on_advance(made.wake)
        made.start()
        assert made.recovered.wait(5)
        running.append(made)
        return made

    yield make
    for made in running:
        made.stop()


GRACEFUL = [
    {"restartPolicy": "Graceful"},
    {"restartPolicy": "OnNodeFail", "exceptionalEvent": "deviceUnhealthy,nodeNotReady"},
]


def degraded(pod: dict[str, Any], kind: FaultKind = FaultKind.DEVICE_DEGRADED) -> Fault:
    meta = pod["metadata"]
    return Fault(
        id=f"degraded/n1/GPU-3/XID94/1/{meta['uid']}",
        kind=kind,
        node="n1",
        observed_at=START,
        pods=(PodRef(NS, meta["name"], meta["uid"]),),
        reason="XID94",
        device_ids=("GPU-3",),
    )


def test_a_graceful_rule_evicts_the_pod_and_replaces_it(
    cluster: InMemoryCluster, controller: Callable[[dict[str, Any]], Controller]
) -> None:
    made = controller(spec(faultTolerantPolicy=GRACEFUL))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), node="n1")
    made.accept(degraded(pod))
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    assert cluster.calls["evict_pod"] == 1
    assert cluster.calls["delete_pod"] == 0  # never a plain delete: its grace and budget hold
    assert job_entry(cluster, "a")["restarts"] == 1


def test_a_refused_eviction_waits_is_told_and_tried_again(
    cluster: InMemoryCluster,
    controller: Callable[[dict[str, Any]], Controller],
    clock: Clock,
    events: Events,
) -> None:
    made = controller(spec(faultTolerantPolicy=GRACEFUL))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), node="n1")
    cluster.refuse_evictions = True
    made.accept(degraded(pod))
    wait_until(lambda: cluster.calls["evict_pod"] == 1)
    wait_until(lambda: ("Warning", "EvictionRefused", "a-0") in events.sent)
    assert names(cluster) == ["a-0"]  # no second copy while the first keeps running
    refused = made.metrics.registry.get_sample_value("edl_restarter_evictions_refused_total")
    assert refused == 1
    assert job_entry(cluster, "a")["pendingRestarts"][0]["graceful"] is True

    cluster.refuse_evictions = False
    clock.advance(made.settings.resume_after_seconds + 1)
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    assert [e for e in events.sent if e[1] == "EvictionRefused"] == [
        ("Warning", "EvictionRefused", "a-0")
    ]  # told once


def test_a_degraded_device_changes_nothing_without_a_rule_that_names_it(
    cluster: InMemoryCluster, controller: Callable[[dict[str, Any]], Controller]
) -> None:
    made = controller(spec(faultTolerantPolicy=[{"restartPolicy": "Always"}]))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), node="n1")
    made.accept(degraded(pod))
    wait_until(lambda: made.queue_depth() == 0)
    assert names(cluster) == ["a-0"]
    assert cluster.calls["evict_pod"] == cluster.calls["delete_pod"] == 0
    assert job_entry(cluster, "a")["restarts"] == 0


def test_an_unhealthy_device_is_still_replaced_at_once(
    cluster: InMemoryCluster, controller: Callable[[dict[str, Any]], Controller]
) -> None:
    made = controller(spec(faultTolerantPolicy=GRACEFUL))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), node="n1")
    made.accept(degraded(pod, FaultKind.DEVICE_UNHEALTHY))
    wait_until(lambda: names(cluster) == ["a-0-r1"])
    assert cluster.calls["evict_pod"] == 0
    assert cluster.calls["delete_pod"] == 1


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        ({"restartPolicy": "Graceful", "exitCodes": "1"}, "matches no container exits"),
        ({"restartPolicy": "Graceful", "containerName": "main"}, "matches no container exits"),
        (
            {"restartPolicy": "Graceful", "exceptionalEvent": "nodeNotReady"},
            "evicts a pod that still runs",
        ),
    ],
)
def test_graceful_rules_are_checked(rule: dict[str, Any], error: str) -> None:
    with pytest.raises(SchemaError, match=error):
        parse_policy(spec(faultTolerantPolicy=[rule]))


def test_graceful_alone_is_the_rule_for_degraded_devices() -> None:
    policy = parse_policy({**spec(), "restartPolicy": "Graceful", "faultTolerantPolicy": []})
    assert [rule.graceful for rule in policy.rules] == [True]
    assert {str(e) for e in policy.rules[0].named_events} == {"deviceDegraded"}
    assert policy.job_label == JOB


def test_a_dry_run_tells_what_it_would_do_and_writes_nothing(
    cluster: InMemoryCluster,
    controller: Callable[[dict[str, Any]], Controller],
    events: Events,
) -> None:
    made = controller(spec(faultTolerantPolicy=GRACEFUL, mode="DryRun"))
    pod = cluster.add_pod(NS, "a-0", labels=labels("a", 0), node="n1")
    other = cluster.add_pod(NS, "a-1", labels=labels("a", 1), node="n1")
    writes = cluster.writes()
    made.accept(degraded(pod))
    made.accept(degraded(other, FaultKind.DEVICE_UNHEALTHY))
    wait_until(lambda: made.queue_depth() == 0)
    wait_until(lambda: len([e for e in events.sent if e[1] == "DryRun"]) == 2)
    assert names(cluster) == ["a-0", "a-1"]
    assert cluster.writes() == writes  # no status, no pod
    assert "status" not in cluster.policies[(NS, "p")]
    counted = made.metrics.registry.get_sample_value(
        "edl_restarter_dry_run_decisions_total", {"action": "Restart", "reason": "DeviceDegraded"}
    )
    assert counted == 1
    assert made.metrics.registry.get_sample_value(
        "edl_restarter_decisions_total", {"action": "Restart", "reason": "DeviceDegraded"}
    ) in (None, 0.0)
