"""ResourceSlices of simulated nodes against the real API server (kube-apiserver 1.37), written
by dra.publisher with the agent's pod-bound token, bound by deploy/daemonset/agent-rbac.yaml's
RBAC and admission policies, through both API clients (kube_rest and the kubernetes package).

- The slices of dgx-h100, dgx-a100-mig (MIG: counters), cgpu-v100 (sharing: consumable
  capacity) and mixed-gpu-npu pass the server's validation with every field kept; read back,
  they hold the devices discovery found; a second sync writes nothing.
- A health change rewrites the one slice with a taint at the next generation; a vendor no
  longer served loses its slices; the generation survives a new publisher.
- The admission policy refuses the agent's token another node's slices, slices without a node
  and foreign drivers, and allows its own.
- deploy/dra (DeviceClasses) and its example claims and pods pass a server-side dry run.
- A real kube-scheduler allocates claims from the slices through those DeviceClasses: whole GPUs
  but never a tainted one, two MIG devices of one GPU, and shares of one GPU until its cores are
  used up. The session's plane runs no controller-manager: claims are made directly rather than
  from templates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import testcluster
import yaml
from k8s_test_helpers import KwokCluster, wait_for
from kube_tools import Kubectl
from manifests import dry_run_warnings, kubectl_name, kustomized
from test_node_labels import agent_view, pod_bound_token

from edl_agent.config import Settings, load_settings
from edl_agent.devices import names
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.model import Inventory, Vendor
from edl_agent.dra.api import GROUP_VERSION, SLICES, KubeDraApi
from edl_agent.dra.publisher import SlicePublisher
from edl_agent.dra.slices import desired_slices, same_content, slice_name, with_generation
from edl_agent.dra.wiring import StaleSliceCleanup
from edl_agent.kube import ApiError, KubeApi
from edl_agent.kube_credentials import Credentials
from edl_agent.kube_rest import RestKubeApi
from edl_agent.runtime.supervisor import Supervisor
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DRA = REPO / "deploy" / "dra"
T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
NVIDIA = names.driver_name(Vendor.NVIDIA)
ASCEND = names.driver_name(Vendor.ASCEND)
FORBIDDEN = 403
NOT_FOUND = 404


@dataclass(frozen=True)
class Simulated:
    inventory: Inventory
    settings: Settings

    def slices(self, node: str, unhealthy: Any = (), at: datetime = T0) -> dict[str, Any]:
        return desired_slices((self.inventory, unhealthy), self.settings, node, at)

    def device_id(self, index: int) -> str:
        return next(d.id for d in self.inventory.devices if d.index == index and d.kind == "gpu")


PROFILES = ("dgx-h100", "dgx-a100-mig", "cgpu-v100", "mixed-gpu-npu")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Simulated]:
    """Each profile discovered once, every vendor served through DRA."""
    found = {}
    for name in PROFILES:
        root = tmp_path_factory.mktemp(name)
        profile = load_profile(name)
        build_tree(profile, root)
        overrides = {"host_root": str(root), **{v.value: {"serve": "dra"} for v in Vendor}}
        settings = load_settings(defaults=profile.config, overrides=overrides)
        found[name] = Simulated(discover_node(settings), settings)
    return found


@dataclass
class Agent:
    """The agent's view of its node: DRA calls with its pod-bound token over both clients, and
    the admin's for checking."""

    node: str
    other: str
    rest: KubeDraApi
    kube: KubeDraApi
    raw: RestKubeApi
    package: KubeApi
    admin: KubeDraApi

    def client(self, kind: str) -> KubeDraApi:
        return self.rest if kind == "rest" else self.kube

    def stored(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        items = self.admin.list_resource_slices(node=node or self.node)
        return {item["metadata"]["name"]: item for item in items}


def a_slice(node: str | None, driver: str = NVIDIA, name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node or "anywhere", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0", "attributes": {"kind": {"string": "gpu"}}}],
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"probe-{node or 'all'}-{driver.partition('.')[0]}"},
        "spec": spec,
    }


