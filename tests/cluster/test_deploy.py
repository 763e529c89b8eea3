"""deploy/daemonset, the way a user installs it: `kubectl apply -k` against the real API server.

- The kustomization passes a server-side dry run (every object validated and admitted by the API
  server, nothing stored), also with the opt-in privileged patch.
- Applied for real (server-side apply), its ServiceAccounts can do what the agent and the
  restarter call, through the agent's own API adapter and the calls the restarter makes, with
  tokens as kubelet gives them, and are refused what they must not do; `kubectl auth can-i`
  checks the same grants verb by verb.
- The manifests agree with each other and with the code (flags, settings, names, ports).
- The PrometheusRule's groups pass `promtool check rules`, and every alert fires, or stays
  quiet, on sample series (`promtool test rules`).

The Prometheus Operator's CRDs (ServiceMonitor, PrometheusRule) are taken from its Go module at a
pinned version through the Go module proxy, cached in .cache/prometheus-operator/, and installed
for real: a dry run of a ServiceMonitor needs its kind to exist (kube_tools.py, the fixture
monitoring_crds).

The control plane is shared by the whole session: the manifests' cluster-wide objects (the CRD,
the ClusterRoles, the admission policy) and edl-system are applied with server-side apply and
--force-conflicts, which other tests' installs tolerate, and are left in place at the end; only
the workloads and the pods made for tokens are removed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_test_helpers import KwokCluster, bound_tokens, wait_for
from kube_tools import Kubectl, wait_established
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from manifests import delete_workloads, dry_run_warnings, kubectl_name, kustomized

from edl_agent import log
from edl_agent.cli.command import build_parser
from edl_agent.cli.run import run_command
from edl_agent.cli.settings import settings_from_args
from edl_agent.config import FaultSettings, Settings
from edl_agent.devices import names
from edl_agent.devices.discovery import node_name
from edl_agent.devices.hostroot import HostRoot
from edl_agent.dra.api import KubeDraApi
from edl_agent.kube import ApiError, KubeApi
from edl_agent.labels.ownership import OWNED_LABELS
from edl_agent.restarter import cli as restarter_cli
from edl_agent.restarter.adapters.events import reference
from edl_agent.restarter.core.settings import RestarterSettings
from tests.prometheus_runner import need

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "daemonset"
NAMESPACE = "edl-system"
AGENT = f"system:serviceaccount:{NAMESPACE}:edl-agent"
RESTARTER = f"system:serviceaccount:{NAMESPACE}:edl-restarter"
FIELD_MANAGER = "edl-test-deploy"
MINTING_POD_LABEL = "edl.io/test-deploy-token"
GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
MERGE = "application/merge-patch+json"
FORBIDDEN = 403


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def built() -> list[dict[str, Any]]:
    """What `kubectl kustomize deploy/daemonset` renders, read without a cluster."""
    return kustomized(DEPLOY)


def status_of(call: Callable[[], object]) -> int:
    """The HTTP status of an API call made with a ServiceAccount's token (200 when it passed)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, dict | list | str):
            for _ in result:  # a watch: run it to its (short) timeout
                pass
    except ApiException as exc:
        return int(exc.status)
    except ApiError as exc:
        return int(exc.status or 0)
    return 200


def message_of(call: Callable[[], object]) -> str:
    try:
        call()
    except ApiException as exc:
        return str(json.loads(exc.body or "{}").get("message", exc.reason))
    except ApiError as exc:
        return str(exc)
    return "allowed"


def sa_client(admin: client.ApiClient, token: str) -> client.ApiClient:
    config = client.Configuration()
    config.host = admin.configuration.host
    config.ssl_ca_cert = admin.configuration.ssl_ca_cert
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(config)


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployed(
    kubectl: Kubectl, monitoring_crds: None, k8s_api_client: client.ApiClient
) -> Iterator[None]:
    """deploy/daemonset applied for real, server-side, as one field manager taking over what
    other tests applied before (the CRD). Nothing runs it: no controller-manager or kubelet."""
    kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        f"--field-manager={FIELD_MANAGER}",
        "-k",
        str(DEPLOY),
    )
    wait_established(client.ApiextensionsV1Api(k8s_api_client), f"{PLURAL}.{GROUP}")
    yield
    delete_workloads(kubectl)


@pytest.fixture
def bound_token(k8s_api_client: client.ApiClient) -> Iterator[Callable[..., str]]:
    """`bound_token(node, service_account)`: a token as kubelet gives a pod of that edl-system
    ServiceAccount on `node` (bound to the pod, so it names the node); the pods go afterwards."""
    core = client.CoreV1Api(k8s_api_client)

    def mint(node: str, service_account: str, audiences: list[str] | None = None) -> str:
        labels = {MINTING_POD_LABEL: "true"}
        wanted = [audiences or []]
        return bound_tokens(core, NAMESPACE, node, service_account, wanted, pod_labels=labels)[0]

    yield mint
    core.delete_collection_namespaced_pod(
        NAMESPACE, label_selector=MINTING_POD_LABEL, grace_period_seconds=0
    )


def restarter_token(admin: client.ApiClient) -> str:
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    response = client.CoreV1Api(admin).create_namespaced_service_account_token(
        "edl-restarter", NAMESPACE, request
    )
    return str(response.status.token)


# --- (a) the server-side dry run ----------------------------------------------------------


def dry_run_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.strip()]


