"""DRA when the control plane misbehaves around a claim, with the real kube-apiserver, kubelet and
kube-scheduler, and for deleted claims kube-controller-manager (its resourceclaim controller is
what deallocates a claim once no pod uses it, and removes its deletion protection).

- The API server SIGKILLed while kubelet asks our plugin to prepare a claim. To hit that window
  every time, the agent is frozen (SIGSTOP) before the pod is made; kubelet reads the claim,
  records it in its own checkpoint (`dra_manager_state`) and only then calls
  NodePrepareResources, which waits on the frozen agent. Once the claim is in kubelet's
  checkpoint the API server is killed and the agent thawed: its own read of the claim meets a
  dead API server. The API server is then started again (same port, flags and etcd).
  The same with the API server back before the agent reads the claim: the agent's connections
  to the dead API server are not in the way, the claim is prepared at the first call.
- A device fault while the API server is dead: the claim's status.devices is written once the
  API server is back.
- A ResourceClaim deleted while its pod runs: the claim stays (deletion protection, reserved for
  the pod) until the pod goes; then kubelet unprepares it, the controller lets it go, and the
  device is given to the next claim that selects it.
- A ResourceClaim removed outright (its finalizer taken off) while its pod runs: the scheduler
  then sees the device free and gives it to another claim, but the node still has it prepared;
  the agent refuses the second claim until the first pod is gone.

Every claim here selects one device by its index, so a device given again is proven free, not
assumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
import testcluster
import testnode
import yaml
from k8s_test_helpers import NOT_FOUND, KwokCluster, admin_client
from kubelet_helpers import (
    NodeAgent,
    StartNode,
    claim_body,
    claim_pod,
    created_containers,
    kubelet_node_starter,
    logged_at,
    node_agent,
    wait_phase,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from scheduler import ProcessError, start_scheduler

from edl_agent.sim import inject
from tests.conftest import session_owns
from tests.waiting import wait_for

pytestmark = pytest.mark.kubelet

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION = "resource.k8s.io", "v1"
GPU_DRIVER = "gpu.nvidia.edl.io"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"
# kubelet's DRA checkpoint in its root dir: claims it is about to prepare are recorded there
# before it calls the driver.
KUBELET_DRA_CHECKPOINT = "dra_manager_state"
STEP = 60.0
StartAgent = Callable[..., NodeAgent]
T = TypeVar("T")


# --- fixtures -----------------------------------------------------------------------------
#
# Two planes. The API server outages happen on a plane of their own, so that what its clients
# go through (a starting kube-apiserver answers 403 until its RBAC caches are warm, and their
# watches back off) reaches no other test: kube-controller-manager, which the claim deletions
# need, runs on the other one, whose API server is never stopped.


def _owned_while_running(config: pytest.Config, plane: testcluster.ControlPlane) -> None:
    """A kube-apiserver started again by a test is the plane's, not a process the test left
    behind, while the plane runs."""
    state = plane.directory / "state.json"
    session_owns(config, lambda: list(plane.pids.values()) if state.exists() else [])


def _scheduler_and_classes(
    plane: testcluster.ControlPlane, api: client.ApiClient, directory: Path
) -> Iterator[None]:
    """A kube-scheduler for the plane and our DeviceClasses (deploy/dra) in it."""
    try:
        process = start_scheduler(plane.kubeconfig, directory, timeout=90.0)
    except ProcessError as exc:
        pytest.fail(str(exc), pytrace=False)
    custom = client.CustomObjectsApi(api)
    classes = list(yaml.safe_load_all((REPO / "deploy/dra/deviceclasses.yaml").read_text()))
    try:
        for body in classes:
            custom.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", body)
        yield
        for body in classes:
            custom.delete_cluster_custom_object(
                GROUP, VERSION, "deviceclasses", body["metadata"]["name"]
            )
    finally:
        process.stop()
        assert not process.alive()


@pytest.fixture(scope="module")
def outage_plane(
    k8s_binaries: Path, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[testcluster.ControlPlane]:
    """A control plane (etcd, kube-apiserver, kwok) whose API server the tests stop."""
    try:
        plane = testcluster.start(tmp_path_factory.mktemp("outage-plane"), attached=True)
    except testcluster.ControlPlaneError as exc:
        pytest.fail(f"could not start a control plane: {exc}", pytrace=False)
    _owned_while_running(pytestconfig, plane)
    yield plane
    pids = plane.stop()
    left = [pid for pid in pids if testcluster.pid_alive(pid)]
    assert not left, f"processes {left} of the outage plane survived it"


@pytest.fixture(scope="module")
def outage_api(outage_plane: testcluster.ControlPlane) -> Iterator[client.ApiClient]:
    api = admin_client(outage_plane)
    yield api
    api.close()


@pytest.fixture(scope="module")
def outage_dra(
    outage_plane: testcluster.ControlPlane,
    outage_api: client.ApiClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    yield from _scheduler_and_classes(
        outage_plane, outage_api, tmp_path_factory.mktemp("outage-scheduler")
    )


@pytest.fixture
def outage_k8s(outage_api: client.ApiClient) -> Iterator[KwokCluster]:
    """A fresh namespace on the outage plane, cleaned after the test."""
    namespace = f"t-outage-{secrets.token_hex(3)}"
    client.CoreV1Api(outage_api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
    )
    cluster = KwokCluster(outage_api, namespace)
    yield cluster
    cluster.cleanup()


@pytest.fixture
def outage_nodes(outage_plane: testcluster.ControlPlane) -> Iterator[StartNode]:
    """``start()``: a real kubelet node (Ready, untainted) on the outage plane, stopped and
    removed after the test (as the ``kubelet_nodes`` fixture does on the session's plane)."""
    yield from kubelet_node_starter(outage_plane)


@pytest.fixture(scope="module")
def managed_dra(
    k8s_managed_plane: testcluster.ControlPlane,
    k8s_managed_api_client: client.ApiClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    yield from _scheduler_and_classes(
        k8s_managed_plane, k8s_managed_api_client, tmp_path_factory.mktemp("managed-scheduler")
    )


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[StartAgent]:
    """``start(plane, node)``: an agent serving `node`'s GPUs (dgx-h100) through DRA with the
    plane's admin kubeconfig; each must exit 0 on SIGTERM (a frozen one is thawed first)."""
    started: list[NodeAgent] = []

    def start(plane: testcluster.ControlPlane, node: testnode.Node) -> NodeAgent:
        where = tmp_path / f"agent-{len(started)}"
        agent = node_agent(
            node,
            "dgx-h100",
            where,
            f"--kubeconfig={plane.kubeconfig}",
            f"--set=dra.plugins_registry_dir={node.paths.plugins_registry}",
            f"--set=dra.cdi_dir={where / 'cdi'}",
            "--set=nvidia.serve=dra",
        )
        started.append(agent)
        return agent

    yield start
    codes = []
    for agent in started:
        if agent.process and agent.process.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.process.pid, signal.SIGCONT)
            codes.append(agent.stop())
    assert codes == [0] * len(codes), f"agents exited with {codes}"


# --- the scene: a node, its agent and the API ----------------------------------------------


@dataclass
class Scene:
    """A real kubelet node of `plane` whose GPUs (dgx-h100) an agent serves through DRA, seen
    from a test namespace."""

    plane: testcluster.ControlPlane
    k8s: KwokCluster
    node: testnode.Node
    agent: NodeAgent

    @property
    def ns(self) -> str:
        return self.k8s.namespace

    @property
    def core(self) -> client.CoreV1Api:
        return self.k8s.core

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.k8s.api)

    def claim(self, name: str, index: int) -> str:
        """A claim for the GPU of `index` (and no other); its uid."""
        selector = f"device.attributes['{GPU_DRIVER}'].index == {index}"
        created = self.custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            self.ns,
            "resourceclaims",
            claim_body(name, GPU_DRIVER, selector=selector),
        )
        return str(created["metadata"]["uid"])

    def pod(self, name: str) -> None:
        """A pod holding the claim of its name."""
        self.core.create_namespaced_pod(self.ns, claim_pod(name, name))

    def read_claim(self, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.ns, "resourceclaims", name
            )
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return None
            raise
        return found

    def phase(self, pod: str) -> str:
        return str(self.core.read_namespaced_pod(pod, self.ns).status.phase)

    def running(self, pod: str) -> None:
        wait_phase(self.core, self.ns, pod, "Running", timeout=STEP)

    def checkpointed(self) -> list[str]:
        """The claim uids in the agent's checkpoint, one per entry (across drivers)."""
        path = self.agent.directory / "state/dra/prepared.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return []
        return sorted(uid for claims in data["drivers"].values() for uid in claims)

    def claim_specs(self) -> list[str]:
        """The claim uids that have a CDI spec file in the agent's CDI directory."""
        prefix, suffix = "edl.io-claim-", ".json"
        cdi = self.agent.directory / "cdi"
        return sorted(p.name[len(prefix) : -len(suffix)] for p in cdi.glob(f"{prefix}*"))

    def logged(self, event: str, uid: str) -> list[dict[str, Any]]:
        return [e for e in self.agent.entries(event) if e.get("uid") == uid]

    def dra_parts_died(self) -> list[dict[str, Any]]:
        """What the agent's supervisor logged of a DRA part dying (it restarts them)."""
        return [e for e in self.agent.entries("part died") if str(e.get("name")).startswith("dra")]

    def cdi_ids(self, pod: str) -> list[str]:
        """The CDI devices kubelet gave the runtime for the pod's container."""
        return sorted(created_containers(self.node, self.ns, pod)[-1]["cdi_devices"])

    def wait(self, what: str, fetch: Callable[[], T], done: Callable[[T], object]) -> T:
        return wait_for(what, fetch, done, timeout=STEP, alive=self.agent.process)


