"""Graceful restarts on a real API server: a Graceful rule evicts a degraded device's pod through
the Eviction API, a PodDisruptionBudget that allows no disruption holds it (an Event says so),
and once the budget allows it the pod is evicted and replaced, without the restarter taking its
own eviction for a PodEvicted fault."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from k8s_test_helpers import KwokCluster, wait_for
from kubernetes import client
from test_restarter import (  # fixtures too: pytest finds them among the module's names
    GROUP,
    JOB,
    PLURAL,
    VERSION,
    caught_up,
    crd,  # noqa: F401
    decisions,
    labels,
    make_policy,  # noqa: F401
    objects,  # noqa: F401
    pod_or_none,
    wait_action,
    wait_pod,
)

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.adapters.events import EventWriter
from edl_agent.restarter.adapters.kube_controller import connect
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.settings import ControllerSettings


@pytest.fixture
def controller(
    crd: Any,  # noqa: F811
    k8s: KwokCluster,
    k8s_api_client: client.ApiClient,
) -> Iterator[Controller]:
    """The controller of test_restarter, with Events written and recorded restarts carried
    out again after 1 s (a refused eviction is tried again that soon)."""
    config = copy.copy(k8s_api_client.configuration)
    config.connection_pool_maxsize = 16
    api = client.ApiClient(config)
    running = connect(
        api,
        namespaces=[k8s.namespace],
        node_grace=1.0,
        events=EventWriter(api, instance="test"),
        settings=ControllerSettings(resume_after_seconds=1.0, check_every_seconds=0.5),
    )
    running.start()
    assert running.wait_synced(30)
    yield running
    running.stop()
    api.close()


def degraded(pod: Any) -> Fault:
    return Fault(
        id=f"degraded/{pod.spec.node_name}/GPU-3/XID94/1/{pod.metadata.uid}",
        kind=FaultKind.DEVICE_DEGRADED,
        node=pod.spec.node_name,
        observed_at=datetime.now(UTC),
        pods=(PodRef(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid),),
        reason="XID94",
        device_ids=("GPU-3",),
    )


def reasons(k8s: KwokCluster, name: str) -> list[str]:
    found = k8s.core.list_namespaced_event(
        k8s.namespace, field_selector=f"involvedObject.name={name}"
    )
    return [event.reason for event in found.items]


def test_a_budget_holds_the_eviction_and_then_the_pod_leaves_gracefully(
    k8s: KwokCluster,
    make_policy: Any,  # noqa: F811
    objects: client.CustomObjectsApi,  # noqa: F811
    controller: Controller,
) -> None:
    make_policy(faultTolerantPolicy=[{"restartPolicy": "Graceful"}])
    node = k8s.create_gpu_node().metadata.name
    name = "g-worker-0"
    pod = k8s.create_pod(name, node=node, labels=labels("g", "worker", 0))
    budgets = client.PolicyV1Api(k8s.api)
    budgets.create_namespaced_pod_disruption_budget(
        k8s.namespace,
        client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="g"),
            spec=client.V1PodDisruptionBudgetSpec(
                max_unavailable=0, selector=client.V1LabelSelector(match_labels={JOB: "g"})
            ),
        ),
    )

    controller.accept(degraded(pod))
    wait_for("the refusal's Event", lambda: reasons(k8s, name), lambda r: "EvictionRefused" in r)
    held = pod_or_none(k8s, name)
    assert held.metadata.deletion_timestamp is None  # still training
    assert pod_or_none(k8s, f"{name}-r1") is None  # and no second copy beside it
    refused = controller.metrics.registry.get_sample_value("edl_restarter_evictions_refused_total")
    assert (refused or 0) >= 1

    budgets.delete_namespaced_pod_disruption_budget("g", k8s.namespace)
    wait_pod(k8s, f"{name}-r1", timeout=20)
    wait_for("the old pod gone", lambda: pod_or_none(k8s, name), lambda p: p is None, 20)
    job = wait_action(objects, k8s.namespace, "train", 1)
    assert job["restarts"] == 1
    assert [a["fault"] for a in job["lastActions"]] == ["DeviceDegraded"]
    assert decisions(controller, "Restart", "PodEvicted") == 0  # its own eviction: no fault
    writes = controller.metrics.registry.get_sample_value(
        "edl_restarter_api_writes_total", {"what": "evict"}
    )
    assert (writes or 0) >= 2  # refused, then accepted
    assert controller.metrics.registry.get_sample_value(
        "edl_restarter_api_writes_total", {"what": "delete"}
    ) in (None, 0.0)


def test_a_dry_run_writes_nothing_but_its_events(
    k8s: KwokCluster,
    make_policy: Any,  # noqa: F811
    objects: client.CustomObjectsApi,  # noqa: F811
    controller: Controller,
) -> None:
    made = make_policy(
        mode="DryRun",
        faultTolerantPolicy=[
            {"restartPolicy": "Graceful"},
            {"restartPolicy": "OnNodeFail", "exceptionalEvent": "deviceUnhealthy,nodeNotReady"},
        ],
    )
    node = k8s.create_gpu_node().metadata.name
    pods = [
        k8s.create_pod(f"d-worker-{i}", node=node, labels=labels("d", "worker", i))
        for i in range(3)
    ]
    # Every write in the namespace from here on shows as a new resourceVersion of some object.
    before = {
        "pods": {
            p.metadata.name: p.metadata.resource_version
            for p in k8s.core.list_namespaced_pod(k8s.namespace).items
        },
        "policy": objects.get_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, made["metadata"]["name"]
        )["metadata"]["resourceVersion"],
    }
    controller.accept(degraded(pods[0]))
    controller.accept(
        dataclasses.replace(degraded(pods[1]), id="device/x", kind=FaultKind.DEVICE_UNHEALTHY)
    )
    k8s.make_node_not_ready(node)  # and the node's death, seen by the restarter's own watch
    wait_for(
        "three dry-run decisions",
        lambda: controller.metrics.registry.get_sample_value(
            "edl_restarter_dry_run_decisions_total", {"action": "Restart", "reason": "NodeNotReady"}
        ),
        bool,
        timeout=20,
    )
    caught_up(k8s, controller)
    after_pods = {
        p.metadata.name: p.metadata.resource_version
        for p in k8s.core.list_namespaced_pod(k8s.namespace).items
        if not p.metadata.name.startswith("caught-up-")
    }
    assert after_pods == before["pods"]  # no pod made, evicted, deleted or marked
    policy = objects.get_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, made["metadata"]["name"]
    )
    assert policy["metadata"]["resourceVersion"] == before["policy"]  # no status written
    said = [
        e.message
        for e in k8s.core.list_namespaced_event(k8s.namespace).items
        if e.reason == "DryRun"
    ]
    assert any(f"would Restart ({k8s.namespace}/d-worker-0" in m for m in said), said
    assert sum("would Restart" in m for m in said) >= 3