def refusal(call: Callable[[], object]) -> tuple[int | None, str]:
    try:
        call()
    except ApiError as exc:
        return exc.status, str(exc)
    return 200, "allowed"


@pytest.fixture
def agent(k8s: KwokCluster, k8s_control_plane: testcluster.ControlPlane) -> Iterator[Agent]:
    node = k8s.create_gpu_node().metadata.name
    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    admin = KubeDraApi(KubeApi(k8s.api))
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(agent_view(k8s, node))
        credentials = Credentials(
            server=k8s_control_plane.server,
            ca_file=str(k8s_control_plane.ca_file),
            token=pod_bound_token(k8s, node),
        )
        raw = RestKubeApi(credentials)
        stack.callback(raw.close)
        rest = KubeDraApi(raw)

        def policy_applies() -> bool:
            probe = a_slice(other)
            create = lambda: raw.request("POST", SLICES, probe, query={"dryRun": "All"})  # noqa: E731
            status, message = refusal(create)
            return status == FORBIDDEN and "ResourceSlices of the node its pod runs on" in message

        # RBAC and admission policies reach the API server's caches a moment after creation.
        wait_for("the ResourceSlice policy to apply", policy_applies, bool, timeout=30)
        yield Agent(node, other, rest, KubeDraApi(view.api), raw, view.api, admin)
        for item_node in (node, other):
            for item in admin.list_resource_slices(node=item_node):
                admin.delete_resource_slice(item["metadata"]["name"])


def driver_devices(stored: Mapping[str, dict[str, Any]]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for item in stored.values():
        spec = item["spec"]
        found.setdefault(spec["driver"], set()).update(d["name"] for d in spec.get("devices", []))
    return found


def expected_devices(sim: Simulated) -> dict[str, set[str]]:
    """Driver → device names: everything discovered, MIG devices in place of their GPU."""
    devices = sim.inventory.devices
    split = {d.parent for d in devices if d.parent}
    all_names = names.device_names(devices)
    expected: dict[str, set[str]] = {}
    for device in devices:
        if device.id not in split:
            expected.setdefault(names.driver_name(device.vendor), set()).add(all_names[device.id])
    return expected


# --- accepted, and read back as discovered ----------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "client"),
    [("dgx-h100", "rest"), ("dgx-a100-mig", "kube"), ("cgpu-v100", "rest"),
     ("mixed-gpu-npu", "kube")],
)  # fmt: skip
def test_every_profiles_slices_are_accepted_and_read_back_as_discovered(
    agent: Agent, simulated: dict[str, Simulated], profile: str, client: str
) -> None:
    sim = simulated[profile]
    desired = sim.slices(agent.node)
    publisher = SlicePublisher(agent.client(client), agent.node)

    first = publisher.sync(desired)

    assert publisher.unsupported == frozenset()  # the server kept every field
    assert first.created == sum(len(specs) for specs in desired.values())
    stored = agent.stored()
    assert driver_devices(stored) == expected_devices(sim)
    node_uid = agent.admin.read_node(agent.node)["metadata"]["uid"]
    for driver, specs in desired.items():
        for index, spec in enumerate(with_generation(specs, 1)):
            item = stored[slice_name(agent.node, driver, index)]
            assert same_content(spec, item["spec"]), (driver, index)
            assert item["metadata"]["ownerReferences"] == [
                {"apiVersion": "v1", "kind": "Node", "name": agent.node, "uid": node_uid,
                 "controller": True}
            ]  # fmt: skip
    by_id = {d.id: d for d in sim.inventory.devices}
    for item in stored.values():
        for device in item["spec"].get("devices", []):
            found = by_id[device["attributes"]["id"]["string"]]
            assert device["attributes"]["index"] == {"int": found.index}
            assert device["attributes"]["kind"] == {"string": found.kind}

    again = publisher.sync(sim.slices(agent.node, at=T0 + timedelta(minutes=5)))

    assert again.writes == 0
    assert {n: i["metadata"]["resourceVersion"] for n, i in agent.stored().items()} == {
        n: i["metadata"]["resourceVersion"] for n, i in stored.items()
    }