def _scene(
    plane: testcluster.ControlPlane, k8s: KwokCluster, node: testnode.Node, agent: NodeAgent
) -> Scene:
    """Once the node's 8 GPUs are published and kubelet has registered the plugin."""
    scene = Scene(plane, k8s, node, agent)
    scene.wait(
        f"8 GPUs published for {node.name}",
        lambda: published(scene.custom, node.name),
        lambda devices: len(devices) == 8,
    )
    scene.wait(
        "kubelet registered the GPU plugin", lambda: agent.entries("registered with kubelet"), bool
    )
    return scene


@pytest.fixture
def outage(
    outage_plane: testcluster.ControlPlane,
    outage_dra: None,
    outage_k8s: KwokCluster,
    outage_nodes: StartNode,
    agents: StartAgent,
) -> Scene:
    """On the plane whose API server the test may stop."""
    node = outage_nodes()
    return _scene(outage_plane, outage_k8s, node, agents(outage_plane, node))


@pytest.fixture
def managed(
    k8s_managed_plane: testcluster.ControlPlane,
    managed_dra: None,
    k8s_managed: KwokCluster,
    managed_kubelet_nodes: StartNode,
    agents: StartAgent,
) -> Scene:
    """On the plane with kube-controller-manager."""
    node = managed_kubelet_nodes()
    return _scene(k8s_managed_plane, k8s_managed, node, agents(k8s_managed_plane, node))


