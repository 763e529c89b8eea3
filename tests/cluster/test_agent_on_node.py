"""The whole agent on a simulated dgx-h100 serving a real kubelet node: labels, the condition and
events follow injected faults, and the cordon annotation reaches kubelet (the device turns
Unhealthy in ListAndWatch, so kubelet's allocatable drops) — all written with the agent's
pod-bound service-account token under deploy/daemonset's RBAC."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import testnode
from k8s_test_helpers import KwokCluster, wait_for
from kube_tools import Kubectl
from kubelet_helpers import extended
from test_node_labels import Agent as NodeAgent
from test_node_labels import agent_view

from edl_agent.agent import Agent
from edl_agent.config import load_settings
from edl_agent.labels.condition import CONDITION_TYPE
from edl_agent.labels.cordon import CORDONED_DEVICES, RELEASE_DEVICES
from edl_agent.sim import inject
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

MERGE = "application/merge-patch+json"
GPU = "nvidia.com/gpu"
pytestmark = pytest.mark.kubelet


@pytest.fixture
def running(
    k8s: KwokCluster, kubelet_nodes: Callable[..., testnode.Node], tmp_path: Path
) -> Iterator[tuple[Agent, NodeAgent, Path]]:
    kubelet = kubelet_nodes()
    with agent_view(k8s, kubelet.name) as agent:
        yield from _run_agent(agent, kubelet, tmp_path)


def _run_agent(
    agent: NodeAgent, kubelet: testnode.Node, tmp_path: Path
) -> Iterator[tuple[Agent, NodeAgent, Path]]:
    tree = tmp_path / "node"
    build_tree(load_profile("dgx-h100"), tree)
    settings = load_settings(
        overrides={
            "host_root": str(tree),
            "node_name": agent.node,
            "metrics_addr": "",
            "plugin": {"kubelet_dir": str(kubelet.paths.device_plugins)},
            "pod_resources_socket": str(kubelet.paths.pod_resources),
            "faults": {"state_dir": str(tmp_path / "state")},
        }
    )
    node_agent = Agent.discover(settings)
    node_agent.start_publisher(agent.api)
    thread = threading.Thread(target=node_agent.run)
    thread.start()
    try:
        wait_for("8 GPUs allocatable", agent.read, lambda n: allocatable(n) == 8, timeout=60)
        yield node_agent, agent, tree
    finally:
        node_agent.stop.set()
        thread.join(timeout=20)


def allocatable(node: Any) -> int | None:
    return extended(node.status.allocatable).get(GPU)


def labels_of(node: Any) -> dict[str, str]:
    return dict(node.metadata.labels or {})


def status_of(node: Any) -> str | None:
    condition = condition_of(node)
    return None if condition is None else str(condition.status)


def condition_of(node: Any) -> Any:
    return next((c for c in node.status.conditions or [] if c.type == CONDITION_TYPE), None)


def test_labels_condition_events_cordon_and_release(
    running: tuple[Agent, NodeAgent, Path], kubectl: Kubectl
) -> None:
    node_agent, view, tree = running
    ids = list(node_agent.state.snapshot().resources["nvidia.com/gpu"].device_ids)

    node = wait_for("labels", view.read, lambda n: labels_of(n).get("nvidia.com/gpu.count") == "8")
    assert labels_of(node)["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels_of(node)["edl.io/nvidia.healthy"] == "8"
    wait_for("condition True", view.read, lambda n: status_of(n) == "True")

    inject.inject_xid(tree, 3, 79)
    node = wait_for("condition False", view.read, lambda n: status_of(n) == "False")
    assert condition_of(node).reason == "XID79"
    assert ids[3] in condition_of(node).message
    wait_for("healthy count", view.read, lambda n: labels_of(n)["edl.io/nvidia.healthy"] == "7")
    wait_for("kubelet: 7 allocatable", view.read, lambda n: allocatable(n) == 7)
    warnings = wait_for(
        "a Warning event",
        view.events,
        lambda events: any(e.type == "Warning" and ids[3] in e.message for e in events),
    )
    assert any(e.reason == "AcceleratorUnhealthy" for e in warnings)

    view.admin.core.patch_node(
        view.node,
        {"metadata": {"annotations": {CORDONED_DEVICES: "nvidia:2"}}},
        _content_type=MERGE,
    )
    wait_for(
        "GPU 2 cordoned",
        node_agent.state.snapshot,
        lambda snapshot: snapshot.is_unhealthy(ids[2]),
    )
    wait_for("kubelet: 6 allocatable", view.read, lambda n: allocatable(n) == 6)
    wait_for("healthy count", view.read, lambda n: labels_of(n)["edl.io/nvidia.healthy"] == "6")
    view.admin.core.patch_node(
        view.node, {"metadata": {"annotations": {CORDONED_DEVICES: None}}}, _content_type=MERGE
    )
    wait_for(
        "GPU 2 released",
        node_agent.state.snapshot,
        lambda snapshot: not snapshot.is_unhealthy(ids[2]),
    )
    wait_for("kubelet: 7 allocatable again", view.read, lambda n: allocatable(n) == 7)

    # XID 79 waits for a reboot; an operator releases GPU 3 with kubectl alone. The agent ends
    # the quarantine and removes the annotation through its own token (the admission policy
    # lets it remove this annotation, nothing else of the operator's).
    assert node_agent.unhealthy()[ids[3]].clears_by.value == "reboot"
    kubectl("annotate", "node", view.node, f"{RELEASE_DEVICES}=nvidia:3")
    wait_for("kubelet: 8 allocatable", view.read, lambda n: allocatable(n) == 8)
    node = wait_for("condition True", view.read, lambda n: status_of(n) == "True")
    wait_for(
        "the annotation removed by the agent",
        view.read,
        lambda n: RELEASE_DEVICES not in (n.metadata.annotations or {}),
    )
    assert labels_of(node)["edl.io/nvidia.healthy"] == "8"
    wait_for(
        "a Normal AcceleratorReleased event",
        view.events,
        lambda events: any(
            e.reason == "AcceleratorReleased" and ids[3] in e.message for e in events
        ),
    )
    inject.inject_xid(tree, 3, 79)  # a later fault quarantines again
    wait_for("kubelet: 7 allocatable", view.read, lambda n: allocatable(n) == 7)