def test_mig_counters_and_shared_capacity_are_stored_as_sent(
    agent: Agent, simulated: dict[str, Simulated]
) -> None:
    mig, shared = simulated["dgx-a100-mig"], simulated["cgpu-v100"]
    SlicePublisher(agent.rest, agent.node).sync(mig.slices(agent.node))
    counters = agent.stored()[slice_name(agent.node, NVIDIA, 1)]["spec"]["sharedCounters"]
    assert [c["name"] for c in counters] == [f"gpu-{i}" for i in range(6)]
    assert counters[0]["counters"] == {"memory": {"value": "80Gi"}}

    SlicePublisher(agent.rest, agent.node).sync(shared.slices(agent.node))

    (item,) = agent.stored().values()
    gpu0 = item["spec"]["devices"][0]
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["capacity"]["cores"]["requestPolicy"] == {
        "default": "5",
        "validRange": {"min": "5", "step": "5"},
    }
    assert item["spec"]["pool"]["generation"] == 2  # the same pool, now one slice


# --- changes ----------------------------------------------------------------------------------


def test_a_health_change_rewrites_only_the_taint_at_the_next_generation(
    agent: Agent, simulated: dict[str, Simulated]
) -> None:
    h100 = simulated["dgx-h100"]
    SlicePublisher(agent.rest, agent.node).sync(h100.slices(agent.node))
    (before,) = agent.stored().values()
    sick = {h100.device_id(3): "XID79"}
    restarted = SlicePublisher(agent.kube, agent.node)  # a new agent process

    result = restarted.sync(h100.slices(agent.node, sick, T0 + timedelta(minutes=1)))

    assert (result.created, result.updated, result.deleted) == (0, 1, 0)
    assert result.generations == {NVIDIA: 2}
    (after,) = agent.stored().values()
    old, new = before["spec"], after["spec"]
    assert new["pool"]["generation"] == 2
    (taint,) = new["devices"][3]["taints"]
    assert taint == {
        "key": "edl.io/unhealthy",
        "value": "XID79",
        "effect": "NoSchedule",
        "timeAdded": "2026-05-01T12:01:00Z",
    }
    untainted = [{k: v for k, v in d.items() if k != "taints"} for d in new["devices"]]
    assert untainted == old["devices"]
    assert {k: v for k, v in new.items() if k not in {"pool", "devices"}} == {
        k: v for k, v in old.items() if k not in {"pool", "devices"}
    }

    later = restarted.sync(h100.slices(agent.node, sick, T0 + timedelta(hours=1)))
    healed = restarted.sync(h100.slices(agent.node))

    assert later.writes == 0  # the taint keeps the time it first appeared
    assert healed.generations == {NVIDIA: 3}
    (final,) = agent.stored().values()
    assert not any("taints" in d for d in final["spec"]["devices"])


def test_a_vendor_no_longer_served_loses_its_slices(
    agent: Agent, simulated: dict[str, Simulated]
) -> None:
    mixed = simulated["mixed-gpu-npu"]
    publisher = SlicePublisher(agent.kube, agent.node)
    publisher.sync(mixed.slices(agent.node))
    assert set(driver_devices(agent.stored())) == {NVIDIA, ASCEND}
    nvidia_before = agent.stored()[slice_name(agent.node, NVIDIA, 0)]["metadata"]
    settings = dataclasses.replace(
        mixed.settings, ascend=dataclasses.replace(mixed.settings.ascend, serve="device-plugin")
    )

    result = publisher.sync(desired_slices((mixed.inventory, ()), settings, agent.node, T0))

    assert (result.created, result.updated, result.deleted) == (0, 0, 1)
    stored = agent.stored()
    assert set(driver_devices(stored)) == {NVIDIA}
    nvidia_after = stored[slice_name(agent.node, NVIDIA, 0)]["metadata"]
    assert nvidia_after["resourceVersion"] == nvidia_before["resourceVersion"]

    assert publisher.remove_all().deleted == 1
    assert agent.stored() == {}