def test_the_kustomization_passes_a_server_side_dry_run(
    kubectl: Kubectl, monitoring_crds: None
) -> None:
    # A dry run stores nothing, so objects in a namespace it would create are refused
    # ("namespaces edl-system not found"): the namespace alone is applied for real first.
    kubectl("apply", "-f", str(DEPLOY / "namespace.yaml"))

    result = kubectl("apply", "--dry-run=server", "-k", str(DEPLOY))

    lines = dry_run_lines(result)
    assert all(line.endswith("(server dry run)") for line in lines), result.stdout
    assert {line.split()[0] for line in lines} == {kubectl_name(doc) for doc in built()}
    assert not dry_run_warnings(result.stderr), result.stderr


def test_the_privileged_patch_passes_a_server_side_dry_run(
    kubectl: Kubectl, monitoring_crds: None, tmp_path: Path
) -> None:
    overlay = tmp_path / "privileged"
    overlay.mkdir()
    shutil.copy(DEPLOY / "agent-privileged-patch.yaml", overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY, overlay)],
                "patches": [{"path": "agent-privileged-patch.yaml"}],
            }
        )
    )
    kubectl("apply", "-f", str(DEPLOY / "namespace.yaml"))

    result = kubectl("apply", "--dry-run=server", "-k", str(overlay))

    assert "daemonset.apps/edl-agent" in result.stdout
    rendered = kubectl("kustomize", str(overlay)).stdout
    daemonset = find(list(yaml.safe_load_all(rendered)), "DaemonSet", "edl-agent")
    context = daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert context["privileged"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}  # the rest of the default stays


# --- the manifests agree with each other and with the code --------------------------------


