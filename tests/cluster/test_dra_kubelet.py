"""DRA against the real kubelet and kube-scheduler v1.37: the agent publishes ResourceSlices,
registers its DRA plugin through kubelet's plugin watcher, the scheduler allocates claims from
the slices (CEL selectors, consumable capacity, device taints), kubelet prepares them through our
plugin and hands the CDI ids to the runtime, and device health reaches the pod's
allocatedResourcesStatus over the health stream.

Claims are made directly (no ResourceClaimTemplate: the session's control plane runs no
controller-manager, which is what turns templates into claims; test_controller_manager.py shows
that on the plane with one).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import KwokCluster
from kube_tools import Kubectl
from kubelet_helpers import (
    NodeAgent,
    allocatable,
    claim_body,
    claim_pod,
    created_containers,
    gpu_pod,
    logged_at,
    node_agent,
    pod_devices,
    wait_for,
    wait_phase,
)
from kubernetes import client
from scheduler import Process, free_port

from edl_agent.devices import names
from edl_agent.dra.prepare import parse_quantity
from edl_agent.sim import inject

pytestmark = pytest.mark.kubelet

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION = "resource.k8s.io", "v1"
GPU_DRIVER = "gpu.nvidia.edl.io"
NPU_DRIVER = "npu.ascend.edl.io"
GPU = "nvidia.com/gpu"
STEP = 60.0
StartNode = Callable[..., testnode.Node]
StartAgent = Callable[..., NodeAgent]


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def device_classes(kubectl: Kubectl, kube_scheduler: Process) -> Iterator[None]:
    """Our DeviceClasses (deploy/dra) and a running scheduler."""
    manifest = str(REPO / "deploy/dra/deviceclasses.yaml")
    kubectl("apply", "-f", manifest)
    yield
    kubectl("delete", "-f", manifest, "--ignore-not-found")


@pytest.fixture
def dra_agents(tmp_path: Path, k8s_control_plane: testcluster.ControlPlane) -> Iterator[StartAgent]:
    """``start(node, profile, *settings)``: an agent serving `node` through DRA with the admin
    kubeconfig; each must exit 0 on SIGTERM."""
    started: list[NodeAgent] = []

    def start(
        node: testnode.Node, profile: str, *settings: str, after: NodeAgent | None = None
    ) -> NodeAgent:
        """`after`: a stopped agent whose tree and directory (state, CDI specs) this one takes."""
        where = after.directory if after is not None else tmp_path / f"agent-{len(started)}"
        extra = [
            f"--kubeconfig={k8s_control_plane.kubeconfig}",
            f"--set=dra.plugins_registry_dir={node.paths.plugins_registry}",
            f"--set=dra.cdi_dir={where / 'cdi'}",
            *(f"--set={s}" for s in settings),
        ]
        if after is None:
            agent = node_agent(node, profile, where, *extra)
        else:
            agent = NodeAgent(node, profile, after.tree, where, free_port(), extra=tuple(extra))
            agent.start()
        started.append(agent)
        return agent

    yield start
    codes = [agent.stop() for agent in started if agent.process and agent.process.alive()]
    assert codes == [0] * len(codes), f"agents exited with {codes}"


@pytest.fixture
def custom(k8s: KwokCluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(k8s.core.api_client)


# --- helpers ------------------------------------------------------------------------------


def node_slices(custom: client.CustomObjectsApi, node: str, driver: str) -> list[dict[str, Any]]:
    listed = custom.list_cluster_custom_object(
        GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return [s for s in listed["items"] if s["spec"]["driver"] == driver]


def slice_devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def claim_ready(claim: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """Device name → (status, reason, message) of its Ready condition in the claim's
    status.devices."""
    found = {}
    for entry in (claim.get("status") or {}).get("devices") or []:
        for condition in entry.get("conditions") or []:
            if condition["type"] == "Ready":
                found[entry["device"]] = (
                    condition["status"],
                    condition["reason"],
                    condition.get("message", ""),
                )
    return found


def wait_slices(
    custom: client.CustomObjectsApi, node: str, driver: str, count: int, agent: NodeAgent
) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = wait_for(
        f"{count} devices of {driver} published for {node}",
        lambda: slice_devices(node_slices(custom, node, driver)),
        lambda devices: len(devices) == count,
        timeout=STEP,
        alive=agent.process,
    )
    return found


def make_claim(
    custom: client.CustomObjectsApi,
    namespace: str,
    name: str,
    device_class: str,
    *,
    count: int = 1,
    selector: str | None = None,
    capacity: dict[str, str] | None = None,
) -> dict[str, Any]:
    body = claim_body(name, device_class, count=count, selector=selector, capacity=capacity)
    created: dict[str, Any] = custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", body
    )
    return created


def read_claim(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "resourceclaims", name
    )
    return found


def allocated(claim: dict[str, Any]) -> list[str]:
    """The device names the scheduler allocated to `claim`."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
    return sorted(r["device"] for r in results.get("results", []))


