"""Labels, the AcceleratorHealthy condition, events and the device cordon on a KWOK node, against
the real API server — written with the agent's own service account, bound by the RBAC and the
admission policy of deploy/daemonset/agent-rbac.yaml, never with the admin credential."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_test_helpers import KwokCluster, bound_tokens, node_ready, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from edl_agent.config import NodeSettings, Settings, load_settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.model import Inventory, Vendor
from edl_agent.health.model import Level
from edl_agent.health.tracker import Condition
from edl_agent.kube import ApiError, KubeApi
from edl_agent.kube_rest import connect
from edl_agent.labels.compute import node_labels
from edl_agent.labels.condition import CONDITION_TYPE, accelerator_health
from edl_agent.labels.cordon import CORDONED_DEVICES, RELEASE_DEVICES
from edl_agent.labels.node import NodeUpdater
from edl_agent.labels.ownership import OWNED_LABELS
from edl_agent.labels.watching import NodeWatcher
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.parts import running
from tests.parts import stop as stop_parts

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "daemonset" / "agent-rbac.yaml"
MERGE = "application/merge-patch+json"
T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
FORBIDDEN = 403


@dataclass(frozen=True)
class Simulated:
    inventory: Inventory
    settings: Settings
    machine: str

    def labels(self, unhealthy: dict[str, Condition] | None = None) -> dict[str, str]:
        return node_labels(
            inventory=self.inventory,
            unhealthy=unhealthy or {},
            settings=self.settings,
            machine=self.machine,
        )

    def without_last(self, vendor: Vendor) -> Simulated:
        reports = tuple(
            dataclasses.replace(r, devices=r.devices[:-1]) if r.vendor is vendor else r
            for r in self.inventory.reports
        )
        return dataclasses.replace(
            self, inventory=dataclasses.replace(self.inventory, reports=reports)
        )


def simulate(name: str, root: Path) -> Simulated:
    profile = load_profile(name)
    build_tree(profile, root)
    settings = load_settings(defaults=profile.config, overrides={"host_root": str(root)})
    return Simulated(discover_node(settings), settings, profile.node.machine)


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    return simulate("dgx-h100", tmp_path_factory.mktemp("dgx-h100"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    return simulate("mixed-gpu-npu", tmp_path_factory.mktemp("mixed-gpu-npu"))


@dataclass
class Agent:
    """The agent's view: the node its pod runs on, and clients with its pod-bound token."""

    node: str
    api: KubeApi
    core: client.CoreV1Api
    updater: NodeUpdater
    admin: KwokCluster

    def read(self) -> Any:
        return self.admin.core.read_node(self.node)

    def events(self) -> list[Any]:
        selector = f"involvedObject.name={self.node}"
        return self.admin.core.list_namespaced_event("default", field_selector=selector).items


def sa_client(admin: client.ApiClient, token: str) -> client.ApiClient:
    config = client.Configuration()
    config.host = admin.configuration.host
    config.ssl_ca_cert = admin.configuration.ssl_ca_cert
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(config)


def install_manifest(k8s: KwokCluster, manifest: Path = MANIFEST) -> list[Callable[[], object]]:
    """Create the manifest's objects for this test's namespace: `edl-system` becomes it, and
    everything outside it gets a per-test name. Returns the deletions for the cleanup."""
    suffix = k8s.namespace
    rbac = client.RbacAuthorizationV1Api(k8s.api)
    admission = client.AdmissionregistrationV1Api(k8s.api)
    text = manifest.read_text().replace("edl-system", k8s.namespace)
    undo: list[Callable[[], object]] = []
    for doc in yaml.safe_load_all(text):
        kind, meta = doc["kind"], doc["metadata"]
        if kind == "ServiceAccount":
            k8s.create_service_account(meta["name"])
            continue
        meta["name"] = name = f"{meta['name']}-{suffix}"
        if "roleRef" in doc:
            doc["roleRef"]["name"] += f"-{suffix}"
        if kind == "ValidatingAdmissionPolicyBinding":
            doc["spec"]["policyName"] += f"-{suffix}"
        if kind == "ClusterRole":
            rbac.create_cluster_role(doc)
            undo.append(lambda n=name: rbac.delete_cluster_role(n))
        elif kind == "ClusterRoleBinding":
            rbac.create_cluster_role_binding(doc)
            undo.append(lambda n=name: rbac.delete_cluster_role_binding(n))
        elif kind == "Role":
            rbac.create_namespaced_role(meta["namespace"], doc)
            undo.append(lambda n=name, ns=meta["namespace"]: rbac.delete_namespaced_role(n, ns))
        elif kind == "RoleBinding":
            ns = meta["namespace"]
            rbac.create_namespaced_role_binding(ns, doc)
            undo.append(lambda n=name, ns=ns: rbac.delete_namespaced_role_binding(n, ns))
        elif kind == "ValidatingAdmissionPolicy":
            admission.create_validating_admission_policy(doc)
            undo.append(lambda n=name: admission.delete_validating_admission_policy(n))
        elif kind == "ValidatingAdmissionPolicyBinding":
            admission.create_validating_admission_policy_binding(doc)
            undo.append(lambda n=name: admission.delete_validating_admission_policy_binding(n))
        else:
            raise AssertionError(f"unexpected {kind} in {manifest}")
    return undo