def test_the_manifests_agree_with_each_other_and_the_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    docs = built()
    daemonset = find(docs, "DaemonSet", "edl-agent")
    pod = daemonset["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    deployment = find(docs, "Deployment", "edl-restarter")
    (restarter,) = deployment["spec"]["template"]["spec"]["containers"]
    intake = find(docs, "Service", "edl-restarter")

    # The agent's flags and environment make valid settings, pointing where the pod mounts.
    assert agent["command"] == ["edl-agent"]
    args = build_parser().parse_args(agent["args"])
    assert args.handler is run_command
    env = {e["name"]: e.get("value", "") for e in agent["env"]}
    env["NODE_NAME"] = "gpu-node-1"  # from the downward API
    monkeypatch.setattr(log, "configure", lambda *_args, **_kw: None)
    settings: Settings = settings_from_args(args, environ=env)
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert node_name(settings, HostRoot.at(tmp_path), env) == "gpu-node-1"
    assert settings.host_root == mounts["host-root"]["mountPath"] == "/host"
    assert volumes["host-root"]["hostPath"]["path"] == "/"
    assert mounts["host-root"]["readOnly"] is True
    assert settings.plugin.kubelet_dir == mounts["device-plugins"]["mountPath"]
    assert volumes["device-plugins"]["hostPath"]["path"] == settings.plugin.kubelet_dir
    assert Path(settings.pod_resources_socket).parent == Path(mounts["pod-resources"]["mountPath"])
    assert settings.faults.state_dir == mounts["state"]["mountPath"]
    assert volumes["state"]["hostPath"]["path"] == settings.faults.state_dir
    assert mounts["dev"]["mountPath"] == volumes["dev"]["hostPath"]["path"] == "/dev"
    # DRA: kubelet's plugin watcher finds our sockets, the runtime reads our CDI specs.
    for volume, directory in (
        ("plugins-registry", settings.dra.plugins_registry_dir),
        ("cdi", settings.dra.cdi_dir),
    ):
        assert mounts[volume]["mountPath"] == volumes[volume]["hostPath"]["path"] == directory
    # The token: projected for the restarter's audience, where faults.token_file reads it.
    assert settings.faults.token_file == FaultSettings().token_file
    (source,) = volumes["restarter-token"]["projected"]["sources"]
    token = source["serviceAccountToken"]
    assert token["audience"] == RestarterSettings().intake.audience
    assert settings.faults.token_file == f"{mounts['restarter-token']['mountPath']}/{token['path']}"
    (ca,) = volumes["restarter-ca"]["configMap"]["items"]
    assert settings.faults.ca_file == f"{mounts['restarter-ca']['mountPath']}/{ca['path']}"
    # The restarter address is the intake Service, on its intake port.
    host, port = settings.faults.restarter_address.rsplit(":", 1)
    assert host == f"{intake['metadata']['name']}.{intake['metadata']['namespace']}.svc"
    ports = {p["name"]: p for p in intake["spec"]["ports"]}
    assert int(port) == ports["intake"]["port"]
    # Metrics, probes and the Service on the port the agent serves.
    agent_port = int(settings.metrics_addr.rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {"metrics": agent_port}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert agent[probe]["httpGet"] == {"path": path, "port": "metrics"}
    agent_service = find(docs, "Service", "edl-agent")
    assert agent_service["spec"]["clusterIP"] == "None"
    assert agent_service["spec"]["selector"].items() <= pod_labels(daemonset).items()
    assert pod["serviceAccountName"] == "edl-agent"
    assert pod["priorityClassName"] == "system-node-critical"
    context = agent["securityContext"]
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert agent["resources"]["limits"]["memory"] == "256Mi"

    # The restarter: its agent ServiceAccount and audience are the agent's; the intake Service
    # selects the leader's pod; the metrics Service both replicas.
    assert restarter["args"][0] == "restarter"
    flags = dict(a.removeprefix("--").split("=", 1) for a in restarter["args"][1:])
    assert flags["agent-service-account"] == f"{NAMESPACE}/{pod['serviceAccountName']}"
    assert flags["listen"] == f":{ports['intake']['port']}"
    assert flags["metrics-addr"] == f":{ports['metrics']['port']}"
    restarter_pod = pod_labels(deployment)
    assert intake["spec"]["selector"] == {
        "app.kubernetes.io/name": restarter_pod["app.kubernetes.io/name"],
        "edl.io/restarter-leader": "true",
    }
    metrics = find(docs, "Service", "edl-restarter-metrics")
    assert metrics["spec"]["selector"].items() <= restarter_pod.items()
    assert "edl.io/restarter-leader" not in metrics["spec"]["selector"]
    assert deployment["spec"]["replicas"] == 2
    names = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in restarter["env"]}
    assert names == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    restarter_context = deployment["spec"]["template"]["spec"]["securityContext"]
    assert restarter_context["runAsNonRoot"] is True
    assert restarter["securityContext"]["readOnlyRootFilesystem"] is True
    assert restarter["securityContext"]["capabilities"] == {"drop": ["ALL"]}

    # Only the agents reach the intake, only Prometheus the metrics, by the ports' names.
    policy = find(docs, "NetworkPolicy", "edl-restarter")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(deployment).items()
    rules = {r["ports"][0]["port"]: r["from"][0] for r in policy["spec"]["ingress"]}
    assert set(rules) <= {p["name"] for p in restarter["ports"]}
    assert rules["intake"]["podSelector"]["matchLabels"].items() <= pod_labels(daemonset).items()
    assert "namespaceSelector" not in rules["intake"]  # the agents' own namespace only

    # Every manifest is installed, except the example policy and the opt-in patch.
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk - listed == {"example-policy.yaml", "agent-privileged-patch.yaml"}
    assert all(doc["metadata"].get("namespace") in {None, NAMESPACE, "default"} for doc in docs)


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def test_the_restarter_flags_are_the_commands_own() -> None:
    deployment = find(built(), "Deployment", "edl-restarter")
    (restarter,) = deployment["spec"]["template"]["spec"]["containers"]

    args = build_parser().parse_args(restarter["args"])  # exits 2 on an unknown flag

    assert args.command == "restarter"
    assert restarter_cli.settings_from_args(args, environ={}).election.lease_name == "edl-restarter"


# --- (b) applied for real: what each ServiceAccount may do ----------------------------------


def test_the_agent_account_may_make_every_call_the_agent_makes(
    deployed: None, k8s: KwokCluster, bound_token: Callable[..., str]
) -> None:
    node = k8s.create_gpu_node().metadata.name
    pod = k8s.create_pod(node=node)
    api = KubeApi(sa_client(k8s.api, bound_token(node, "edl-agent")))
    wait_for(
        "RBAC to reach the authorizer",
        lambda: status_of(lambda: api.read_node(node)),
        lambda status: status == 200,
    )

    # Labels and the owned-keys annotation, with the resourceVersion as a precondition.
    version = api.read_node(node)["metadata"]["resourceVersion"]
    labels = {"edl.io/accelerator.count": "8", "nvidia.com/gpu.count": "8"}
    patch = {
        "metadata": {
            "labels": labels,
            "annotations": {OWNED_LABELS: ",".join(sorted(labels))},
            "resourceVersion": version,
        }
    }
    written = api.patch_node(node, patch)
    assert labels.items() <= written["metadata"]["labels"].items()
    # The AcceleratorHealthy condition in the status subresource.
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": "AcceleratorHealthy",
        "status": "True",
        "reason": "AcceleratorsHealthy",
        "message": "8 of 8 accelerators healthy",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    status = api.patch_node_status(node, {"status": {"conditions": [condition]}})
    assert condition["reason"] in {c.get("reason") for c in status["status"]["conditions"]}
    # Its own Node watched (the cordon annotation), by name.
    first = next(iter(api.watch_node(node, resource_version=None, timeout_seconds=1)))
    assert first[1]["metadata"]["name"] == node
    # The pods on its node, in every namespace: listed, then watched.
    listing = api.list_pods(f"spec.nodeName={node}")
    assert pod.metadata.name in {p["metadata"]["name"] for p in listing["items"]}
    version = listing["metadata"]["resourceVersion"]
    assert (
        status_of(
            lambda: api.watch_pods(
                f"spec.nodeName={node}", resource_version=version, timeout_seconds=1
            )
        )
        == 200
    )
    # Events about its Node, in `default`, and the count of a repeat bumped.
    name = f"{node}.{secrets.token_hex(4)}"
    event = {
        "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node},
        "type": "Warning",
        "reason": "AcceleratorUnhealthy",
        "message": "GPU 3: XID79",
        "count": 1,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "source": {"component": "edl-agent", "host": node},
    }
    api.create_event("default", event)
    assert api.patch_event("default", name, {"count": 2})["count"] == 2
    k8s.core.delete_namespaced_event(name, "default")


def test_the_agent_account_is_refused_what_the_agent_must_not_do(
    deployed: None, k8s: KwokCluster, bound_token: Callable[..., str]
) -> None:
    node = k8s.create_gpu_node().metadata.name
    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    pod = k8s.create_pod(node=node)
    agent = sa_client(k8s.api, bound_token(node, "edl-agent"))
    core = client.CoreV1Api(agent)

    def patch_other_node() -> object:
        return core.patch_node(
            other,
            {"metadata": {"labels": {"edl.io/accelerator.count": "1"}}},
            dry_run="All",
            _content_type=MERGE,
        )

    # RBAC allows patching every node; the admission policy confines the agent to its own.
    wait_for(
        "the admission policy to apply",
        lambda: status_of(patch_other_node),
        lambda status: status == FORBIDDEN,
    )
    assert "only change the node its pod runs on" in message_of(patch_other_node)
    slices = KubeDraApi(KubeApi(agent))

    def slice_of(on: str, driver: str = "gpu.nvidia.edl.io") -> dict[str, Any]:
        spec = {"driver": driver, "nodeName": on, "pool": {"name": on, "generation": 1,
                "resourceSliceCount": 1}, "devices": [{"name": "gpu-0"}]}  # fmt: skip
        return {"metadata": {"name": f"{on}-probe"}, "spec": spec}

    wait_for(
        "the ResourceSlice policy to apply",
        lambda: status_of(lambda: slices.create_resource_slice(slice_of(other))),
        lambda status: status == FORBIDDEN,
    )
    assert "ResourceSlices of the node its pod runs on" in message_of(
        lambda: slices.create_resource_slice(slice_of(other))
    )
    assert slices.create_resource_slice(slice_of(node))["spec"]["nodeName"] == node
    assert slices.delete_resource_slice(f"{node}-probe")
    refused = {
        "a ResourceSlice of a driver not its own": lambda: slices.create_resource_slice(
            slice_of(node, "gpu.example.com")
        ),
        "another node's labels": patch_other_node,
        "its node's spec": lambda: core.patch_node(
            node, {"spec": {"unschedulable": True}}, _content_type=MERGE
        ),
        "a label it does not own": lambda: core.patch_node(
            node, {"metadata": {"labels": {"team": "ml"}}}, _content_type=MERGE
        ),
        "another condition": lambda: core.patch_node_status(
            node, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
        ),
        "listing nodes": lambda: core.list_node(limit=1),
        "deleting a node": lambda: core.delete_node(other),
        "deleting a pod": lambda: core.delete_namespaced_pod(pod.metadata.name, k8s.namespace),
        "reading a pod by name": lambda: core.read_namespaced_pod(pod.metadata.name, k8s.namespace),
        "creating a pod": lambda: core.create_namespaced_pod(
            k8s.namespace,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name="x"),
                spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="x")]),
            ),
        ),
        "reading secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "reading secrets anywhere": lambda: core.list_secret_for_all_namespaces(limit=1),
        "events outside default": lambda: core.create_namespaced_event(
            k8s.namespace,
            {
                "metadata": {"name": "x"},
                "involvedObject": {"kind": "Node", "name": node},
                "reason": "x",
            },
        ),
    }
    statuses = {what: status_of(call) for what, call in refused.items()}
    assert statuses == dict.fromkeys(refused, FORBIDDEN)
    assert k8s.read_pod(pod.metadata.name).metadata.deletion_timestamp is None