def cdi_devices(node: testnode.Node, namespace: str, pod: str) -> list[str]:
    [created] = created_containers(node, namespace, pod)
    return sorted(created["cdi_devices"])


def claim_env(cdi_dir: Path, uid: str) -> dict[str, str]:
    spec = json.loads((cdi_dir / f"edl.io-claim-{uid}.json").read_text())
    [device] = spec["devices"]
    return dict(e.split("=", 1) for e in device["containerEdits"]["env"])


def claim_health(pod: Any) -> dict[str, str]:
    """resource id → health of the pod's claim entries in allocatedResourcesStatus."""
    found = {}
    for status in (pod.status and pod.status.container_statuses) or []:
        for resource in status.allocated_resources_status or []:
            if resource.name.startswith("claim:"):
                for device in resource.resources or []:
                    found[device.resource_id] = device.health
    return found


def wait_registered(agent: NodeAgent, driver: str, *, since: float) -> None:
    """Until kubelet confirms the registration of `driver`'s plugin (after `since`, unix time)."""
    wait_for(
        f"kubelet registered {driver}",
        lambda: [
            e
            for e in agent.entries("registered with kubelet")
            if e.get("driver") == driver and logged_at(e) > since
        ],
        bool,
        timeout=STEP,
        alive=agent.process,
    )


def delete_pod_and_wait_unprepared(
    k8s: KwokCluster, agent: NodeAgent, cdi_dir: Path, name: str, uid: str
) -> None:
    """The pod deleted; returns once kubelet's unprepare has run to its end: the claim's CDI spec
    is removed first and its checkpoint record after, so both are waited for."""
    k8s.core.delete_namespaced_pod(name, k8s.namespace, grace_period_seconds=0)
    checkpoint = agent.directory / "state/dra/prepared.json"

    def left() -> tuple[bool, bool]:
        return (cdi_dir / f"edl.io-claim-{uid}.json").exists(), uid in checkpoint.read_text()

    wait_for(
        f"claim {uid} unprepared (its CDI spec and checkpoint record gone)",
        left,
        lambda found: not any(found),
        timeout=STEP,
        alive=agent.process,
    )


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        ("dgx-h100", ["nvidia.serve=dra"], GPU_DRIVER),
        ("dgx-a100-mig", ["nvidia.serve=dra", "nvidia.mig_strategy=mixed"], GPU_DRIVER),
        ("cgpu-v100", ["nvidia.serve=dra"], GPU_DRIVER),
        ("mixed-gpu-npu", ["nvidia.serve=dra", "ascend.serve=dra"], NPU_DRIVER),
    ],
)
def test_published_slices_are_what_discover_finds(
    case: tuple[str, list[str], str],
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    custom: client.CustomObjectsApi,
) -> None:
    profile, settings, driver = case
    node = kubelet_nodes()
    agent = dra_agents(node, profile, *settings)
    discovered = agent.devices()
    vendor = names.vendor_of_driver(driver)
    assert vendor is not None
    by_id = {d["id"]: d for d in discovered}
    mig = any(d["kind"] == "mig" for d in discovered)
    expected = {
        d["id"]
        for d in discovered
        if d["vendor"] == vendor.value
        and not (mig and d["kind"] == "gpu" and any(m.get("parent") == d["id"] for m in discovered))
    }
    devices = wait_slices(custom, node.name, driver, len(expected), agent)
    assert {d["attributes"]["id"]["string"] for d in devices.values()} == expected
    for name, device in devices.items():
        found = by_id[device["attributes"]["id"]["string"]]
        assert device["attributes"]["product"]["string"] == found["product"]
        assert device["attributes"]["kind"]["string"] == found["kind"]
        memory = parse_quantity(device["capacity"]["memory"]["value"])
        assert memory == found["memory_mib"] * 2**20, name
    wait_registered(agent, driver, since=0.0)