def pod_bound_token(k8s: KwokCluster, node: str, service_account: str = "edl-agent") -> str:
    """A token as kubelet gives the agent's pod: bound to a pod on `node`, so it carries the
    node's name (the admission policy checks it)."""
    return bound_tokens(k8s.core, k8s.namespace, node, service_account, [[]])[0]


def status_of(exc: ApiException | ApiError) -> tuple[int | None, str]:
    if isinstance(exc, ApiError):
        return exc.status, str(exc)
    return exc.status, str(json.loads(exc.body or "{}").get("message", ""))


@pytest.fixture
def agent(k8s: KwokCluster) -> Iterator[Agent]:
    node = k8s.create_gpu_node(labels={"team": "ml"}).metadata.name
    with agent_view(k8s, node) as view:
        yield view


@contextlib.contextmanager
def agent_view(k8s: KwokCluster, node: str) -> Iterator[Agent]:
    """The agent's RBAC installed, and its view of `node` with a token bound to a pod there."""
    undo = install_manifest(k8s)
    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    api = sa_client(k8s.api, pod_bound_token(k8s, node))
    core = client.CoreV1Api(api)

    def policy_denies_other_node() -> bool:
        try:
            core.patch_node(other, {"metadata": {"labels": {"edl.io/probe": "1"}}},
                            dry_run="All", _content_type=MERGE)  # fmt: skip
        except ApiException as exc:
            return exc.status == FORBIDDEN and "only change the node" in status_of(exc)[1]
        return False

    # RBAC and admission policies reach the API server's caches a moment after creation.
    wait_for("the admission policy to apply", policy_denies_other_node, bool, timeout=30)
    kube = KubeApi(api)
    updater = NodeUpdater(api=kube, node_name=node, settings=NodeSettings())
    try:
        yield Agent(node, kube, core, updater, k8s)
    finally:
        kube.close()
        selector = f"involvedObject.name={node}"
        k8s.core.delete_collection_namespaced_event("default", field_selector=selector)
        for action in undo:
            action()


def health_of(sim: Simulated, unhealthy: dict[str, Condition] | None = None) -> Any:
    return accelerator_health(inventory=sim.inventory, unhealthy=unhealthy or {})


def sync(agent: Agent, sim: Simulated, at: datetime = T0, **kw: Any) -> Any:
    unhealthy = kw.pop("unhealthy", None)
    return agent.updater.sync(
        labels=sim.labels(unhealthy), health=health_of(sim, unhealthy), now=at, **kw
    )


def our_condition(node: Any) -> Any:
    return next(c for c in node.status.conditions if c.type == CONDITION_TYPE)


# --- labels -----------------------------------------------------------------------------------


def test_dgx_h100_labels_appear_on_the_node(agent: Agent, h100: Simulated) -> None:
    result = sync(agent, h100)

    assert result.labels_written
    assert result.condition_written
    node = agent.read()
    expected = h100.labels()
    assert {k: node.metadata.labels.get(k) for k in expected} == expected
    assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert node.metadata.labels["nvidia.com/gpu.count"] == "8"
    assert node.metadata.labels["edl.io/nvidia.healthy"] == "8"
    assert node.metadata.annotations[OWNED_LABELS] == ",".join(sorted(expected))
    assert node.metadata.labels["team"] == "ml"
    condition = our_condition(node)
    assert (condition.status, condition.reason) == ("True", "AcceleratorsHealthy")
    assert node_ready(node) is True  # KWOK's Ready condition untouched

    assert not sync(agent, h100).labels_written  # nothing changed: no write at all


def test_mixed_node_labels_then_a_device_fewer(agent: Agent, mixed: Simulated) -> None:
    sync(agent, mixed)
    labels = agent.read().metadata.labels
    assert labels["edl.io/accelerator.vendors"] == "ascend.nvidia"
    assert labels["edl.io/ascend.count"] == "4"
    assert labels["edl.io/ascend.product"] == "Ascend910B3"
    assert labels["nvidia.com/gpu.count"] == "4"

    assert sync(agent, mixed.without_last(Vendor.NVIDIA)).labels_written

    labels = agent.read().metadata.labels
    assert labels["nvidia.com/gpu.count"] == "3"
    assert labels["edl.io/nvidia.count"] == "3"
    assert labels["edl.io/accelerator.count"] == "7"
    assert labels["edl.io/ascend.count"] == "4"