def allocated_claim(k8s: KwokCluster, node: str, results: list[tuple[str, str]]) -> Any:
    """A ResourceClaim allocated on `node` (as kube-scheduler writes it: one result per
    (driver, device), a node selector naming the node)."""
    custom = client.CustomObjectsApi(k8s.api)
    requests = [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.edl.io"}}]
    made = custom.create_namespaced_custom_object(
        "resource.k8s.io", "v1", k8s.namespace, "resourceclaims",
        {"metadata": {"name": f"claim-{secrets.token_hex(3)}"},
         "spec": {"devices": {"requests": requests}}},
    )  # fmt: skip
    selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    allocation = {
        "devices": {
            "results": [
                {"request": "gpus", "driver": driver, "pool": node, "device": device}
                for driver, device in results
            ]
        },
        "nodeSelector": {"nodeSelectorTerms": [selector]},
    }
    return custom.patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", k8s.namespace, "resourceclaims", made["metadata"]["name"],
        {"status": {"allocation": allocation}}, _content_type=MERGE,
    )  # fmt: skip


def test_the_agent_writes_device_status_only_of_its_drivers_on_claims_of_its_node(
    deployed: None, k8s: KwokCluster, bound_token: Callable[..., str]
) -> None:
    """The granular status authorization of Kubernetes 1.37 with the agent's role: its token,
    bound to a pod on its node, may write its own drivers' entries in a claim allocated on that
    node; not another driver's entry in the same claim, and nothing in another node's claim."""
    ours = names.driver_name(names.Vendor.NVIDIA)
    node = k8s.create_gpu_node().metadata.name
    other = k8s.create_gpu_node(wait_ready=False).metadata.name
    claim = allocated_claim(k8s, node, [(ours, "gpu-0"), ("gpu.example.com", "gpu-1")])
    meta = claim["metadata"]
    api = KubeDraApi(KubeApi(sa_client(k8s.api, bound_token(node, "edl-agent"))))
    elsewhere = KubeDraApi(KubeApi(sa_client(k8s.api, bound_token(other, "edl-agent"))))

    def entry(driver: str, device: str, status: str = "True") -> dict[str, Any]:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ready = {"type": "Ready", "status": status, "reason": "DeviceHealthy", "message": "ok",
                 "lastTransitionTime": now}  # fmt: skip
        return {"driver": driver, "pool": node, "device": device, "conditions": [ready]}

    def write(client_: KubeDraApi, *entries: dict[str, Any]) -> Callable[[], object]:
        return lambda: client_.apply_claim_device_status(
            k8s.namespace, meta["name"], meta["uid"], entries, manager=f"edl-agent/{ours}"
        )

    written = wait_for(
        "RBAC to reach the authorizer",
        lambda: status_of(write(api, entry(ours, "gpu-0"))),
        lambda status: status == 200,
    )
    assert written == 200
    claim = client.CustomObjectsApi(k8s.api).get_namespaced_custom_object(
        "resource.k8s.io", "v1", k8s.namespace, "resourceclaims", meta["name"]
    )
    assert [(d["driver"], d["device"]) for d in claim["status"]["devices"]] == [(ours, "gpu-0")]
    refused = {
        "another driver's entry": write(
            api, entry(ours, "gpu-0"), entry("gpu.example.com", "gpu-1")
        ),
        # A change: writing what is there already needs no driver permission at all.
        "a claim of another node": write(elsewhere, entry(ours, "gpu-0", "False")),
    }
    # The API server answers a refused driver permission as an invalid status (422), naming it.
    messages = {what: message_of(call) for what, call in refused.items()}
    assert {what: status_of(call) for what, call in refused.items()} == dict.fromkeys(refused, 422)
    assert (
        'cannot associated-node:patch resource "resourceclaims/driver"'
        in messages["another driver's entry"]
    )
    assert (
        'cannot arbitrary-node:patch resource "resourceclaims/driver"'
        in messages["a claim of another node"]
    )