# --- helpers ------------------------------------------------------------------------------


def published(custom: client.CustomObjectsApi, node: str) -> dict[str, dict[str, Any]]:
    """Device name → device of the node's GPU ResourceSlices."""
    listed = custom.list_cluster_custom_object(
        GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node}"
    )
    return {
        d["name"]: d
        for s in listed["items"]
        if s["spec"]["driver"] == GPU_DRIVER
        for d in s["spec"].get("devices", [])
    }


def allocated(claim: dict[str, Any] | None) -> list[str]:
    results = (((claim or {}).get("status") or {}).get("allocation") or {}).get("devices", {})
    return sorted(r["device"] for r in results.get("results", []))


def ready(claim: dict[str, Any] | None) -> dict[str, str]:
    """Device → status of its Ready condition in the claim's status.devices."""
    return {
        entry["device"]: condition["status"]
        for entry in ((claim or {}).get("status") or {}).get("devices") or []
        for condition in entry.get("conditions") or []
        if condition["type"] == "Ready"
    }


def expected_cdi_ids(device: str, uid: str) -> list[str]:
    return sorted([f"nvidia.edl.io/gpu={device}", f"claim.edl.io/env=claim-{uid}"])


def unschedulable(scene: Scene, pod: str) -> str:
    """Until the scheduler has tried the pod and found no node: the reason it gave."""
    found = wait_for(
        f"the scheduler to find no node for {pod}",
        lambda: scene.core.read_namespaced_pod(pod, scene.ns),
        lambda p: any(
            c.type == "PodScheduled" and c.status == "False" for c in p.status.conditions or []
        ),
        timeout=STEP,
    )
    assert found.spec.node_name is None
    [condition] = [c for c in found.status.conditions if c.type == "PodScheduled"]
    return str(condition.message)