def test_stale_owned_labels_go_and_foreign_labels_stay(
    agent: Agent, mixed: Simulated, h100: Simulated
) -> None:
    foreign = {"nvidia.com/gpu.deploy.dcgm-exporter": "true", "edl.io/set-by-hand": "yes"}
    agent.admin.core.patch_node(agent.node, {"metadata": {"labels": foreign}})
    sync(agent, mixed)
    assert "edl.io/ascend.count" in agent.read().metadata.labels

    sync(agent, h100)  # no NPUs any more

    node = agent.read()
    assert not [k for k in node.metadata.labels if k.startswith("edl.io/ascend.")]
    assert {k: node.metadata.labels[k] for k in foreign} == foreign
    assert node.metadata.labels["team"] == "ml"
    assert node.metadata.annotations[OWNED_LABELS] == ",".join(sorted(h100.labels()))

    # Someone removes one of ours: the periodic resync puts it back.
    agent.admin.core.patch_node(agent.node, {"metadata": {"labels": {"edl.io/nvidia.count": None}}})
    assert not sync(agent, h100).labels_written
    assert sync(agent, h100, force=True).labels_written
    assert agent.read().metadata.labels["edl.io/nvidia.count"] == "8"


class RacingApi(KubeApi):
    """Another writer changes the Node between our read and our patch, once."""

    def __init__(self, api: client.ApiClient, admin: KwokCluster, node: str) -> None:
        super().__init__(api)
        self.admin, self.node, self.raced = admin, node, False

    def read_node(self, name: str) -> dict[str, Any]:
        node = super().read_node(name)
        if not self.raced:
            self.raced = True
            self.admin.core.patch_node(self.node, {"metadata": {"labels": {"racer": "won"}}})
        return node


def test_a_conflict_is_retried_from_a_fresh_read(agent: Agent, h100: Simulated) -> None:
    racing = RacingApi(agent.api.api, agent.admin, agent.node)
    updater = NodeUpdater(api=racing, node_name=agent.node, settings=NodeSettings())

    result = updater.sync(labels=h100.labels(), health=health_of(h100), now=T0)

    assert result.labels_written
    assert updater.conflicts == 1
    labels = agent.read().metadata.labels
    assert labels["racer"] == "won"
    assert labels["nvidia.com/gpu.count"] == "8"


# --- condition and events -----------------------------------------------------------------------


def test_a_fault_flips_the_condition_and_records_events(agent: Agent, h100: Simulated) -> None:
    gpu3 = next(d for d in h100.inventory.devices if d.index == 3)
    xid79 = {gpu3.id: Condition("XID79", Level.NODE_FATAL, 1.0, 1.0, "GPU has fallen off the bus")}
    sync(agent, h100, T0)

    sync(agent, h100, T0 + timedelta(seconds=10), unhealthy=xid79)

    node = agent.read()
    condition = our_condition(node)
    assert (condition.status, condition.reason) == ("False", "XID79")
    assert f"nvidia 3 ({gpu3.id}) XID79: GPU has fallen off the bus" in condition.message
    assert condition.last_transition_time == T0 + timedelta(seconds=10)
    assert node_ready(node) is True
    assert node.metadata.labels["edl.io/nvidia.healthy"] == "7"
    (warning,) = agent.events()
    assert (warning.type, warning.reason) == ("Warning", "AcceleratorUnhealthy")
    assert warning.message == f"nvidia 3 ({gpu3.id}) unhealthy: XID79: GPU has fallen off the bus"
    assert warning.involved_object.kind == "Node"
    assert warning.involved_object.uid == node.metadata.uid
    assert warning.source.component == "edl-agent"

    sync(agent, h100, T0 + timedelta(seconds=20))

    condition = our_condition(agent.read())
    assert (condition.status, condition.reason) == ("True", "AcceleratorsHealthy")
    assert condition.last_transition_time == T0 + timedelta(seconds=20)
    recovered = [e for e in agent.events() if e.type == "Normal"]
    assert [(e.reason, e.message) for e in recovered] == [
        ("AcceleratorRecovered", f"nvidia 3 ({gpu3.id}) healthy again (was XID79)")
    ]

    sync(agent, h100, T0 + timedelta(minutes=5), force=True)  # the periodic resync

    condition = our_condition(agent.read())
    assert condition.last_heartbeat_time == T0 + timedelta(minutes=5)
    assert condition.last_transition_time == T0 + timedelta(seconds=20)

    sync(agent, h100, T0 + timedelta(minutes=6), unhealthy=xid79)  # the same fault again

    warnings = [e for e in agent.events() if e.type == "Warning"]
    assert [(e.count, e.metadata.name) for e in warnings] == [(2, warning.metadata.name)]
    assert len(agent.events()) == 2