@pytest.fixture
def policy(deployed: None, k8s: KwokCluster) -> dict[str, Any]:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": "train", "namespace": k8s.namespace},
        "spec": {
            "selector": {"matchLabels": {"app": "train"}},
            "jobLabel": "job-name",
            "restartPolicy": "OnNodeFail",
        },
    }
    created: dict[str, Any] = client.CustomObjectsApi(k8s.api).create_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, body
    )
    return created


def test_the_restarter_account_may_make_every_call_the_restarter_makes(
    deployed: None,
    k8s: KwokCluster,
    policy: dict[str, Any],
    bound_token: Callable[..., str],
) -> None:
    node = k8s.create_gpu_node().metadata.name
    failed = k8s.create_pod(node=node, labels={"app": "train"})
    restarter = sa_client(k8s.api, restarter_token(k8s.api))
    core = client.CoreV1Api(restarter)
    objects = client.CustomObjectsApi(restarter)
    leases = client.CoordinationV1Api(restarter)
    ns = k8s.namespace
    wait_for(
        "RBAC to reach the authorizer",
        lambda: status_of(lambda: core.list_node(limit=1)),
        lambda status: status == 200,
    )

    # The watchers: pods everywhere and nodes, listed and watched.
    pods = core.list_pod_for_all_namespaces(label_selector="app=train")
    assert failed.metadata.name in {p.metadata.name for p in pods.items}
    assert node in {n.metadata.name for n in core.list_node().items}
    for lister in (core.list_pod_for_all_namespaces, core.list_node):
        stream = lister(watch=True, timeout_seconds=1, _preload_content=False)
        stream.read()
        stream.release_conn()
    # Policies: listed, watched and read; their status written.
    listed = objects.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    assert policy["metadata"]["name"] in {p["metadata"]["name"] for p in listed["items"]}
    current = objects.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "train")
    current["status"] = {"restarts": 1}
    objects.replace_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "train", current)
    read = client.CustomObjectsApi(k8s.api).get_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, "train"
    )
    assert read["status"] == {"restarts": 1}
    # A pod replaced: read, annotated, deleted (grace 0, uid precondition), recreated.
    core.read_namespaced_pod(failed.metadata.name, ns)
    core.patch_namespaced_pod(
        failed.metadata.name,
        ns,
        {"metadata": {"annotations": {"edl.io/deleted-by": "edl-restarter"}}},
        _content_type=MERGE,
    )
    core.delete_namespaced_pod(
        failed.metadata.name,
        ns,
        body=client.V1DeleteOptions(
            grace_period_seconds=0,
            preconditions=client.V1Preconditions(uid=failed.metadata.uid),
        ),
    )
    replacement = client.V1Pod(
        metadata=client.V1ObjectMeta(name=f"{failed.metadata.name}-r1", labels={"app": "train"}),
        spec=client.V1PodSpec(containers=[client.V1Container(name="worker", image="x")]),
    )
    core.create_namespaced_pod(ns, replacement)
    # A graceful restart: the pod evicted through the Eviction API (its uid a precondition).
    graceful = k8s.create_pod(node=node, labels={"app": "train"})
    core.create_namespaced_pod_eviction(
        graceful.metadata.name,
        ns,
        client.V1Eviction(
            metadata=client.V1ObjectMeta(name=graceful.metadata.name, namespace=ns),
            delete_options=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=graceful.metadata.uid)
            ),
        ),
    )
    # The intake: an agent's token, bound to its pod on `node`, reviewed for the audience.
    agent_token = bound_token(node, "edl-agent", audiences=["edl-restarter"])
    review = client.AuthenticationV1Api(restarter).create_token_review(
        client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=agent_token, audiences=["edl-restarter"])
        )
    )
    assert review.status.authenticated, review.status.error
    assert review.status.user.username == AGENT
    assert review.status.user.extra["authentication.kubernetes.io/node-name"] == [node]
    # Leader election: its Lease in edl-system made, read and renewed.
    name = f"edl-restarter-{secrets.token_hex(3)}"
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1LeaseSpec(holder_identity="edl-restarter-0", lease_duration_seconds=15),
    )
    leases.create_namespaced_lease(NAMESPACE, lease)
    held = leases.read_namespaced_lease(name, NAMESPACE)
    held.spec.renew_time = datetime.now(UTC)
    leases.replace_namespaced_lease(name, NAMESPACE, held)
    # Events on the policy (a pod restarted) and on its Lease (the storm guard).
    for involved in (reference(read), {"kind": "Lease", "name": name, "namespace": NAMESPACE}):
        event = {
            "metadata": {"name": f"{involved['name']}.{secrets.token_hex(4)}"},
            "involvedObject": involved,
            "type": "Normal",
            "reason": "PodRestarted",
            "message": "restarted",
            "source": {"component": "edl-restarter"},
        }
        core.create_namespaced_event(involved["namespace"], event)
    client.CoordinationV1Api(k8s.api).delete_namespaced_lease(name, NAMESPACE)
    # The leader label on its own pod (the intake Service selects it); any pod shows the grant.
    core.patch_namespaced_pod(
        f"{failed.metadata.name}-r1",
        ns,
        {"metadata": {"labels": {"edl.io/restarter-leader": "true"}}},
        _content_type=MERGE,
    )