@contextlib.contextmanager
def kubelet_held_at_prepare(scene: Scene, claim: str, uid: str) -> Iterator[None]:
    """A pod holding `claim` made while the agent is frozen (SIGSTOP); in the block kubelet has
    read the claim and recorded it in its checkpoint, which it does right before it calls
    NodePrepareResources: that call waits on the agent, which has not read the claim yet. The
    agent is thawed when the block ends, however it ends."""
    process = scene.agent.process
    assert process is not None
    checkpoint = scene.node.paths.kubelet / KUBELET_DRA_CHECKPOINT
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        scene.pod(claim)
        wait_for(
            "kubelet to record the claim it is about to prepare",
            lambda: checkpoint.read_text() if checkpoint.exists() else "",
            lambda text: uid in text,
            timeout=STEP,
        )
        yield
    finally:
        os.killpg(process.pid, signal.SIGCONT)


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def kill_apiserver(plane: testcluster.ControlPlane) -> None:
    """SIGKILL the plane's kube-apiserver; returns once it is dead and its port refuses
    connections (etcd and the rest run on)."""
    pid = plane.pids["kube-apiserver"]
    port = urlsplit(plane.server).port
    assert port is not None
    os.killpg(pid, signal.SIGKILL)
    wait_for(
        "kube-apiserver dead, its port closed",
        lambda: (testcluster.pid_alive(pid), port_closed(port)),
        lambda found: found == (False, True),
        timeout=10,
    )


# --- the API server killed ------------------------------------------------------------------