# --- cordon -----------------------------------------------------------------------------------


def test_cordon_annotation_is_read_and_watched(agent: Agent, h100: Simulated) -> None:
    devices = h100.inventory.devices
    gpu3, gpu5 = (next(d for d in devices if d.index == i) for i in (3, 5))
    watcher = NodeWatcher(agent.api, agent.node, agent.updater.observe, timeout_seconds=30)
    watching = running(watcher)
    try:
        assert watcher.wait_seen(10)
        value = f"nvidia:3, {gpu5.id}, nvidia:42"
        agent.admin.core.patch_node(
            agent.node, {"metadata": {"annotations": {CORDONED_DEVICES: value}}}
        )
        cordon = wait_for(
            "the cordon to arrive through the watch",
            lambda: agent.updater.cordoned(devices),
            lambda c: c.device_ids == {gpu3.id, gpu5.id},
            timeout=10,
        )
        assert cordon.unknown == ("nvidia:42",)

        agent.admin.core.patch_node(
            agent.node, {"metadata": {"annotations": {CORDONED_DEVICES: None}}}
        )
        wait_for(
            "the cordon to be lifted",
            lambda: agent.updater.cordoned(devices).device_ids,
            lambda ids: not ids,
            timeout=10,
        )
    finally:
        stop_parts(watching)
    assert watcher.failures == 0

    agent.admin.core.patch_node(
        agent.node, {"metadata": {"annotations": {CORDONED_DEVICES: "nvidia:0"}}}
    )
    agent.updater.read()  # without a watch: read on demand
    first = next(d for d in devices if d.index == 0)
    assert agent.updater.cordoned(devices).device_ids == {first.id}


# --- least privilege --------------------------------------------------------------------------


def test_the_agent_may_change_only_its_own_node(agent: Agent, k8s: KwokCluster) -> None:
    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    ours = {"metadata": {"labels": {"edl.io/probe": "1"}}}
    agent.api.patch_node(agent.node, ours)

    with pytest.raises(ApiError) as denied:
        agent.api.patch_node(other, ours)
    assert denied.value.status == FORBIDDEN
    assert "may only change the node its pod runs on" in str(denied.value)
    condition = {"type": CONDITION_TYPE, "status": "True", "reason": "AcceleratorsHealthy"}
    with pytest.raises(ApiError) as denied:
        agent.api.patch_node_status(other, {"status": {"conditions": [condition]}})
    assert denied.value.status == FORBIDDEN

    for patch in (
        {"metadata": {"labels": {"team": "not-ours"}}},
        {"metadata": {"annotations": {CORDONED_DEVICES: "nvidia:0"}}},
        {"metadata": {"annotations": {RELEASE_DEVICES: "nvidia:0"}}},  # only its removal
        {"spec": {"unschedulable": True}},
    ):
        with pytest.raises(ApiError) as denied:
            agent.api.patch_node(agent.node, patch)
        assert denied.value.status == FORBIDDEN, patch
    ready = {"type": "Ready", "status": "False", "reason": "Hijacked"}
    with pytest.raises(ApiError):
        agent.api.patch_node_status(agent.node, {"status": {"conditions": [ready]}})

    with pytest.raises(ApiException) as listing:
        agent.core.list_node()
    assert listing.value.status == FORBIDDEN  # RBAC: get, watch and patch only


def test_tokens_without_the_node_or_the_binding_are_refused(agent: Agent, k8s: KwokCluster) -> None:
    patch = {"metadata": {"labels": {"edl.io/probe": "1"}}}
    unbound = KubeApi(sa_client(k8s.api, k8s.mint_token("edl-agent")))  # not bound to a pod
    stranger = KubeApi(sa_client(k8s.api, k8s.mint_token("stranger")))  # no RoleBinding
    try:
        with pytest.raises(ApiError) as denied:
            unbound.patch_node(agent.node, patch)
        assert denied.value.status == FORBIDDEN
        assert "may only change the node its pod runs on" in str(denied.value)
        with pytest.raises(ApiError) as denied:
            stranger.patch_node(agent.node, patch)
        assert denied.value.status == FORBIDDEN
        assert "cannot patch resource" in str(denied.value)
    finally:
        unbound.close()
        stranger.close()


def test_an_explicit_kubeconfig_connects(k8s_control_plane: Any, k8s: KwokCluster) -> None:
    node = k8s.create_gpu_node(wait_ready=False).metadata.name
    api = connect(str(k8s_control_plane.kubeconfig), environ={})
    assert api is not None
    try:
        assert api.read_node(node)["metadata"]["name"] == node
        with pytest.raises(ApiError) as missing:
            api.read_node(node + "-missing")
        assert missing.value.status == 404
    finally:
        api.close()