def test_the_restarter_account_is_refused_what_the_restarter_must_not_do(
    deployed: None, k8s: KwokCluster, policy: dict[str, Any]
) -> None:
    node = k8s.create_gpu_node().metadata.name
    restarter = sa_client(k8s.api, restarter_token(k8s.api))
    core = client.CoreV1Api(restarter)
    objects = client.CustomObjectsApi(restarter)
    leases = client.CoordinationV1Api(restarter)
    wait_for(
        "RBAC to reach the authorizer",
        lambda: status_of(lambda: core.list_node(limit=1)),
        lambda status: status == 200,
    )

    def lease_in(namespace: str) -> Callable[[], object]:
        body = client.V1Lease(metadata=client.V1ObjectMeta(name=f"edl-{secrets.token_hex(3)}"))
        return lambda: leases.create_namespaced_lease(namespace, body)

    refused = {
        "deleting a node": lambda: core.delete_node(node),
        "patching a node": lambda: core.patch_node(
            node, {"metadata": {"labels": {"x": "y"}}}, _content_type=MERGE
        ),
        "reading secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "reading secrets anywhere": lambda: core.list_secret_for_all_namespaces(limit=1),
        "a Lease in the test namespace": lease_in(k8s.namespace),
        "a Lease in kube-system": lease_in("kube-system"),
        "a node's heartbeat Lease": lambda: leases.read_namespaced_lease(node, "kube-node-lease"),
        "deleting its own Lease": lambda: leases.delete_namespaced_lease(
            "edl-restarter", NAMESPACE
        ),
        "changing a policy's spec": lambda: objects.patch_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, "train", {"spec": {"restartLimit": 1}}
        ),
        "deleting a policy": lambda: objects.delete_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, "train"
        ),
        "writing configmaps": lambda: core.create_namespaced_config_map(
            NAMESPACE, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="x"))
        ),
    }
    statuses = {what: status_of(call) for what, call in refused.items()}
    assert statuses == dict.fromkeys(refused, FORBIDDEN)


# The grants verb by verb, as `kubectl auth can-i --as=<ServiceAccount>` answers them (RBAC
# only: the admission policy's limits on the agent are checked with real calls above).
AGENT_GRANTS = [
    ("get nodes", True),
    ("watch nodes", True),
    ("patch nodes", True),
    ("patch nodes --subresource=status", True),
    ("list pods --all-namespaces", True),
    ("watch pods --all-namespaces", True),
    ("create events -n default", True),
    ("patch events -n default", True),
    *(
        (f"{verb} resourceslices.resource.k8s.io", True)
        for verb in ("get", "list", "watch", "create", "update", "delete")
    ),
    ("get resourceclaims.resource.k8s.io -n default", True),
    ("patch resourceclaims.resource.k8s.io --subresource=status -n default", True),
    *(
        (
            f"associated-node:patch resourceclaims.resource.k8s.io/{driver} --subresource=driver",
            True,
        )
        for driver in (names.driver_name(vendor) for vendor in names.CLASSES)
    ),
    (
        "arbitrary-node:patch resourceclaims.resource.k8s.io/gpu.nvidia.edl.io "
        "--subresource=driver",
        False,
    ),
    (
        "associated-node:patch resourceclaims.resource.k8s.io/gpu.nvidia.com --subresource=driver",
        False,
    ),
    ("list nodes", False),
    ("update nodes", False),
    ("delete nodes", False),
    ("update nodes --subresource=status", False),
    ("get pods --all-namespaces", False),
    ("create pods -n default", False),
    ("delete pods -n default", False),
    ("create events -n edl-system", False),
    ("get secrets -n edl-system", False),
    ("list secrets --all-namespaces", False),
    ("create tokenreviews.authentication.k8s.io", False),
    ("get leases.coordination.k8s.io -n edl-system", False),
    ("patch resourceslices.resource.k8s.io", False),
    ("deletecollection resourceslices.resource.k8s.io", False),
    ("list resourceclaims.resource.k8s.io --all-namespaces", False),
    ("update resourceclaims.resource.k8s.io --subresource=status -n default", False),
    ("create deviceclasses.resource.k8s.io", False),
]
RESTARTER_GRANTS = [
    *(
        (f"{verb} pods --all-namespaces", True)
        for verb in ("get", "list", "watch", "create", "delete", "patch")
    ),
    ("list nodes", True),
    ("watch nodes", True),
    ("get faulttolerancepolicies.edl.io --all-namespaces", True),
    ("list faulttolerancepolicies.edl.io --all-namespaces", True),
    ("watch faulttolerancepolicies.edl.io --all-namespaces", True),
    ("update faulttolerancepolicies.edl.io --subresource=status -n default", True),
    ("create tokenreviews.authentication.k8s.io", True),
    ("create events -n default", True),
    ("get leases.coordination.k8s.io -n edl-system", True),
    ("create leases.coordination.k8s.io -n edl-system", True),
    ("update leases.coordination.k8s.io -n edl-system", True),
    ("create pods --subresource=eviction -n default", True),  # a Graceful rule's eviction
    ("update pods -n default", False),
    ("get nodes", False),
    ("patch nodes", False),
    ("delete nodes", False),
    ("update faulttolerancepolicies.edl.io -n default", False),
    ("delete faulttolerancepolicies.edl.io -n default", False),
    ("patch faulttolerancepolicies.edl.io --subresource=status -n default", False),
    ("get secrets -n edl-system", False),
    ("list secrets --all-namespaces", False),
    ("patch events -n default", False),
    ("delete leases.coordination.k8s.io -n edl-system", False),
    ("update leases.coordination.k8s.io -n kube-node-lease", False),
    ("create leases.coordination.k8s.io -n kube-system", False),
    ("get leases.coordination.k8s.io -n default", False),
]