def test_the_api_server_killed_while_kubelet_prepares_a_claim(outage: Scene) -> None:
    """The agent's read of the claim meets a dead API server: the claim is refused, nothing is
    written, and kubelet prepares it again once the API server is back; the pod runs with the
    claim's CDI devices, prepared once."""
    uid = outage.claim("outage", 2)
    with kubelet_held_at_prepare(outage, "outage", uid):
        [device] = allocated(outage.read_claim("outage"))
        killed = time.time()
        kill_apiserver(outage.plane)
    refused = outage.wait(
        "the agent to refuse the claim it cannot read",
        lambda: outage.logged("claim refused", uid),
        bool,
    )
    assert "reading ResourceClaim" in refused[0]["reason"], refused
    assert logged_at(refused[0]) > killed
    # Refused, nothing written: no CDI spec and no checkpoint entry for a claim not prepared.
    assert outage.claim_specs() == []
    assert outage.checkpointed() == []
    down = testcluster.restart_apiserver(outage.plane)
    back = time.time()

    outage.running("outage")
    running = time.time()
    assert outage.cdi_ids("outage") == expected_cdi_ids(device, uid)
    assert outage.checkpointed() == [uid]
    assert outage.claim_specs() == [uid]
    [prepared] = outage.logged("claim prepared", uid)
    assert logged_at(prepared) > logged_at(refused[0])  # kubelet asked again: prepared then
    assert prepared["devices"] == [device]
    outage.wait(
        "the claim's device Ready in its status",
        lambda: ready(outage.read_claim("outage")),
        lambda found: found == {device: "True"},
    )
    assert outage.agent.process is not None
    assert outage.agent.process.alive()  # the agent never died
    assert outage.dra_parts_died() == []
    print(
        f"\napi server down {down:.1f}s; refused {logged_at(refused[0]) - killed:.2f}s after the "
        f"kill; pod Running {running - back:.1f}s after the API server was back; parts that "
        f"died: {sorted({e['name'] for e in outage.agent.entries('part died')})}"
    )

    outage.core.delete_namespaced_pod("outage", outage.ns, grace_period_seconds=0)
    outage.wait(
        "the claim unprepared",
        lambda: (outage.claim_specs(), outage.checkpointed()),
        lambda found: found == ([], []),
    )


def test_an_api_server_killed_and_back_before_the_agent_reads_the_claim(outage: Scene) -> None:
    """The agent's connections to the API server died with it; the one that answers again is
    read at the first try."""
    uid = outage.claim("stale", 3)
    with kubelet_held_at_prepare(outage, "stale", uid):
        kill_apiserver(outage.plane)
        testcluster.restart_apiserver(outage.plane)
    outage.running("stale")
    assert outage.logged("claim refused", uid) == []
    assert outage.checkpointed() == [uid]


def test_a_device_fault_while_the_api_server_is_down_reaches_the_claim_once_it_is_back(
    outage: Scene,
) -> None:
    """The claim's status.devices cannot be written while the API server is dead; the agent
    tries again and writes it once the API server is back."""
    outage.claim("faulty", 4)
    outage.pod("faulty")
    outage.running("faulty")
    [device] = allocated(outage.read_claim("faulty"))
    outage.wait(
        "the claim's device Ready",
        lambda: ready(outage.read_claim("faulty")),
        lambda found: found == {device: "True"},
    )
    outage.wait("the agent's health monitors watching", outage.agent.ready, bool)

    kill_apiserver(outage.plane)
    killed = time.time()
    inject.inject_xid(outage.agent.tree, 4, 48)
    outage.wait(
        "the agent to fail writing the claim's status",
        lambda: [
            e
            for e in outage.agent.entries("writing a claim's device status failed; trying again")
            if logged_at(e) > killed
        ],
        bool,
    )
    testcluster.restart_apiserver(outage.plane)
    back = time.time()
    outage.wait(
        "the claim's device not Ready",
        lambda: ready(outage.read_claim("faulty")),
        lambda found: found == {device: "False"},
    )
    assert outage.dra_parts_died() == []
    print(
        f"\nthe claim's status written {time.time() - killed:.1f}s after the kill, "
        f"{time.time() - back:.1f}s after the API server was back"
    )


# --- claims deleted -------------------------------------------------------------------------


