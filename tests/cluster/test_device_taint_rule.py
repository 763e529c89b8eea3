"""An operator's DeviceTaintRule beside the agent's own device taints, with kube-scheduler,
kube-controller-manager (its device-taint-eviction controller) and a real kubelet v1.37: the
shipped example (deploy/examples/device-taint-rule.yaml, its pool set to the test's node) evicts
the pod whose claim holds one of the node's GPUs and keeps new claims off; the agent's taint on a
GPU that faulted stays in its ResourceSlice throughout, and still keeps claims off that GPU once
the rule is gone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
import yaml
from k8s_test_helpers import KwokCluster
from kubelet_helpers import NodeAgent, claim_pod, node_agent, wait_for, wait_phase
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from scheduler import Process
from test_dra_kubelet import (
    GPU_DRIVER,
    GROUP,
    VERSION,
    allocated,
    make_claim,
    node_slices,
    read_claim,
    slice_devices,
    wait_slices,
)
from test_training import managed_scheduler

from edl_agent.sim import inject

__all__ = ["managed_scheduler"]

pytestmark = pytest.mark.kubelet

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy/examples/device-taint-rule.yaml"
CLASSES = REPO / "deploy/dra/deviceclasses.yaml"
OUR_TAINT = "edl.io/unhealthy"
STEP = 90.0


@pytest.fixture
def device_classes(k8s_managed: KwokCluster) -> Iterator[None]:
    custom = client.CustomObjectsApi(k8s_managed.api)
    made = []
    for body in yaml.safe_load_all(CLASSES.read_text()):
        try:
            custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", body)
            made.append(body["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 409:  # already there: made by an earlier test of the module
                raise
    yield
    for name in made:
        custom.delete_cluster_custom_object(GROUP, VERSION, "deviceclasses", name)


def dra_agent_on(
    plane: testcluster.ControlPlane, node: testnode.Node, profile: str, directory: Path, vendor: str
) -> NodeAgent:
    """An agent on `node` (simulated `profile`) serving `vendor` through DRA, with the admin
    kubeconfig of `plane`."""
    return node_agent(
        node,
        profile,
        directory,
        f"--kubeconfig={plane.kubeconfig}",
        f"--set=dra.plugins_registry_dir={node.paths.plugins_registry}",
        f"--set=dra.cdi_dir={directory / 'cdi'}",
        f"--set={vendor}.serve=dra",
    )


@pytest.fixture
def dra_agent(
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    tmp_path: Path,
) -> Iterator[NodeAgent]:
    agent = dra_agent_on(
        k8s_managed_plane, managed_kubelet_nodes(), "dgx-h100", tmp_path / "agent", "nvidia"
    )
    yield agent
    if agent.process is not None and agent.process.alive():
        assert agent.stop() == 0


def rule_for(pool: str) -> dict[str, Any]:
    [body] = list(yaml.safe_load_all(EXAMPLE.read_text()))
    assert body["spec"]["deviceSelector"]["pool"] == "gpu-node-1", "the example's placeholder"
    body["spec"]["deviceSelector"]["pool"] = pool
    body["metadata"]["name"] = f"drain-{pool}"
    return dict(body)


def test_an_operator_s_rule_drains_a_node_s_gpus_beside_the_agent_s_taints(
    k8s_managed: KwokCluster,
    managed_scheduler: Process,
    device_classes: None,
    dra_agent: NodeAgent,
) -> None:
    k8s, agent = k8s_managed, dra_agent
    node, ns = agent.node.name, k8s.namespace
    custom = client.CustomObjectsApi(k8s.api)
    devices = wait_slices(custom, node, GPU_DRIVER, 8, agent)
    index = {name: int(d["attributes"]["index"]["int"]) for name, d in devices.items()}
    make_claim(custom, ns, "held", GPU_DRIVER)
    k8s.core.create_namespaced_pod(ns, claim_pod("holder", "held"))
    wait_phase(k8s.core, ns, "holder", "Running", timeout=STEP)
    [held] = allocated(read_claim(custom, ns, "held"))
    faulty = next(name for name in sorted(devices) if name != held)

    inject.inject_xid(agent.tree, index[faulty], 79)  # the agent's own taint on another GPU
    wait_for(
        f"the agent's taint on {faulty}",
        lambda: slice_devices(node_slices(custom, node, GPU_DRIVER))[faulty].get("taints") or [],
        lambda taints: [t["key"] for t in taints] == [OUR_TAINT],
        timeout=STEP,
        alive=agent.process,
    )

    rule = rule_for(node)
    name = rule["metadata"]["name"]
    custom.create_cluster_custom_object(GROUP, VERSION, "devicetaintrules", rule)
    try:
        evicted = wait_for(
            "the holder evicted by the rule",
            lambda: _pod_or_none(k8s, "holder"),
            lambda pod: pod is None or pod.metadata.deletion_timestamp is not None,
            timeout=STEP,
            alive=agent.process,
        )
        if evicted is not None:  # still there, terminating: it says who deleted it and why
            reasons = [
                c.reason for c in evicted.status.conditions or [] if c.type == "DisruptionTarget"
            ]
            assert reasons == ["DeletionByDeviceTaintManager"], reasons
        wait_for(
            "the rule's EvictionInProgress condition",
            lambda: custom.get_cluster_custom_object(GROUP, VERSION, "devicetaintrules", name),
            lambda body: any(
                c["type"] == "EvictionInProgress"
                for c in (body.get("status") or {}).get("conditions") or []
            ),
            timeout=STEP,
        )
        # New claims wait while the rule stands; the slices never carry its taint.
        make_claim(custom, ns, "next", GPU_DRIVER)
        k8s.core.create_namespaced_pod(ns, claim_pod("next", "next"))
        wait_for(
            "the scheduler to find no untainted GPU",
            lambda: k8s.core.read_namespaced_pod("next", ns),
            lambda pod: any(
                c.type == "PodScheduled" and c.status == "False"
                for c in (pod.status and pod.status.conditions) or []
            ),
            timeout=STEP,
        )
        assert allocated(read_claim(custom, ns, "next")) == []
        in_slices = slice_devices(node_slices(custom, node, GPU_DRIVER))
        assert {t["key"] for d in in_slices.values() for t in d.get("taints") or []} == {OUR_TAINT}
    finally:
        custom.delete_cluster_custom_object(GROUP, VERSION, "devicetaintrules", name)

    wait_phase(k8s.core, ns, "next", "Running", timeout=STEP)
    assert allocated(read_claim(custom, ns, "next")) != [faulty], "the agent's taint still holds"
    taints = slice_devices(node_slices(custom, node, GPU_DRIVER))[faulty].get("taints") or []
    assert [t["key"] for t in taints] == [OUR_TAINT]


def _pod_or_none(k8s: KwokCluster, name: str) -> Any:
    try:
        return k8s.read_pod(name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