@pytest.mark.parametrize(
    ("user", "grants"),
    [(AGENT, AGENT_GRANTS), (RESTARTER, RESTARTER_GRANTS)],
    ids=["agent", "restarter"],
)
def test_kubectl_auth_can_i_answers_as_the_manifests_grant(
    deployed: None, kubectl: Kubectl, user: str, grants: list[tuple[str, bool]]
) -> None:
    def can(question: str) -> bool:
        result = kubectl("auth", "can-i", *question.split(), f"--as={user}", check=False)
        assert result.stdout.strip() in {"yes", "no"}, result.stderr
        return result.returncode == 0

    wait_for("RBAC to reach the authorizer", lambda: can(grants[0][0]), bool)
    answers = {question: can(question) for question, _ in grants}
    assert answers == dict(grants)


# --- the alerts -----------------------------------------------------------------------------

RULES = DEPLOY / "prometheus-rules.yaml"

# Sample series and what each alert makes of them, in `promtool test rules` form. Annotations
# are left out of the comparison (test_alert_annotations_name_only_labels_the_alert_has checks
# that each label they name is on the alert).
RULE_TESTS: list[dict[str, Any]] = yaml.safe_load("""
# One device unhealthy under two pods (a shared device): one alert, after 2 minutes.
- interval: 1m
  input_series:
    - series: edl_device_healthy{job="edl-agent",instance="10.0.0.1:9400",node="gpu-1",vendor="nvidia",index="3",device_id="GPU-3",product="NVIDIA-H100",resource="nvidia.com/gpu",namespace="ml",pod="worker-0",container="main"}
      values: 1 1 0x10
    - series: edl_device_healthy{job="edl-agent",instance="10.0.0.1:9400",node="gpu-1",vendor="nvidia",index="3",device_id="GPU-3",product="NVIDIA-H100",resource="nvidia.com/gpu",namespace="ml",pod="worker-1",container="main"}
      values: 1 1 0x10
    - series: edl_device_healthy{job="edl-agent",instance="10.0.0.1:9400",node="gpu-1",vendor="nvidia",index="4",device_id="GPU-4",product="NVIDIA-H100",resource="nvidia.com/gpu"}
      values: 1x12
  alert_rule_test:
    - {eval_time: 3m, alertname: EdlAcceleratorUnhealthy, exp_alerts: []}
    - eval_time: 5m
      alertname: EdlAcceleratorUnhealthy
      exp_alerts:
        - exp_labels: {severity: warning, node: gpu-1, vendor: nvidia, index: "3", device_id: GPU-3, product: NVIDIA-H100}
# One agent stops answering; another keeps failing a step.
- interval: 1m
  input_series:
    - {series: 'up{job="edl-agent",instance="10.0.0.1:9400",node="gpu-1"}', values: 1x20}
    - {series: 'up{job="edl-agent",instance="10.0.0.2:9400",node="gpu-2"}', values: 1 0x20}
    - series: edl_agent_step_failures_total{job="edl-agent",instance="10.0.0.1:9400",node="gpu-1",step="publisher"}
      values: 0+1x20
  alert_rule_test:
    - {eval_time: 4m, alertname: EdlAgentDown, exp_alerts: []}
    - eval_time: 7m
      alertname: EdlAgentDown
      exp_alerts:
        - exp_labels: {severity: critical, job: edl-agent, instance: "10.0.0.2:9400", node: gpu-2}
    - {eval_time: 7m, alertname: EdlAgentsAbsent, exp_alerts: []}
    - eval_time: 10m
      alertname: EdlAgentStepFailing
      exp_alerts:
        - exp_labels: {severity: warning, job: edl-agent, instance: "10.0.0.1:9400", node: gpu-1, step: publisher}
# No agent scraped at all.
- interval: 1m
  input_series:
    - {series: 'up{job="other"}', values: 1x20}
  alert_rule_test:
    - eval_time: 16m
      alertname: EdlAgentsAbsent
      exp_alerts:
        - exp_labels: {severity: critical, job: edl-agent}
# The leader goes down and the standby does not take over; a long queue.
- interval: 1m
  input_series:
    - {series: 'edl_restarter_leader{job="edl-restarter",pod="edl-restarter-a"}', values: 1 1 1 0x20}
    - {series: 'edl_restarter_leader{job="edl-restarter",pod="edl-restarter-b"}', values: '0x23'}
    - {series: 'up{job="edl-restarter",pod="edl-restarter-a"}', values: 1 1 0x20}
    - {series: 'up{job="edl-restarter",pod="edl-restarter-b"}', values: 1x23}
    - {series: 'edl_restarter_queue_depth{job="edl-restarter",pod="edl-restarter-a"}', values: 150x23}
  alert_rule_test:
    - {eval_time: 4m, alertname: EdlRestarterNoLeader, exp_alerts: []}
    - eval_time: 6m
      alertname: EdlRestarterNoLeader
      exp_alerts: [{exp_labels: {severity: critical}}]
    - eval_time: 8m
      alertname: EdlRestarterDown
      exp_alerts:
        - exp_labels: {severity: warning, job: edl-restarter, pod: edl-restarter-a}
    - {eval_time: 9m, alertname: EdlRestarterQueueBacklog, exp_alerts: []}
    - eval_time: 11m
      alertname: EdlRestarterQueueBacklog
      exp_alerts: [{exp_labels: {severity: warning}}]
# A storm: node-failure restarts paused; 5 restarts a minute (skips do not count); refusals.
- interval: 1m
  input_series:
    - {series: 'edl_restarter_storm_paused{job="edl-restarter",pod="edl-restarter-a"}', values: 0 0 1x20}
    - series: edl_restarter_decisions_total{job="edl-restarter",pod="edl-restarter-a",action="Restart",reason="ExitCode"}
      values: 0+5x30
    - series: edl_restarter_decisions_total{job="edl-restarter",pod="edl-restarter-a",action="Skip",reason="NoPolicy"}
      values: 0+100x30
    - series: edl_restarter_intake_refusals_total{job="edl-restarter",pod="edl-restarter-a",reason="WrongNode"}
      values: 0 0 1+1x20
    - {series: 'edl_restarter_replacement_errors_total{job="edl-restarter",pod="edl-restarter-a"}', values: 0 0 0 1 2x20}
  alert_rule_test:
    - {eval_time: 2m, alertname: EdlReplacementsFailing, exp_alerts: []}
    - eval_time: 5m
      alertname: EdlReplacementsFailing
      exp_alerts: [{exp_labels: {severity: warning}}]
    - {eval_time: 2m, alertname: EdlRestartStormPaused, exp_alerts: []}
    - eval_time: 4m
      alertname: EdlRestartStormPaused
      exp_alerts: [{exp_labels: {severity: critical}}]
    - eval_time: 20m
      alertname: EdlRestartRateHigh
      exp_alerts: [{exp_labels: {severity: warning}}]
    - eval_time: 10m
      alertname: EdlRestarterIntakeRefusals
      exp_alerts: [{exp_labels: {severity: warning, reason: WrongNode}}]
# One restart a minute, refusals long ago, no storm: quiet.
- interval: 1m
  input_series:
    - series: edl_restarter_decisions_total{job="edl-restarter",pod="edl-restarter-a",action="Restart",reason="ExitCode"}
      values: 0+1x30
    - series: edl_restarter_intake_refusals_total{job="edl-restarter",pod="edl-restarter-a",reason="WrongNode"}
      values: 3x30
    - {series: 'edl_restarter_storm_paused{job="edl-restarter",pod="edl-restarter-a"}', values: '0x30'}
  alert_rule_test:
    - {eval_time: 20m, alertname: EdlRestartRateHigh, exp_alerts: []}
    - {eval_time: 20m, alertname: EdlRestarterIntakeRefusals, exp_alerts: []}
    - {eval_time: 20m, alertname: EdlRestartStormPaused, exp_alerts: []}
""")  # noqa: E501 - series as promtool reads them, one per line