def test_a_claim_with_a_cel_selector_gets_two_gpus_through_the_scheduler_and_cdi(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    device_classes: None,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    node = kubelet_nodes()
    agent = dra_agents(node, "dgx-h100", "nvidia.serve=dra")
    devices = wait_slices(custom, node.name, GPU_DRIVER, 8, agent)
    product = next(iter(devices.values()))["attributes"]["product"]["string"]
    ns = k8s.namespace
    claim = make_claim(
        custom,
        ns,
        "two-gpus",
        GPU_DRIVER,
        count=2,
        selector=f"device.attributes['{GPU_DRIVER}'].product == '{product}'",
    )
    k8s.core.create_namespaced_pod(ns, claim_pod("trainer", "two-gpus"))
    pod = wait_phase(k8s.core, ns, "trainer", "Running", timeout=STEP)
    assert pod.spec.node_name == node.name  # the scheduler found the node through the slices

    chosen = allocated(read_claim(custom, ns, "two-gpus"))
    assert len(chosen) == 2
    uid = claim["metadata"]["uid"]
    assert cdi_devices(node, ns, "trainer") == sorted(
        [*(f"nvidia.edl.io/gpu={name}" for name in chosen), f"claim.edl.io/env=claim-{uid}"]
    )
    cdi_dir = agent.directory / "cdi"
    uuids = {devices[name]["attributes"]["id"]["string"] for name in chosen}
    env = claim_env(cdi_dir, uid)
    assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == uuids
    assert env["EDL_CLAIM_UID"] == uid
    static = json.loads((cdi_dir / "edl.io-nvidia.json").read_text())
    assert {d["name"] for d in static["devices"]} == set(devices)

    delete_pod_and_wait_unprepared(k8s, agent, cdi_dir, "trainer", uid)


def test_an_xid_taints_the_device_shows_in_the_pod_and_keeps_new_claims_off_until_it_clears(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    device_classes: None,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    node = kubelet_nodes()
    agent = dra_agents(
        node,
        "dgx-h100",
        "nvidia.serve=dra",
        "health.xid_clears_by={'48': quiet}",
        "health.quiet_seconds=8",
    )
    devices = wait_slices(custom, node.name, GPU_DRIVER, 8, agent)
    ns = k8s.namespace
    make_claim(custom, ns, "held", GPU_DRIVER, count=2)
    k8s.core.create_namespaced_pod(ns, claim_pod("holder", "held"))
    wait_phase(k8s.core, ns, "holder", "Running", timeout=STEP)
    held = allocated(read_claim(custom, ns, "held"))
    free = sorted(set(devices) - set(held))
    index = {name: int(d["attributes"]["index"]["int"]) for name, d in devices.items()}

    # The claim tells its devices' health too (status.devices, written by the agent).
    def wait_claim_ready(what: str) -> None:
        wait_for(
            what,
            lambda: claim_ready(read_claim(custom, ns, "held")),
            lambda ready: {d: c[0] for d, c in ready.items()} == dict.fromkeys(held, "True"),
            timeout=STEP,
            alive=agent.process,
        )

    wait_claim_ready("the claim's devices Ready")

    inject.inject_xid(agent.tree, index[held[0]], 48)  # on a GPU the pod holds
    inject.inject_xid(agent.tree, index[free[0]], 48)  # and on a free one
    tainted = wait_for(
        "both GPUs tainted in the slice",
        lambda: slice_devices(node_slices(custom, node.name, GPU_DRIVER)),
        lambda found: all(found[n].get("taints") for n in (held[0], free[0])),
        timeout=STEP,
        alive=agent.process,
    )
    [taint] = tainted[held[0]]["taints"]
    assert (taint["key"], taint["effect"]) == ("edl.io/unhealthy", "NoSchedule")
    assert not tainted[held[1]].get("taints")
    wait_for(
        "the holder's allocatedResourcesStatus shows its GPU Unhealthy",
        lambda: claim_health(k8s.core.read_namespaced_pod("holder", ns)),
        lambda health: any(h == "Unhealthy" and held[0] in r for r, h in health.items()),
        timeout=STEP,
        alive=agent.process,
    )

    ready = wait_for(
        "the claim's status to show the GPU not Ready",
        lambda: claim_ready(read_claim(custom, ns, "held")),
        lambda found: found[held[0]][0] == "False",
        timeout=STEP,
        alive=agent.process,
    )
    assert ready[held[0]][1] == "DeviceUnhealthy", ready
    assert "XID48" in ready[held[0]][2], ready  # the reason the agent gives the device
    assert ready[held[1]][0] == "True"

    holder_gpu = devices[held[0]]["attributes"]["id"]["string"]
    faults = [
        e
        for e in agent.entries("fault observed")
        if e.get("kind") == "DeviceUnhealthy" and e.get("devices") == [holder_gpu]
    ]
    assert [f["pods"] for f in faults] == [[f"{ns}/holder"]]  # the claim's pod, through kubelet

    # Six GPUs are free, one of them tainted: a claim for six waits until the taint goes.
    make_claim(custom, ns, "six", GPU_DRIVER, count=6)
    k8s.core.create_namespaced_pod(ns, claim_pod("six", "six"))
    pending = wait_for(
        "the scheduler to find no room for six GPUs while one is tainted",
        lambda: k8s.core.read_namespaced_pod("six", ns),
        lambda pod: any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in pod.status.conditions or ()
        ),
        timeout=STEP,
    )
    assert pending.status.phase == "Pending"
    assert allocated(read_claim(custom, ns, "six")) == []
    wait_phase(k8s.core, ns, "six", "Running", timeout=STEP)  # the quiet period ended
    assert allocated(read_claim(custom, ns, "six")) == free
    untainted = slice_devices(node_slices(custom, node.name, GPU_DRIVER))
    assert not untainted[free[0]].get("taints")
    wait_claim_ready("the claim's devices Ready again")


def test_an_npu_claim_on_a_mixed_node(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    device_classes: None,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    node = kubelet_nodes()
    agent = dra_agents(node, "mixed-gpu-npu", "ascend.serve=dra")
    npus = wait_slices(custom, node.name, NPU_DRIVER, 4, agent)
    ns = k8s.namespace
    claim = make_claim(custom, ns, "one-npu", NPU_DRIVER)
    k8s.core.create_namespaced_pod(ns, claim_pod("npu-job", "one-npu"))
    wait_phase(k8s.core, ns, "npu-job", "Running", timeout=STEP)
    [name] = allocated(read_claim(custom, ns, "one-npu"))
    uid = claim["metadata"]["uid"]
    assert cdi_devices(node, ns, "npu-job") == sorted(
        [f"ascend.edl.io/npu={name}", f"claim.edl.io/env=claim-{uid}"]
    )
    env = claim_env(agent.directory / "cdi", uid)
    assert env["ASCEND_VISIBLE_DEVICES"] == str(npus[name]["attributes"]["index"]["int"])
    delete_pod_and_wait_unprepared(k8s, agent, agent.directory / "cdi", "npu-job", uid)


def test_two_claims_share_one_cgpu_by_memory(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    device_classes: None,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    """Consumable capacity: two claims of 16 GiB on a node whose selector allows one V100 only
    both land on it, each told its share."""
    node = kubelet_nodes()
    agent = dra_agents(node, "cgpu-v100", "nvidia.serve=dra")
    devices = wait_slices(custom, node.name, GPU_DRIVER, 8, agent)
    assert all(d.get("allowMultipleAllocations") for d in devices.values())
    ns = k8s.namespace
    uids = []
    for i in range(2):
        claim = make_claim(
            custom,
            ns,
            f"share-{i}",
            GPU_DRIVER,
            selector=f"device.attributes['{GPU_DRIVER}'].index == 3",
            capacity={"memory": "16Gi"},
        )
        uids.append(claim["metadata"]["uid"])
        k8s.core.create_namespaced_pod(ns, claim_pod(f"share-{i}", f"share-{i}"))
        # One after the other: kube-scheduler 1.37 may find no room for the second while the
        # first one's allocation is still in flight, and nothing requeues it for minutes.
        wait_phase(k8s.core, ns, f"share-{i}", "Running", timeout=STEP)
    for i in range(2):
        assert allocated(read_claim(custom, ns, f"share-{i}")) == ["gpu-3"]
        env = claim_env(agent.directory / "cdi", uids[i])
        assert env["EDL_SHARE_MEMORY_MIB"] == "16384"
    for i in range(2):
        delete_pod_and_wait_unprepared(k8s, agent, agent.directory / "cdi", f"share-{i}", uids[i])


def test_prepared_claims_survive_an_agent_restart_and_kubelet_restarts_re_register(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    device_classes: None,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    node = kubelet_nodes()
    first = dra_agents(node, "dgx-h100", "nvidia.serve=dra")
    directory = first.directory
    wait_slices(custom, node.name, GPU_DRIVER, 8, first)
    ns = k8s.namespace
    claim = make_claim(custom, ns, "kept", GPU_DRIVER, count=1)
    uid = claim["metadata"]["uid"]
    k8s.core.create_namespaced_pod(ns, claim_pod("kept", "kept"))
    wait_phase(k8s.core, ns, "kept", "Running", timeout=STEP)
    assert first.stop() == 0

    started = time.time()
    second = dra_agents(node, "dgx-h100", "nvidia.serve=dra", after=first)
    wait_registered(second, GPU_DRIVER, since=started)
    restarted = time.time()
    node.restart_kubelet()
    wait_registered(second, GPU_DRIVER, since=restarted)
    assert uid in (directory / "state/dra/prepared.json").read_text()
    delete_pod_and_wait_unprepared(k8s, second, directory / "cdi", "kept", uid)
    # Both agents write one log: the claim was prepared once, by the first.
    prepared = [e for e in second.entries("claim prepared") if e.get("uid") == uid]
    assert len(prepared) == 1
    assert logged_at(prepared[0]) < started


def test_served_both_ways_no_gpu_goes_to_a_device_plugin_pod_and_a_claim(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    device_classes: None,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    """A migration: the device plugin's pod holds six GPUs, so the slices taint them and a claim
    for three cannot be placed; a claim for two gets the other two, and kubelet's device-plugin
    side then has none left to give."""
    node = kubelet_nodes()
    agent = dra_agents(node, "dgx-h100", "nvidia.serve=both")
    wait_slices(custom, node.name, GPU_DRIVER, 8, agent)
    wait_for(
        "allocatable nvidia.com/gpu: 8",
        lambda: allocatable(k8s.core, node.name).get(GPU),
        lambda count: count == 8,
        timeout=STEP,
        alive=agent.process,
    )
    ns = k8s.namespace
    k8s.core.create_namespaced_pod(ns, gpu_pod("plugin-pod", node.name, {GPU: "6"}))
    wait_phase(k8s.core, ns, "plugin-pod", "Running", timeout=STEP)
    held = set(pod_devices(node, ns, "plugin-pod")["main"][GPU])
    tainted = wait_for(
        "the six GPUs the device plugin gave out tainted in the slice",
        lambda: {
            d["attributes"]["id"]["string"]
            for d in slice_devices(node_slices(custom, node.name, GPU_DRIVER)).values()
            if any(t["key"] == "edl.io/device-plugin" for t in d.get("taints", []))
        },
        lambda found: found == held,
        timeout=STEP,
        alive=agent.process,
    )
    assert len(tainted) == 6

    make_claim(custom, ns, "three", GPU_DRIVER, count=3)
    k8s.core.create_namespaced_pod(ns, claim_pod("three", "three"))
    make_claim(custom, ns, "two", GPU_DRIVER, count=2)
    k8s.core.create_namespaced_pod(ns, claim_pod("two", "two"))
    wait_phase(k8s.core, ns, "two", "Running", timeout=STEP)
    claimed = allocated(read_claim(custom, ns, "two"))
    devices = slice_devices(node_slices(custom, node.name, GPU_DRIVER))
    assert not {devices[n]["attributes"]["id"]["string"] for n in claimed} & held
    assert k8s.core.read_namespaced_pod("three", ns).status.phase == "Pending"
    wait_for(
        "allocatable nvidia.com/gpu: 6 (the claimed two are withheld)",
        lambda: allocatable(k8s.core, node.name).get(GPU),
        lambda count: count == 6,
        timeout=STEP,
        alive=agent.process,
    )
    k8s.core.create_namespaced_pod(ns, gpu_pod("one-more", node.name, {GPU: "1"}))
    pod = wait_for(
        "kubelet refuses a device-plugin pod: no GPU is left for it",
        lambda: k8s.core.read_namespaced_pod("one-more", ns),
        lambda found: found.status.phase == "Failed",
        timeout=STEP,
        alive=agent.process,
    )
    assert pod.status.reason in {"UnexpectedAdmissionError", "OutOfnvidia.com/gpu"}, pod.status


def test_a_vendor_switched_back_to_the_device_plugin_leaves_no_slices(
    kubelet_nodes: StartNode,
    dra_agents: StartAgent,
    custom: client.CustomObjectsApi,
    k8s: KwokCluster,
) -> None:
    node = kubelet_nodes()
    first = dra_agents(node, "dgx-h100", "nvidia.serve=dra")
    wait_slices(custom, node.name, GPU_DRIVER, 8, first)
    assert allocatable(k8s.core, node.name).get(GPU, 0) == 0
    assert first.stop() == 0
    second = dra_agents(node, "dgx-h100", "nvidia.serve=device-plugin", after=first)
    wait_for(
        f"{node.name}'s slices removed",
        lambda: node_slices(custom, node.name, GPU_DRIVER),
        lambda slices: slices == [],
        timeout=STEP,
        alive=second.process,
    )
    wait_for(
        "allocatable nvidia.com/gpu: 8",
        lambda: allocatable(k8s.core, node.name).get(GPU),
        lambda count: count == 8,
        timeout=STEP,
        alive=second.process,
    )
