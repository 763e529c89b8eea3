"""The node side against a real kubelet v1.37: `edl-agent run` on a simulated node serves a real
kubelet (scripts/testnode.py: kubelet with our fake container runtime in a private mount
namespace), which registers it, admits and allocates pods through it, reads health from its
ListAndWatch into the pods' status, and lists allocations on its pod-resources API.

Pods are placed by spec.nodeName (no scheduler here); kubelet admits them, calls
GetPreferredAllocation and Allocate, and hands the answer to the runtime, whose CreateContainer
log the tests read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import testnode
from k8s_test_helpers import KwokCluster
from kubelet_helpers import (
    NodeAgent,
    allocatable,
    created_containers,
    extended,
    gpu_pod,
    logged_at,
    node_agent,
    pod_devices,
    resource_health,
    wait_for,
    wait_phase,
)

from edl_agent.sim import inject

pytestmark = pytest.mark.kubelet

GPU = "nvidia.com/gpu"
StartNode = Callable[..., testnode.Node]
# Kubelet runs beside the control plane on 2 cores: generous, only the slow path waits for them.
STEP = 60.0
KUBELET_RESTARTS = 20


StartAgent = Callable[[testnode.Node, str], NodeAgent]


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[StartAgent]:
    """``start(node, profile)``: an agent serving `node`; every one is stopped afterwards and
    must exit 0 on SIGTERM."""
    started: list[NodeAgent] = []

    def start(node: testnode.Node, profile: str) -> NodeAgent:
        agent = node_agent(node, profile, tmp_path / f"agent-{len(started)}")
        started.append(agent)
        return agent

    yield start
    codes = [agent.stop() for agent in started]
    assert codes == [0] * len(codes), f"agents exited with {codes}"


@pytest.fixture
def gpu_node(
    kubelet_nodes: StartNode, agents: StartAgent, k8s: KwokCluster
) -> tuple[testnode.Node, NodeAgent]:
    """A kubelet node served by an agent on a simulated dgx-h100, all 8 GPUs allocatable, and the
    agent ready (its NVML event loop watching: an XID injected before would be missed)."""
    node = kubelet_nodes()
    agent = agents(node, "dgx-h100")
    wait_for(
        f"{node.name} allocatable {GPU}: 8",
        lambda: allocatable(k8s.core, node.name),
        lambda found: found.get(GPU) == 8,
        timeout=STEP,
        alive=agent.process,
    )
    wait_for(f"agent of {node.name} ready", agent.ready, bool, timeout=STEP, alive=agent.process)
    return node, agent


# --- registration -----------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["dgx-h100", "dgx-a100-mig", "cgpu-v100", "mixed-gpu-npu"])
def test_allocatable_is_what_discover_prints(
    profile: str, kubelet_nodes: StartNode, agents: StartAgent, k8s: KwokCluster
) -> None:
    node = kubelet_nodes()
    agent = agents(node, profile)
    expected = agent.discover()
    assert expected, f"{profile} advertises nothing"
    if profile == "dgx-a100-mig":
        assert any(name.startswith("nvidia.com/mig-") for name in expected), expected
    found = wait_for(
        f"{node.name} allocatable == discover's resources",
        lambda: extended(k8s.core.read_node(node.name).status.allocatable),
        lambda found: found == expected,
        timeout=STEP,
        alive=agent.process,
    )
    assert extended(k8s.core.read_node(node.name).status.capacity) == found
    registered = {e["resource"] for e in agent.entries("registered with kubelet")}
    assert registered == set(expected)
    kubelet_log = node.paths.logs.joinpath("kubelet.log").read_text(errors="replace")
    for resource in expected:
        assert resource in kubelet_log, f"kubelet never logged {resource}"


# --- allocation ---------------------------------------------------------------------------


def test_two_gpus_go_to_the_container_kubelet_lists_and_are_a_close_pair(
    gpu_node: tuple[testnode.Node, NodeAgent], k8s: KwokCluster
) -> None:
    node, agent = gpu_node
    ns, name = k8s.namespace, "two-gpus"
    k8s.core.create_namespaced_pod(ns, gpu_pod(name, node.name, {GPU: "2"}))
    wait_phase(k8s.core, ns, name, "Running", timeout=STEP)

    [created] = created_containers(node, ns, name)
    visible = created["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(visible) == 2
    assert all(uuid.startswith("GPU-") for uuid in visible)
    listed = pod_devices(node, ns, name)["main"][GPU]
    assert sorted(listed) == sorted(visible)
    assert created["annotations"]["edl.io/allocated-devices"].split(",") == visible

    # Kubelet asked for a preference and took it: the pair is on one NUMA node.
    [preferred] = agent.entries("preferred allocation")
    assert sorted(preferred["ids"]) == sorted(visible)
    numa = {d["id"]: d["numa_node"] for d in agent.devices()}
    assert numa[visible[0]] == numa[visible[1]], (visible, numa)


def test_cgpu_memory_and_core_units_come_from_one_physical_gpu(
    kubelet_nodes: StartNode, agents: StartAgent, k8s: KwokCluster
) -> None:
    node = kubelet_nodes()
    agent = agents(node, "cgpu-v100")
    resources = agent.discover()
    memory = next(r for r in resources if r.endswith("_cgpu_memory"))
    core = next(r for r in resources if r.endswith("_cgpu_core"))
    wait_for(
        "cGPU units allocatable",
        lambda: allocatable(k8s.core, node.name),
        lambda found: found.get(memory) == resources[memory],
        timeout=STEP,
        alive=agent.process,
    )
    ns, name = k8s.namespace, "cgpu-share"
    k8s.core.create_namespaced_pod(ns, gpu_pod(name, node.name, {memory: "8", core: "10"}))
    wait_phase(k8s.core, ns, name, "Running", timeout=STEP)

    [created] = created_containers(node, ns, name)
    envs = created["envs"]
    physical = envs["EDL_SHARE_DEVICES"].split(",")
    assert len(physical) == 1, envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == physical[0]
    assert envs["EDL_SHARE_MEMORY_MIB"] == str(8 * 1024)
    assert envs["EDL_SHARE_CORE_PERCENT"] == str(10 * 5)
    listed = pod_devices(node, ns, name)["main"]
    assert len(listed[memory]) == 8
    assert len(listed[core]) == 10


# --- health -------------------------------------------------------------------------------


def test_xid_on_a_held_gpu_reaches_the_pod_status_allocatable_faults_and_metrics(
    gpu_node: tuple[testnode.Node, NodeAgent], k8s: KwokCluster
) -> None:
    node, agent = gpu_node
    ns, name = k8s.namespace, "holder"
    k8s.core.create_namespaced_pod(ns, gpu_pod(name, node.name, {GPU: "1"}))
    wait_phase(k8s.core, ns, name, "Running", timeout=STEP)
    [held] = pod_devices(node, ns, name)["main"][GPU]
    index = next(d["index"] for d in agent.devices() if d["id"] == held)
    pod = wait_for(
        "allocatedResourcesStatus Healthy",
        lambda: k8s.read_pod(name),
        lambda pod: resource_health(pod) == [(GPU, held, "Healthy")],
        timeout=STEP,
    )

    injected = time.time()
    inject.inject_xid(agent.tree, index, 79)
    pod = wait_for(
        "allocatedResourcesStatus Unhealthy",
        lambda: k8s.read_pod(name),
        lambda pod: resource_health(pod) == [(GPU, held, "Unhealthy")],
        timeout=STEP,
    )
    seen_unhealthy = time.time() - injected
    wait_for(
        "allocatable down by one",
        lambda: allocatable(k8s.core, node.name),
        lambda found: found.get(GPU) == 7,
        timeout=STEP,
    )
    assert pod.status.phase == "Running"  # kubelet reports; it does not act

    [fault] = wait_for(
        "the DeviceUnhealthy fault",
        lambda: [e for e in agent.entries("fault observed") if e["kind"] == "DeviceUnhealthy"],
        bool,
        timeout=STEP,
    )
    assert fault["pods"] == [f"{ns}/{name}"]
    assert fault["devices"] == [held]
    assert fault["reason"] == "XID79"

    series = [
        line
        for line in agent.metrics().splitlines()
        if line.startswith("edl_device_") and f'device_id="{held}"' in line
    ]
    attributed = [s for s in series if f'pod="{name}"' in s]
    assert attributed, "\n".join(series)
    assert all(f'namespace="{ns}"' in s and 'container="main"' in s for s in attributed)
    print(f"\nXID 79 -> pod allocatedResourcesStatus Unhealthy: {seen_unhealthy:.2f}s")


def test_more_than_is_healthy_fails_admission(
    gpu_node: tuple[testnode.Node, NodeAgent], k8s: KwokCluster
) -> None:
    node, agent = gpu_node
    inject.inject_xid(agent.tree, 6, 79)
    wait_for(
        "allocatable 7",
        lambda: allocatable(k8s.core, node.name),
        lambda found: found.get(GPU) == 7,
        timeout=STEP,
    )
    ns = k8s.namespace
    k8s.core.create_namespaced_pod(ns, gpu_pod("too-many", node.name, {GPU: "8"}))
    pod = wait_phase(k8s.core, ns, "too-many", "Failed", timeout=STEP)
    assert pod.status.reason in {f"Out{GPU}", "UnexpectedAdmissionError"}, pod.status
    assert created_containers(node, ns, "too-many") == []
    k8s.core.create_namespaced_pod(ns, gpu_pod("seven", node.name, {GPU: "7"}))
    wait_phase(k8s.core, ns, "seven", "Running", timeout=STEP)
    [created] = created_containers(node, ns, "seven")
    unhealthy = next(d["id"] for d in agent.devices() if d["index"] == 6)
    assert unhealthy not in created["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")


# --- restarts -----------------------------------------------------------------------------


def test_kubelet_and_agent_restarts(
    gpu_node: tuple[testnode.Node, NodeAgent], k8s: KwokCluster
) -> None:
    node, agent = gpu_node
    ns, name = k8s.namespace, "keeps-its-gpus"
    k8s.core.create_namespaced_pod(ns, gpu_pod(name, node.name, {GPU: "2"}))
    wait_phase(k8s.core, ns, name, "Running", timeout=STEP)
    held = pod_devices(node, ns, name)
    creates = len(created_containers(node, ns, name))

    rows = []
    for attempt in range(KUBELET_RESTARTS):
        registrations = len(agent.entries("registered with kubelet"))
        began = time.time()
        node.restart_kubelet(timeout=STEP)
        socket_seen = time.time()
        [registered] = wait_for(
            f"registration after kubelet restart {attempt + 1}",
            lambda n=registrations: agent.entries("registered with kubelet")[n:],
            bool,
            timeout=STEP,
            alive=agent.process,
            poll=0.01,
        )
        registered_at = logged_at(registered)
        # A new kubelet lists the resource with no devices until the plugin registers; the Node
        # written after registration with all 8 is the one that counts.
        before = k8s.core.read_node(node.name).metadata.resource_version
        wait_for(
            f"allocatable back after kubelet restart {attempt + 1}",
            lambda: k8s.core.read_node(node.name),
            lambda n, rv=before: (
                n.metadata.resource_version != rv and extended(n.status.allocatable).get(GPU) == 8
            ),
            timeout=STEP,
            poll=0.02,
        )
        back = time.time()
        rows.append((socket_seen - began, registered_at - socket_seen, back - registered_at))
    summary = stats(rows)
    print(f"\nkubelet restarted {KUBELET_RESTARTS} times: {summary}")

    # Right after the last restart kubelet's pod-resources may not list the restored devices yet.
    wait_for(
        "pod-resources lists the pod's GPUs again",
        lambda: pod_devices(node, ns, name),
        lambda found: found == held,
        timeout=STEP,
    )
    assert agent.stop() == 0
    wait_for(
        "kubelet to see the agent gone",
        lambda: allocatable(k8s.core, node.name),
        lambda found: found.get(GPU) == 0,
        timeout=STEP,
    )
    agent.start()
    wait_for(
        "allocatable back after the agent restarted",
        lambda: allocatable(k8s.core, node.name),
        lambda found: found.get(GPU) == 8,
        timeout=STEP,
        alive=agent.process,
    )
    pod = k8s.read_pod(name)
    assert pod.status.phase == "Running"
    assert pod.status.container_statuses[0].restart_count == 0
    assert pod_devices(node, ns, name) == held
    assert len(created_containers(node, ns, name)) == creates


def stats(rows: list[tuple[float, float, float]]) -> str:
    names = ("kubelet restart -> socket", "socket -> registered", "registered -> allocatable")
    parts = []
    for i, label in enumerate(names):
        values = sorted(row[i] for row in rows)
        median = values[len(values) // 2]
        parts.append(f"{label} p50 {median * 1000:.0f} ms max {values[-1] * 1000:.0f} ms")
    return "; ".join(parts)