def test_a_claim_deleted_while_its_pod_runs_is_unprepared_with_the_pod_and_its_device_given_again(
    managed: Scene,
) -> None:
    """Deleting a claim in use only marks it; it goes with its pod, after kubelet has
    unprepared it, and its device is then given to the claim that waited for it."""
    first = managed.claim("first", 5)
    managed.pod("first")
    managed.running("first")
    [device] = allocated(managed.read_claim("first"))
    # A second claim for the same GPU waits: the device is taken.
    second = managed.claim("second", 5)
    managed.pod("second")
    assert "cannot allocate all claims" in unschedulable(managed, "second")

    # Deleted while its pod runs: the claim stays, protected and reserved for the pod, and the
    # node keeps it prepared.
    managed.custom.delete_namespaced_custom_object(
        GROUP, VERSION, managed.ns, "resourceclaims", "first"
    )
    claim = managed.read_claim("first")
    assert claim is not None
    assert claim["metadata"].get("deletionTimestamp")
    assert DELETE_PROTECTION in claim["metadata"]["finalizers"]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["first"]
    assert allocated(claim) == [device]
    assert managed.checkpointed() == [first]
    assert managed.claim_specs() == [first]
    assert managed.phase("first") == "Running"

    # The pod goes (gracefully: its object stays until kubelet has unprepared its claims):
    # kubelet unprepares the claim, the controller lets it go, and the scheduler gives the GPU
    # to the second claim, which the node prepares at once.
    managed.core.delete_namespaced_pod("first", managed.ns, grace_period_seconds=1)
    managed.wait(
        "the first claim unprepared (CDI spec and checkpoint entry gone)",
        lambda: first in managed.claim_specs() or first in managed.checkpointed(),
        lambda held: not held,
    )
    managed.wait(
        "the first claim gone from the API server",
        lambda: managed.read_claim("first"),
        lambda found: found is None,
    )
    managed.running("second")
    assert allocated(managed.read_claim("second")) == [device]
    assert managed.cdi_ids("second") == expected_cdi_ids(device, second)
    assert managed.checkpointed() == [second]
    assert managed.claim_specs() == [second]
    assert managed.logged("claim refused", second) == []
    [unprepared] = managed.logged("claim unprepared", first)
    [prepared] = managed.logged("claim prepared", second)
    assert logged_at(unprepared) <= logged_at(prepared)


def test_a_claim_removed_outright_while_prepared_keeps_its_device_from_the_next_claim(
    managed: Scene,
) -> None:
    """Its finalizer taken off, a claim in use is gone at once and the scheduler gives its
    device to the next claim; the node, where the first pod still runs with it, refuses to
    prepare that claim until the pod is gone. (A pod deleted with grace period 0 opens the same
    gap: it leaves the API server at once, so the controller may free its claim, and the
    scheduler give the device away, before kubelet has unprepared it.)"""
    first = managed.claim("first", 6)
    managed.pod("first")
    managed.running("first")
    [device] = allocated(managed.read_claim("first"))

    managed.custom.delete_namespaced_custom_object(
        GROUP, VERSION, managed.ns, "resourceclaims", "first"
    )
    managed.custom.patch_namespaced_custom_object(
        GROUP, VERSION, managed.ns, "resourceclaims", "first", {"metadata": {"finalizers": None}}
    )
    assert managed.read_claim("first") is None
    second = managed.claim("second", 6)
    managed.pod("second")
    managed.wait(
        "the scheduler to give the GPU to the second claim",
        lambda: allocated(managed.read_claim("second")),
        lambda found: found == [device],
    )
    refused = managed.wait(
        "the agent to refuse the second claim",
        lambda: managed.logged("claim refused", second),
        bool,
    )
    assert f"device {device}: held by prepared claim {first}" in refused[0]["reason"], refused
    assert managed.checkpointed() == [first]
    assert managed.claim_specs() == [first]
    assert managed.phase("second") == "Pending"
    assert managed.phase("first") == "Running"

    managed.core.delete_namespaced_pod("first", managed.ns, grace_period_seconds=0)
    managed.running("second")
    assert managed.cdi_ids("second") == expected_cdi_ids(device, second)
    assert managed.checkpointed() == [second]
    assert managed.claim_specs() == [second]
    [prepared] = managed.logged("claim prepared", second)
    [unprepared] = managed.logged("claim unprepared", first)
    assert logged_at(prepared) >= logged_at(unprepared)
