"""Helpers for tests on real kubelet nodes (the ``kubelet_nodes`` fixture): an `edl-agent run`
process serving a node's kubelet, what kubelet reports about the node and its pods, and kubelet's
own pod-resources API read with our generated client."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import k8sbinaries
import pytest
import testcluster
import testnode
import yaml
from kubernetes import client
from scheduler import Process, free_port, spawn

from edl_agent._proto.podresources.v1 import api_pb2, api_pb2_grpc
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.waiting import WaitTimeout, wait_for

EDL_AGENT = str(Path(sys.executable).with_name("edl-agent"))
IMAGE = "registry.invalid/edl/worker:test"  # the fake runtime "pulls" anything


def extended(resources: dict[str, str] | None) -> dict[str, int]:
    """The extended resources (vendor.domain/name) of a capacity or allocatable map."""
    return {k: int(v) for k, v in (resources or {}).items() if "/" in k}


def log_entries(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a structlog log (other lines are skipped)."""
    entries = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    entries.append(json.loads(line))
    return entries


def logged_at(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(entry["timestamp"])).timestamp()


@dataclass
class NodeAgent:
    """`edl-agent run` on a simulated node tree, serving one kubelet node."""

    node: testnode.Node
    profile: str
    tree: Path
    directory: Path
    metrics_port: int
    process: Process | None = None
    extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        config = self.directory / "profile-config.yaml"
        config.write_text(yaml.safe_dump(load_profile(self.profile).config))
        return [
            EDL_AGENT,
            "run",
            f"--host-root={self.tree}",
            f"--config={config}",
            f"--node-name={self.node.name}",
            f"--kubelet-dir={self.node.paths.device_plugins}",
            f"--state-dir={self.directory / 'state'}",
            f"--metrics-addr=127.0.0.1:{self.metrics_port}",
            f"--set=pod_resources_socket={self.node.paths.pod_resources}",
            "--log-format=json",
            *self.extra,
        ]

    def start(self) -> Process:
        self.process = spawn(
            f"agent-{self.node.name}", self.argv(), self.directory, separate_stdout=True
        )
        return self.process

    def stop(self) -> int:
        assert self.process is not None
        return self.process.stop()

    @property
    def log(self) -> Path:
        assert self.process is not None
        return self.process.log

    def entries(self, event: str) -> list[dict[str, Any]]:
        return [e for e in log_entries(self.log) if e.get("event") == event]

    def discover(self) -> dict[str, int]:
        """What `edl-agent discover` says this node advertises: resource → device count."""
        result = spawn_discover(self.tree, self.directory / "profile-config.yaml")
        return {r["name"]: len(r["devices"]) for r in result["resources"]}

    def devices(self) -> list[dict[str, Any]]:
        """The devices `edl-agent discover` finds on this node (id, index, numa_node, ...)."""
        found: list[dict[str, Any]] = spawn_discover(
            self.tree, self.directory / "profile-config.yaml"
        )["devices"]
        return found

    def ready(self) -> bool:
        """/readyz answers 200: kubelet served, and every health monitor (the NVML event loop
        among them) watching, so a fault injected from now on is seen."""
        url = f"http://127.0.0.1:{self.metrics_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return bool(answer.status == 200)
        except OSError:  # not serving yet, or 503 (urllib's HTTPError is an OSError)
            return False

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return str(answer.read().decode())