def test_the_clean_up_part_removes_the_slices_a_former_configuration_left(
    agent: Agent, simulated: dict[str, Simulated]
) -> None:
    SlicePublisher(agent.kube, agent.node).sync(simulated["mixed-gpu-npu"].slices(agent.node))
    assert agent.stored()
    stop = threading.Event()
    supervisor = Supervisor(stop)
    supervisor.add(StaleSliceCleanup(agent.kube, agent.node))
    supervisor.start()
    try:
        wait_until(lambda: supervisor.ready()[0], 30, what="the clean-up done")
        assert agent.stored() == {}
        assert supervisor.statuses()[0].restarts == 0
    finally:
        stop.set()
        supervisor.join()


# --- the admission policy ---------------------------------------------------------------------


def test_the_policy_keeps_the_agent_to_its_own_nodes_slices(agent: Agent) -> None:
    raw = agent.raw
    agent.admin.create_resource_slice(a_slice(agent.other, name="others-slice"))
    own = a_slice(agent.node, name="own-slice")

    created = agent.rest.create_resource_slice(own)
    own["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    own["spec"]["pool"]["generation"] = 2
    assert agent.kube.replace_resource_slice("own-slice", own)["spec"]["pool"]["generation"] == 2
    assert agent.rest.delete_resource_slice("own-slice") is True

    theirs = agent.admin.list_resource_slices(node=agent.other)[0]
    refused = {
        "another node's slice": lambda: agent.rest.create_resource_slice(a_slice(agent.other)),
        "a slice of every node": lambda: agent.rest.create_resource_slice(a_slice(None)),
        "a foreign driver": lambda: agent.rest.create_resource_slice(
            a_slice(agent.node, driver="gpu.example.com")
        ),
        "replacing another node's": lambda: agent.rest.replace_resource_slice(
            "others-slice", theirs
        ),
        "deleting another node's": lambda: agent.kube.delete_resource_slice("others-slice"),
        "patching its own": lambda: raw.request(
            "PATCH", f"{SLICES}/x", {"metadata": {}}, content_type="application/merge-patch+json"
        ),
    }
    answers = {what: refusal(call) for what, call in refused.items()}

    assert {what: status for what, (status, _) in answers.items()} == dict.fromkeys(
        refused, FORBIDDEN
    )
    assert f"not those of {agent.other}" in answers["another node's slice"][1]
    assert "not those of no node" in answers["a slice of every node"][1]
    assert "own drivers, not gpu.example.com" in answers["a foreign driver"][1]
    assert "others-slice" in agent.stored(agent.other)


def test_the_policys_drivers_are_the_agents() -> None:
    docs = [
        d for d in yaml.safe_load_all((REPO / "deploy/daemonset/agent-rbac.yaml").read_text()) if d
    ]
    policy = next(
        d for d in docs if d["metadata"]["name"] == "edl-agent-own-resourceslices"
        and d["kind"] == "ValidatingAdmissionPolicy"
    )  # fmt: skip
    (rule,) = [
        v["expression"] for v in policy["spec"]["validations"] if "driver in" in v["expression"]
    ]
    listed = yaml.safe_load(rule.split(" in ", 1)[1])

    assert listed == [names.driver_name(v) for v in names.CLASSES]


def test_both_clients_requests_fail_with_the_http_status(agent: Agent) -> None:
    missing = f"{SLICES}/{agent.node}-missing"
    invalid = a_slice(agent.node, driver="Bad_Driver", name="bad-driver")

    for client in (agent.raw, agent.package):
        assert refusal(lambda c=client: c.request("GET", missing))[0] == NOT_FOUND
        status, message = refusal(lambda c=client: c.request("POST", SLICES, invalid))
        assert status == 422, message
        assert "spec.driver" in message


# --- deploy/dra ---------------------------------------------------------------------------


def test_the_device_classes_and_the_examples_pass_a_server_side_dry_run(
    kubectl: Kubectl, k8s: KwokCluster
) -> None:
    classes = kubectl("apply", "--dry-run=server", "-k", str(DRA))
    examples = sorted(DRA.glob("example-*.yaml"))
    tried = kubectl(
        "apply", "--dry-run=server", "-n", k8s.namespace, *(f"-f={e}" for e in examples)
    )

    docs = kustomized(DRA)
    assert {d["kind"] for d in docs} == {"DeviceClass"}
    assert {line.split()[0] for line in classes.stdout.splitlines() if line.strip()} == {
        kubectl_name(d) for d in docs
    }
    assert {d["metadata"]["name"] for d in docs} == {
        *(names.driver_name(v) for v in names.CLASSES),
        "mig.nvidia.edl.io",
    }
    assert not dry_run_warnings(classes.stderr), classes.stderr
    assert len([ln for ln in tried.stdout.splitlines() if "(server dry run)" in ln]) == 2 * len(
        examples
    )
    assert not dry_run_warnings(tried.stderr), tried.stderr
    kustomization = yaml.safe_load((DRA / "kustomization.yaml").read_text())
    on_disk = {p.name for p in DRA.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk - set(kustomization["resources"]) == {e.name for e in examples}


# --- allocated by the real scheduler ------------------------------------------------------


@pytest.fixture(scope="module")
def device_classes(kubectl: Kubectl) -> Iterator[None]:
    """deploy/dra's DeviceClasses for real, for this module's claims."""
    kubectl("apply", "--server-side", "--field-manager=edl-test-dra", "-k", str(DRA))
    yield
    kubectl("delete", "--ignore-not-found", "-k", str(DRA))


@dataclass
class Claims:
    """ResourceClaims and the pods using them in one test's namespace, placed by the scheduler
    on `node` (the session's plane runs no controller-manager: claims are made directly, not from
    templates)."""

    k8s: KwokCluster
    node: str
    admin: KubeApi
    made: list[str] = dataclasses.field(default_factory=list)

    def path(self, name: str = "") -> str:
        base = f"/apis/{GROUP_VERSION}/namespaces/{self.k8s.namespace}/resourceclaims"
        return f"{base}/{name}" if name else base

    def claim(self, name: str, example: str) -> None:
        """A claim with the spec of deploy/dra/`example`'s template, and a pod using it."""
        docs = list(yaml.safe_load_all((DRA / example).read_text()))
        template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
        self.make(name, template["spec"]["spec"])

    def request(self, name: str, exactly: dict[str, Any]) -> None:
        """A claim with the one request `exactly`, and a pod using it."""
        self.make(name, {"devices": {"requests": [{"name": "devices", "exactly": exactly}]}})

    def make(self, name: str, spec: dict[str, Any]) -> None:
        self.admin.request("POST", self.path(), {"metadata": {"name": name}, "spec": spec})
        self.made.append(name)
        pod = {
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": self.node},
                # Nodes are created with this taint; the controller that lifts it does not run.
                "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}],
                "resourceClaims": [{"name": "devices", "resourceClaimName": name}],
                "containers": [{
                    "name": "main", "image": "registry.invalid/edl/worker:test",
                    "resources": {"claims": [{"name": "devices"}]},
                }],
            },
        }  # fmt: skip
        self.admin.request("POST", f"/api/v1/namespaces/{self.k8s.namespace}/pods", pod)

    def allocated(self, name: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The devices the scheduler gave the claim, once its pod is bound to the node."""
        wait_for(
            f"pod {name} bound to {self.node}",
            lambda: (self.k8s.read_pod(name).spec.node_name, self.scheduling(name)),
            lambda seen: seen[0] == self.node,
            timeout,
        )
        claim = self.admin.request("GET", self.path(name))
        results: list[dict[str, Any]] = claim["status"]["allocation"]["devices"]["results"]
        return results

    def scheduling(self, name: str) -> str:
        """The pod's PodScheduled condition as `reason: message` (empty before the first try)."""
        status = self.k8s.read_pod(name).status
        found = next((c for c in status.conditions or [] if c.type == "PodScheduled"), None)
        return "" if found is None else f"{found.reason}: {found.message}"

    def cleanup(self) -> None:
        self.k8s.core.delete_collection_namespaced_pod(self.k8s.namespace, grace_period_seconds=0)
        for name in self.made:  # the controller that would drop the finalizer does not run
            patch = {"metadata": {"finalizers": None}}
            with contextlib.suppress(ApiError):
                self.admin.request(
                    "PATCH", self.path(name), patch, content_type="application/merge-patch+json"
                )
                self.admin.request("DELETE", self.path(name))


@pytest.fixture
def claims(
    agent: Agent, k8s: KwokCluster, device_classes: None, kube_scheduler: object
) -> Iterator[Claims]:
    made = Claims(k8s, agent.node, KubeApi(k8s.api))
    yield made
    made.cleanup()


def test_the_scheduler_allocates_whole_gpus_but_not_a_tainted_one(
    agent: Agent, claims: Claims, simulated: dict[str, Simulated]
) -> None:
    h100 = simulated["dgx-h100"]
    SlicePublisher(agent.rest, agent.node).sync(h100.slices(agent.node, {h100.device_id(3): "X"}))

    claims.request("seven", {"deviceClassName": "gpu.nvidia.edl.io", "count": 7})
    results = claims.allocated("seven")
    claims.claim("hopper", "example-nvidia-gpu.yaml")  # only the tainted gpu-3 is left

    assert {(r["driver"], r["pool"]) for r in results} == {(NVIDIA, agent.node)}
    assert sorted(r["device"] for r in results) == [f"gpu-{i}" for i in range(8) if i != 3]
    wait_for(
        "the claim for the last GPU to be unschedulable",
        lambda: claims.scheduling("hopper"),
        lambda why: why.startswith("Unschedulable"),
        timeout=60,
    )


def test_the_scheduler_keeps_a_claim_on_one_numa_node_by_the_standard_attribute(
    agent: Agent, claims: Claims, simulated: dict[str, Simulated]
) -> None:
    h100 = simulated["dgx-h100"]  # GPUs 0-3 on NUMA node 0, 4-7 on node 1
    SlicePublisher(agent.rest, agent.node).sync(h100.slices(agent.node))
    claims.request("first", {"deviceClassName": "gpu.nvidia.edl.io", "count": 3})
    taken = {r["device"] for r in claims.allocated("first")}

    spec = {
        "devices": {
            "requests": [
                {"name": "devices", "exactly": {"deviceClassName": "gpu.nvidia.edl.io", "count": 4}}
            ],
            "constraints": [{"matchAttribute": "resource.kubernetes.io/numaNode"}],
        }
    }
    claims.make("numa", spec)
    results = claims.allocated("numa")

    numa = {d.id: d.numa_node for d in h100.inventory.devices}
    chosen = sorted(r["device"] for r in results)
    assert len(chosen) == 4
    assert not taken & set(chosen)
    assert len({numa[h100.device_id(int(name.split("-")[1]))] for name in chosen}) == 1


def test_a_plain_extended_resource_request_is_served_through_dra_on_a_dra_only_node(
    agent: Agent, claims: Claims, k8s: KwokCluster, simulated: dict[str, Simulated]
) -> None:
    """KEP-5004: the DeviceClass names `nvidia.com/gpu`; a node that does not offer it the
    device-plugin way (no such allocatable) serves `nvidia.com/gpu: 2` from its slices."""
    node = k8s.create_gpu_node(gpus=0, gpu_resource="edl.test/nothing").metadata.name
    assert "nvidia.com/gpu" not in (k8s.core.read_node(node).status.allocatable or {})
    h100 = simulated["dgx-h100"]
    publisher = SlicePublisher(KubeDraApi(claims.admin), node)  # an admin's: another node's
    publisher.sync(h100.slices(node))
    try:
        pod = {
            "metadata": {"name": "plain"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}],
                "containers": [{
                    "name": "main", "image": "registry.invalid/edl/worker:test",
                    "resources": {"limits": {"nvidia.com/gpu": "2"}},
                }],
            },
        }  # fmt: skip
        claims.admin.request("POST", f"/api/v1/namespaces/{k8s.namespace}/pods", pod)
        bound = wait_for(
            "pod plain bound with its extended-resource claim",
            lambda: k8s.api.sanitize_for_serialization(k8s.read_pod("plain")),
            lambda p: (
                p["spec"].get("nodeName") == node
                and (p["status"].get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
            ),
            timeout=60,
        )
        name = bound["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
        claim = claims.admin.request("GET", claims.path(name))
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 2
        assert {(r["driver"], r["pool"]) for r in results} == {(NVIDIA, node)}
    finally:
        publisher.remove_all()


def test_the_scheduler_allocates_mig_devices_of_one_gpu(
    agent: Agent, claims: Claims, simulated: dict[str, Simulated]
) -> None:
    SlicePublisher(agent.rest, agent.node).sync(simulated["dgx-a100-mig"].slices(agent.node))

    claims.claim("mig", "example-nvidia-mig.yaml")
    results = claims.allocated("mig")

    devices = sorted(r["device"] for r in results)
    assert len(devices) == 2
    # 1g.10gb devices live on GPUs 2 and 3 (seven each) and GPUs 4 and 5 (one each).
    assert devices[0].rsplit("-mig-", 1)[0] == devices[1].rsplit("-mig-", 1)[0]
    assert devices[0].split("-mig-")[0] in {"gpu-2", "gpu-3"}


def test_the_scheduler_shares_a_gpu_by_capacity(
    agent: Agent, claims: Claims, simulated: dict[str, Simulated]
) -> None:
    SlicePublisher(agent.rest, agent.node).sync(simulated["cgpu-v100"].slices(agent.node))
    on_gpu0 = {
        "deviceClassName": "gpu.nvidia.edl.io",
        "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.edl.io'].index == 0"}}],
        "capacity": {"requests": {"cores": "30"}},
    }

    taken = []
    for i in range(3):
        claims.request(f"third-{i}", on_gpu0)
        taken.extend(claims.allocated(f"third-{i}"))
    claims.request("fourth", on_gpu0)
    claims.claim("example", "example-nvidia-share.yaml")
    (example,) = claims.allocated("example")

    assert {r["device"] for r in taken} == {"gpu-0"}
    assert [r["consumedCapacity"] for r in taken] == [
        {"memory": "1Gi", "cores": "30", "replicas": "1"}  # the defaults but for cores
    ] * 3
    assert len({r["shareID"] for r in taken}) == 3
    wait_for(  # 3 x 30% of gpu-0 taken: another 30% does not fit
        "a claim beyond gpu-0's capacity to be unschedulable",
        lambda: claims.scheduling("fourth"),
        lambda why: why.startswith("Unschedulable"),
        timeout=60,
    )
    assert example["consumedCapacity"] == {"memory": "4Gi", "cores": "20", "replicas": "1"}
    assert example["device"] != "gpu-0"  # 10% left there
