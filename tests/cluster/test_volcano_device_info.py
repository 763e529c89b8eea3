"""The ConfigMap Volcano's Ascend scheduling reads, on a real API server: the agent's writer
creates `kube-system/mindx-dl-deviceinfo-<node>` with its pod-bound token and the agent's access
as deploy/volcano renders it (deploy/daemonset's, a Role in kube-system, the admission policies),
replaces it on a fault with a CheckCode that matches, and that token is refused every other
ConfigMap. The writer also sets the Node's `baseDeviceInfos` annotation, which the overlay's node
policy allows and deploy/daemonset's alone refuses."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_test_helpers import KwokCluster, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from manifests import kustomized
from test_node_labels import FORBIDDEN, install_manifest, pod_bound_token, sa_client, status_of

from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.health.model import Level
from edl_agent.health.state import DeviceState
from edl_agent.health.tracker import Condition
from edl_agent.kube import ApiError, KubeApi
from edl_agent.labels.volcano_deviceinfo import configmap, configmap_data, npu_report
from edl_agent.labels.volcano_writer import VolcanoDeviceInfo
from tests.parts import supervised

pytestmark = pytest.mark.cluster

VOLCANO = Path(__file__).resolve().parents[2] / "deploy" / "volcano"
ACCESS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} | {
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
SYSTEM = "kube-system"
PREFIX = "mindx-dl-deviceinfo-"


@dataclass
class Npus:
    """The agent's side: its node, its API client with the pod-bound token, a device state with
    eight Ascend 910 NPUs and the conditions the hub would show."""

    node: str
    api: KubeApi
    core: client.CoreV1Api
    state: DeviceState
    conditions: dict[str, Condition]
    admin: KwokCluster

    def read(self, node: str | None = None) -> Any:
        return self.admin.core.read_namespaced_config_map(PREFIX + (node or self.node), SYSTEM)


def npu(i: int) -> Device:
    return Device(Vendor.ASCEND, "npu", i, f"ascend-npu{i}", "Ascend910B3", 65536)


def body_for(node: str) -> dict[str, Any]:
    report = npu_report(devices=[npu(0)], unhealthy=set(), conditions={})
    assert report is not None
    return configmap(node, configmap_data(report, update_time=1, wall_offset=0.0))


def delete_quietly(core: client.CoreV1Api, name: str) -> None:
    try:
        core.delete_namespaced_config_map(name, SYSTEM)
    except ApiException as exc:
        if exc.status != 404:
            raise


def agent_access(folder: Path) -> Path:
    """The agent's RBAC and admission policies as `kubectl kustomize deploy/volcano` renders
    them, in one file for `install_manifest`."""
    docs = [
        doc
        for doc in kustomized(VOLCANO)
        if doc["kind"] in ACCESS and doc["metadata"]["name"].startswith("edl-agent")
    ]
    path = folder / "agent-volcano-access.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


@pytest.fixture
def npus(k8s: KwokCluster, tmp_path: Path) -> Iterator[Npus]:
    node = k8s.create_gpu_node(wait_ready=False).metadata.name
    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    k8s.create_service_account("edl-agent")
    undo = install_manifest(k8s, agent_access(tmp_path))
    api = sa_client(k8s.api, pod_bound_token(k8s, node))
    core = client.CoreV1Api(api)

    def policy_denies_another_node() -> bool:
        try:
            core.create_namespaced_config_map(SYSTEM, body_for(other), dry_run="All")
        except ApiException as exc:
            return exc.status == FORBIDDEN and "may only write the ConfigMap" in status_of(exc)[1]
        return False

    def node_policy_denies_another_node() -> bool:
        patch = {"metadata": {"annotations": {"baseDeviceInfos": "{}"}}}
        try:
            core.patch_node(other, patch, dry_run="All")
        except ApiException as exc:
            return exc.status == FORBIDDEN and "may only change the node" in status_of(exc)[1]
        return False

    # RBAC and admission policies reach the API server's caches a moment after creation.
    wait_for("the admission policy to apply", policy_denies_another_node, bool, timeout=30)
    wait_for("the node policy to apply", node_policy_denies_another_node, bool, timeout=30)
    inventory = Inventory(node, (VendorReport(Vendor.ASCEND, tuple(npu(i) for i in range(8))),), ())
    kube = KubeApi(api)
    state = DeviceState(inventory)
    try:
        yield Npus(node, kube, core, state, {}, k8s)
    finally:
        state.close()
        kube.close()
        for name in (PREFIX + node, PREFIX + other):
            delete_quietly(k8s.core, name)
        for action in undo:
            action()


def device_info(configmap: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(configmap.data["DeviceInfoCfg"])
    return cfg


def check_code_matches(cfg: dict[str, Any]) -> bool:
    """The CheckCode recomputed from its published definition: SHA-256 of Go's compact JSON of
    the DeviceInfo value, DeviceList keys sorted."""
    info = cfg["DeviceInfo"]
    text = json.dumps(
        {"DeviceList": dict(sorted(info["DeviceList"].items())), "UpdateTime": info["UpdateTime"]},
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return bool(cfg["CheckCode"] == hashlib.sha256(text.encode()).hexdigest())


def test_created_then_updated_on_a_fault(npus: Npus) -> None:
    writer = VolcanoDeviceInfo(
        api=npus.api, state=npus.state, conditions=lambda: dict(npus.conditions)
    )
    with supervised(writer):
        created = wait_for("the ConfigMap", lambda: _read_or_none(npus), lambda cm: cm is not None)
        assert created.metadata.labels == {"mx-consumer-cim": "true"}
        cfg = device_info(created)
        assert check_code_matches(cfg)
        lists = cfg["DeviceInfo"]["DeviceList"]
        assert lists["huawei.com/Ascend910"] == ",".join(f"Ascend910-{i}" for i in range(8))
        assert lists["huawei.com/Ascend910-Unhealthy"] == ""
        assert created.data["ManuallySeparateNPU"] == ""

        npus.conditions["ascend-npu5"] = Condition(
            "NPU_FAULT_0x80E18402", Level.NODE_FATAL, since=1.0, last_seen=1.0
        )
        npus.state.set_unhealthy({"ascend-npu5"})  # wakes the writer, as the hub does
        updated = wait_for(
            "the fault in the ConfigMap",
            npus.read,
            lambda cm: (
                "Ascend910-5"
                in device_info(cm)["DeviceInfo"]["DeviceList"]["huawei.com/Ascend910-Unhealthy"]
            ),
        )
    cfg = device_info(updated)
    assert check_code_matches(cfg)
    assert cfg["DeviceInfo"]["UpdateTime"] > device_info(created)["DeviceInfo"]["UpdateTime"]
    faults = json.loads(cfg["DeviceInfo"]["DeviceList"]["huawei.com/Ascend910-Fault"])
    assert [(f["npu_name"], f["fault_level"], f["fault_code"]) for f in faults] == [
        ("Ascend910-5", "SeparateNPU", "80E18402")
    ]
    assert "Ascend910-5" not in cfg["DeviceInfo"]["DeviceList"]["huawei.com/Ascend910"]
    assert writer.writes == 2  # at start and on the fault: nothing else changed
    assert writer.failures == 0
    annotations = npus.admin.core.read_node(npus.node).metadata.annotations
    listed = json.loads(annotations["baseDeviceInfos"])
    assert sorted(listed, key=lambda name: int(name.split("-")[1])) == [
        f"Ascend910-{i}" for i in range(8)
    ]  # every NPU, the faulty one too
    assert listed["Ascend910-5"] == {"IP": "", "SuperDeviceID": 0}


def test_the_node_policy_allows_base_device_infos_and_nothing_more(npus: Npus) -> None:
    def patch(annotations: dict[str, str | None]) -> None:
        npus.api.patch_node(npus.node, {"metadata": {"annotations": annotations}})

    patch({"baseDeviceInfos": '{"Ascend910-0":{"IP":"","SuperDeviceID":0}}'})
    patch({"baseDeviceInfos": "{}"})  # changed: allowed
    refusals = [
        ({"volcano.sh/other": "x"}, "baseDeviceInfos annotations"),
        ({"baseDeviceInfos": None}, "baseDeviceInfos annotations"),  # removed
    ]
    for change, words in refusals:
        with pytest.raises(ApiError) as denied:
            patch(change)
        assert denied.value.status == FORBIDDEN, change
        assert words in str(denied.value), change
    assert npus.admin.core.read_node(npus.node).metadata.annotations["baseDeviceInfos"] == "{}"


def _read_or_none(npus: Npus) -> Any:
    try:
        return npus.read()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_the_agent_may_write_only_its_own_nodes_configmap(npus: Npus, k8s: KwokCluster) -> None:
    path = f"/api/v1/namespaces/{SYSTEM}/configmaps"
    npus.api.request("POST", path, body_for(npus.node))  # its own: allowed
    npus.api.request("PUT", f"{path}/{PREFIX}{npus.node}", body_for(npus.node))

    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    unrelated = k8s.unique_name("edl-probe")
    k8s.core.create_namespaced_config_map(
        SYSTEM, {"metadata": {"name": unrelated}, "data": {"a": "b"}}
    )
    try:
        refusals = [
            # Another node's ConfigMap, created or replaced: the admission policy.
            ("POST", path, body_for(other), "may only write the ConfigMap"),
            ("PUT", f"{path}/{unrelated}", {**body_for(npus.node), "metadata": {"name": unrelated}},
             "may only write the ConfigMap"),
            # No delete, no read, nowhere else: RBAC.
            ("DELETE", f"{path}/{PREFIX}{npus.node}", None, "cannot delete resource"),
            ("GET", f"{path}/{PREFIX}{npus.node}", None, "cannot get resource"),
            ("POST", f"/api/v1/namespaces/{k8s.namespace}/configmaps",
             {**body_for(npus.node), "metadata": {"name": "x"}}, "cannot create resource"),
        ]  # fmt: skip
        for method, where, body, words in refusals:
            with pytest.raises(ApiError) as denied:
                npus.api.request(method, where, body)
            assert denied.value.status == FORBIDDEN, (method, where)
            assert words in str(denied.value), (method, where, str(denied.value))
        assert k8s.core.read_namespaced_config_map(unrelated, SYSTEM).data == {"a": "b"}
    finally:
        delete_quietly(k8s.core, unrelated)
        delete_quietly(k8s.core, PREFIX + other)

    unbound = KubeApi(sa_client(k8s.api, k8s.mint_token("edl-agent")))  # bound to no pod
    try:
        with pytest.raises(ApiError) as denied:
            unbound.request("PUT", f"{path}/{PREFIX}{npus.node}", body_for(npus.node))
        assert denied.value.status == FORBIDDEN
        assert "may only write the ConfigMap" in str(denied.value)
    finally:
        unbound.close()