def spawn_discover(tree: Path, config: Path) -> dict[str, Any]:
    result = subprocess.run(
        [EDL_AGENT, "discover", f"--host-root={tree}", f"--config={config}", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    discovered: dict[str, Any] = json.loads(result.stdout)
    return discovered


def node_agent(
    node: testnode.Node, profile: str, directory: Path, *extra: str, start: bool = True
) -> NodeAgent:
    """An agent for `node` on a fresh simulated `profile` tree under `directory`, whose devices
    have ids of that node's own."""
    directory.mkdir(parents=True, exist_ok=True)
    tree = directory / "tree"
    build_tree(load_profile(profile).on_node(node.name), tree)
    agent = NodeAgent(node, profile, tree, directory, free_port(), extra=tuple(extra))
    if start:
        agent.start()
    return agent


def allocatable(core: client.CoreV1Api, node: str) -> dict[str, int]:
    return extended(core.read_node(node).status.allocatable)


def gpu_pod(
    name: str,
    node: str,
    limits: dict[str, str],
    *,
    restart_policy: str = "Never",
    labels: dict[str, str] | None = None,
    container: str = "main",
) -> client.V1Pod:
    """A pod placed on `node` by spec.nodeName, asking for `limits`."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(
            node_name=node,
            restart_policy=restart_policy,
            termination_grace_period_seconds=0,
            containers=[
                client.V1Container(
                    name=container,
                    image=IMAGE,
                    resources=client.V1ResourceRequirements(limits=limits),
                )
            ],
        ),
    )


def claim_body(
    name: str,
    device_class: str,
    *,
    count: int = 1,
    selector: str | None = None,
    capacity: dict[str, str] | None = None,
    request: str = "devices",
) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) asking `count` devices of `device_class` in one
    request, narrowed by a CEL `selector` and a `capacity` share when given."""
    exactly: dict[str, Any] = {"deviceClassName": device_class, "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}},
    }


def claim_pod(name: str, claim: str, *, request: str = "devices") -> client.V1Pod:
    """A pod the scheduler places, holding `claim` in its one container."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            restart_policy="Never",
            termination_grace_period_seconds=0,
            resource_claims=[client.V1PodResourceClaim(name=request, resource_claim_name=claim)],
            containers=[
                client.V1Container(
                    name="main",
                    image=IMAGE,
                    resources=client.V1ResourceRequirements(
                        claims=[client.CoreV1ResourceClaim(name=request)]
                    ),
                )
            ],
        ),
    )


def wait_phase(core: client.CoreV1Api, namespace: str, name: str, phase: str, **kw: Any) -> Any:
    try:
        return wait_for(
            f"{namespace}/{name} {phase}",
            lambda: core.read_namespaced_pod(name, namespace),
            lambda pod: pod.status.phase == phase,
            **kw,
        )
    except WaitTimeout as exc:
        raise WaitTimeout(
            f"{namespace}/{name} not {phase}: {pod_story(core, namespace, name)}"
        ) from exc


def pod_story(core: client.CoreV1Api, namespace: str, name: str) -> str:
    """What a failing wait needs to know of a pod: its phase, node, conditions, containers'
    states and the events about it (not its managed fields)."""
    try:
        pod = core.read_namespaced_pod(name, namespace)
    except client.ApiException as exc:
        return f"cannot be read ({exc.status} {exc.reason})"
    status = pod.status
    lines = [f"phase {status.phase} on node {pod.spec.node_name}"]
    lines += [
        f"condition {c.type}={c.status} {c.reason or ''} {c.message or ''}".rstrip()
        for c in status.conditions or []
    ]
    for container in status.container_statuses or []:
        state = container.state.to_dict() if container.state else {}
        lines.append(f"container {container.name}: {json.dumps(state, default=str)}")
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    ).items
    lines += [
        f"event {e.type} {e.reason} ({e.source.component if e.source else '?'}): {e.message}"
        for e in events
    ]
    return "\n  ".join(lines)


def created_containers(node: testnode.Node, namespace: str, pod: str) -> list[dict[str, Any]]:
    """The CreateContainer requests kubelet sent the runtime for `namespace/pod`."""
    return [
        entry
        for entry in testnode.cri_log(node.paths.cri_log)
        if entry["pod_namespace"] == namespace and entry["pod_name"] == pod
    ]


@contextlib.contextmanager
def pod_resources(node: testnode.Node) -> Iterator[api_pb2_grpc.PodResourcesListerStub]:
    with grpc.insecure_channel(f"unix://{node.paths.pod_resources}") as channel:
        yield api_pb2_grpc.PodResourcesListerStub(channel)


def pod_devices(node: testnode.Node, namespace: str, pod: str) -> dict[str, dict[str, list[str]]]:
    """container → resource → device ids (sorted), as kubelet's pod-resources API lists them."""
    with pod_resources(node) as lister:
        listed = lister.List(api_pb2.ListPodResourcesRequest(), timeout=10)
    found: dict[str, dict[str, list[str]]] = {}
    for entry in listed.pod_resources:
        if (entry.namespace, entry.name) != (namespace, pod):
            continue
        for container in entry.containers:
            per = found.setdefault(container.name, {})
            for devices in container.devices:
                per.setdefault(devices.resource_name, []).extend(devices.device_ids)
    for per in found.values():  # kubelet keeps them in a set: no order to rely on
        for ids in per.values():
            ids.sort()
    return found


def resource_health(pod: Any) -> list[tuple[str, str, str]]:
    """(resource name, device id, health) from the pod's allocatedResourcesStatus (KEP-4680)."""
    found = []
    for status in (pod.status and pod.status.container_statuses) or []:
        for resource in status.allocated_resources_status or []:
            for device in resource.resources or []:
                found.append((resource.name, device.resource_id, device.health))
    return found


StartNode = Callable[..., testnode.Node]


def kubelet_node_starter(plane: testcluster.ControlPlane) -> Iterator[StartNode]:
    """A fixture's body: ``start(name=None, **options)`` starts a real kubelet node of `plane`
    (Ready, untainted) in a short directory under /tmp, and every node started is stopped and
    its directory removed at the end. Fails, never skips, where kubelet nodes cannot run."""
    problem = testnode.preflight()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    absent = k8sbinaries.missing(("kubelet", k8sbinaries.FAKE_CRI))
    if absent:
        pytest.fail(
            f"{', '.join(absent)} missing in {k8sbinaries.bin_dir()}: run scripts/k8s-binaries",
            pytrace=False,
        )
    roots: list[Path] = []
    nodes: list[testnode.Node] = []

    def start(name: str | None = None, **options: Any) -> testnode.Node:
        root = Path(tempfile.mkdtemp(prefix="edl-kn-", dir="/tmp"))
        roots.append(root)
        try:
            node = testnode.start_node_on(
                plane, root, name or f"kn-{secrets.token_hex(3)}", attached=True, **options
            )
        except testnode.NodeError as exc:
            pytest.fail(f"could not start a kubelet node: {exc}", pytrace=False)
        nodes.append(node)
        return node

    yield start
    for node in reversed(nodes):
        node.stop()
        assert not node.kubelet_alive(), f"kubelet of {node.name} survived its stop"
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
