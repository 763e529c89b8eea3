"""deploy/dra's examples as shipped: each file (a ResourceClaimTemplate and a pod) created as it
is, on the plane with kube-controller-manager (its resourceclaim controller makes the pod's claim
from the template), kube-scheduler (allocates it from the agent's slices) and a real kubelet
v1.37 (prepares it through the agent's DRA plugin and hands the CDI ids to the runtime), one
simulated node of the hardware the example asks for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import testcluster
import testnode
import yaml
from k8s_test_helpers import KwokCluster
from kubelet_helpers import NodeAgent, created_containers, wait_for
from kubernetes import client
from scheduler import Process
from test_device_taint_rule import device_classes, dra_agent_on
from test_dra_kubelet import GROUP, VERSION, allocated, node_slices, read_claim
from test_training import managed_scheduler

from edl_agent.devices import names
from edl_agent.devices.model import Vendor

__all__ = ["device_classes", "managed_scheduler"]

pytestmark = pytest.mark.kubelet

DRA = Path(__file__).resolve().parents[2] / "deploy/dra"
STEP = 90.0
# example → (the simulated node it needs, the vendor served through DRA, devices it gets)
EXAMPLES = {
    "example-nvidia-gpu.yaml": ("dgx-h100", Vendor.NVIDIA, 1),
    "example-nvidia-mig.yaml": ("dgx-a100-mig", Vendor.NVIDIA, 2),
    "example-nvidia-share.yaml": ("cgpu-v100", Vendor.NVIDIA, 1),
    "example-ascend-npu.yaml": ("ascend-910bx8", Vendor.ASCEND, 8),
    "example-hygon-dcu.yaml": ("hygon-k100x8", Vendor.HYGON, 1),
    "example-kunlunxin-xpu.yaml": ("kunlun-p800x8", Vendor.KUNLUNXIN, 2),
}


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in DRA.glob("example-*.yaml")) == sorted(EXAMPLES)


@pytest.fixture
def agents(
    k8s_managed_plane: testcluster.ControlPlane, tmp_path: Path
) -> Iterator[list[NodeAgent]]:
    started: list[NodeAgent] = []
    yield started
    codes = [a.stop() for a in started if a.process is not None and a.process.alive()]
    assert codes == [0] * len(codes), f"agents exited with {codes}"


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_example_runs_as_shipped(  # noqa: PLR0917 - fixtures
    example: str,
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    managed_scheduler: Process,
    device_classes: None,
    agents: list[NodeAgent],
    tmp_path: Path,
) -> None:
    profile, vendor, count = EXAMPLES[example]
    node = managed_kubelet_nodes()
    agent = dra_agent_on(k8s_managed_plane, node, profile, tmp_path / "agent", vendor.value)
    agents.append(agent)
    custom = client.CustomObjectsApi(k8s_managed.api)
    driver = names.driver_name(vendor)
    wait_for(
        f"{driver}'s slices of {node.name}",
        lambda: node_slices(custom, node.name, driver),
        bool,
        timeout=STEP,
        alive=agent.process,
    )
    ns = k8s_managed.namespace
    docs = list(yaml.safe_load_all((DRA / example).read_text()))
    [template] = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    [pod] = [d for d in docs if d["kind"] == "Pod"]
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaimtemplates", template)
    k8s_managed.core.create_namespaced_pod(ns, pod)

    name = pod["metadata"]["name"]
    placed = wait_for(
        f"{name} running on {node.name} with its claim",
        lambda: k8s_managed.core.read_namespaced_pod(name, ns),
        lambda p: p.status.phase in {"Running", "Succeeded"} and p.status.resource_claim_statuses,
        timeout=STEP,
        alive=agent.process,
    )
    assert placed.spec.node_name == node.name
    [entry] = placed.status.resource_claim_statuses
    claim = read_claim(custom, ns, entry.resource_claim_name)
    assert claim["metadata"]["ownerReferences"][0]["name"] == name, "made from the template"
    assert len(allocated(claim)) == count
    [created] = created_containers(node, ns, name)
    assert f"claim.edl.io/env=claim-{claim['metadata']['uid']}" in created["cdi_devices"]