def rule_groups() -> list[dict[str, Any]]:
    (rule,) = documents(RULES)
    assert rule["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    return [r for group in rule_groups() for r in group["rules"] if "alert" in r]


def without(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k != key}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [need("promtool"), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60
    )


def test_the_prometheus_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))

    result = promtool("check", "rules", str(rules), cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in result.stdout


def test_every_alert_fires_on_its_sample_series(tmp_path: Path) -> None:
    bare = [
        {**group, "rules": [without(rule, "annotations") for rule in group["rules"]]}
        for group in rule_groups()
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": bare}))
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": RULE_TESTS}
        )
    )

    # YAML reads an unquoted 0x23 as the number 35, not as 24 zeros.
    assert all(isinstance(s["values"], str) for t in RULE_TESTS for s in t["input_series"])

    result = promtool("test", "rules", "tests.yaml", cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    fired = {
        case["alertname"]
        for test in RULE_TESTS
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == {a["alert"] for a in alerts()}


def test_alert_annotations_name_only_labels_the_alert_has() -> None:
    labels_of = {
        case["alertname"]: set(case["exp_alerts"][0]["exp_labels"])
        for test in RULE_TESTS
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    for alert in alerts():
        text = " ".join(alert["annotations"].values())
        named = set(re.findall(r"\$labels\.(\w+)", text))
        assert named <= labels_of[alert["alert"]], alert["alert"]
        assert {"summary", "description"} <= alert["annotations"].keys()


def test_the_alerts_use_metrics_the_agent_and_the_restarter_export() -> None:
    sources = ("edl_agent/metrics/collectors.py", "edl_agent/restarter/core/metrics.py")
    exported = {
        name
        for path in sources
        for name in re.findall(r'"(edl_[a-z_]+)"', (REPO / path).read_text())
    }
    used = {name for alert in alerts() for name in re.findall(r"\b(edl_[a-z_]+)", alert["expr"])}

    assert {name.removesuffix("_total") for name in used} <= exported
    assert {"edl_device_healthy", "edl_restarter_storm_paused"} <= used
