"""Adopting it in shadow: an agent with `health.shadow: true` and a policy in `mode: DryRun` go
through a warned fault (XID 94, the GPU Degraded) and a fatal one (XID 79) on the GPUs of a
job's workers, and kube-apiserver's audit log (testcluster.AUDIT_POLICY: every write a
ServiceAccount outside kube-system makes) shows every write the two made meanwhile: none but the
agent's reports (its Node's labels and condition, Events) and the restarter's Events and Lease.

Real processes under their deployed RBAC, as in test_e2e.py: a kubelet v1.37 node with our fake
runtime, `edl-agent run` (simulated dgx-h100) serving it with ServiceAccount edl-agent's bound
tokens, and `edl-agent restarter` as ServiceAccount edl-restarter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, wait_for
from kubelet_helpers import extended, pod_devices
from kubernetes import client
from scheduler import Process
from test_e2e import (  # fixtures too: pytest finds them among the module's names
    AGENT_SA,
    JOB,
    LEASE,
    POOL_LABEL,
    RESTARTER_SA,
    STARTUP_TIMEOUT,
    _may,
    agent_rbac,
    agent_tokens,
    condition_of,
    create_worker,
    policy_body,
    processes,
    reporting_agent,
    start_restarter,
    write_kubeconfig,
)
from test_node_labels import sa_client
from test_restarter import GROUP, PLURAL, VERSION, crd, restarter_rbac

from edl_agent.sim import inject

__all__ = ["agent_rbac", "crd", "processes", "restarter_rbac"]

pytestmark = pytest.mark.kubelet

MERGE = "application/merge-patch+json"
WARNED_XID, FATAL_XID = 94, 79
WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# What each may write while it only watches: (verb, resource, subresource).
AGENT_REPORTS = frozenset(
    {
        ("patch", "nodes", ""),  # its labels
        ("patch", "nodes", "status"),  # its condition
        ("create", "events", ""),
        ("patch", "events", ""),  # a repeated Event's count
    }
)
RESTARTER_OWN = frozenset(
    {
        ("create", "events", ""),
        ("patch", "events", ""),
        ("update", "leases", ""),  # its leadership, renewed
        ("create", "tokenreviews", ""),  # an agent's report authenticated: nothing is stored
    }
)


def audited_writes(log: Path, offset: int) -> list[dict[str, Any]]:
    """The audit log's write events after byte `offset` (the response sent)."""
    with log.open("rb") as handle:
        handle.seek(offset)
        lines = handle.read().decode(errors="replace").splitlines()
    found = []
    for line in lines:
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("stage") == "ResponseComplete" and event.get("verb") in WRITES:
            found.append(event)
    return found


def kinds(events: list[dict[str, Any]], user: str) -> set[tuple[str, str, str]]:
    return {
        (
            e["verb"],
            e["objectRef"].get("resource", ""),
            e["objectRef"].get("subresource", ""),
        )
        for e in events
        if e["user"]["username"] == user
    }


@pytest.mark.timeout(600)
def test_shadow_mode_and_a_dry_run_write_nothing_but_their_reports(  # noqa: PLR0917 - fixtures
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    kubelet_nodes: Callable[..., testnode.Node],
    restarter_rbac: None,
    agent_rbac: list[str],
    crd: Any,
    processes: list[Process],
    tmp_path: Path,
) -> None:
    ns = k8s.namespace
    node = kubelet_nodes()
    k8s.core.patch_node(node.name, {"metadata": {"labels": {POOL_LABEL: ns}}}, _content_type=MERGE)
    agent_rbac.append(node.name)
    restarter, intake_port = start_restarter(k8s, k8s_control_plane, tmp_path, processes)

    api_token, intake_token = agent_tokens(k8s, node.name)
    agent_api = sa_client(k8s.api, api_token)
    wait_for(
        "the agent's RBAC",
        lambda: _may(lambda: client.CoreV1Api(agent_api).read_node(node.name)),
        bool,
        timeout=STARTUP_TIMEOUT,
    )
    agent_api.close()
    directory = tmp_path / "agent"
    directory.mkdir()
    agent = reporting_agent(
        node,
        directory,
        kubeconfig=write_kubeconfig(
            directory / "kubeconfig", k8s_control_plane, api_token, AGENT_SA
        ),
        intake_token=intake_token,
        intake_port=intake_port,
        processes=processes,
        extra=("--set=health.shadow=true",),
    )
    assert agent.process is not None
    wait_for(
        "8 GPUs allocatable and the agent's condition",
        lambda: k8s.core.read_node(node.name),
        lambda n: (
            extended(n.status.allocatable).get(GPU_RESOURCE) == 8
            and getattr(condition_of(n), "status", None) == "True"
        ),
        timeout=STARTUP_TIMEOUT,
    )

    body = policy_body(ns)
    body["spec"]["mode"] = "DryRun"
    client.CustomObjectsApi(k8s.api).create_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, body, field_validation="Strict"
    )
    workers = [create_worker(k8s, i, node.name, ns) for i in range(2)]
    for worker in workers:
        k8s.wait_pod_phase(worker.metadata.name, "Running", timeout=STARTUP_TIMEOUT)
    before = {p.metadata.name: p.metadata.uid for p in k8s.core.list_namespaced_pod(ns).items}
    policy_version = _policy(k8s)["metadata"]["resourceVersion"]

    log = k8s_control_plane.audit_log
    offset = log.stat().st_size if log.exists() else 0
    began = time.time()
    for worker, code in zip(workers, (WARNED_XID, FATAL_XID), strict=True):
        [gpu] = pod_devices(node, ns, worker.metadata.name)["trainer"][GPU_RESOURCE]
        index = next(d["index"] for d in agent.devices() if d["id"] == gpu)
        inject.inject_xid(agent.tree, index, code)

    def dry_runs() -> list[str]:
        return [
            e.message or ""
            for e in k8s.core.list_namespaced_event(ns, field_selector="reason=DryRun").items
        ]

    said = wait_for(
        "the restarter's two dry-run decisions",
        dry_runs,
        lambda m: sum("would Restart" in text for text in m) >= 2,
        timeout=STARTUP_TIMEOUT,
        alive=restarter,
    )
    assert any(f"{JOB}-worker-0" in text for text in said), said
    shown = wait_for(
        "the node's condition naming both faults",
        lambda: k8s.core.read_node(node.name),
        lambda n: (
            getattr(condition_of(n), "status", None) == "False"
            and (n.metadata.labels or {}).get("edl.io/nvidia.degraded") == "1"
        ),
        timeout=STARTUP_TIMEOUT,
    )
    # Shadow: kubelet is still offered every GPU.
    assert extended(shown.status.allocatable).get(GPU_RESOURCE) == 8

    agent.process.check_alive()
    restarter.check_alive()
    writes = audited_writes(log, offset)
    agent_user = f"system:serviceaccount:{ns}:{AGENT_SA}"
    restarter_user = f"system:serviceaccount:{ns}:{RESTARTER_SA}"
    agent_wrote, restarter_wrote = kinds(writes, agent_user), kinds(writes, restarter_user)
    # The log is live: both made the reports the faults call for...
    assert ("create", "events", "") in restarter_wrote, restarter_wrote
    assert ("patch", "nodes", "status") in agent_wrote, agent_wrote
    # ...and nothing else.
    assert agent_wrote <= AGENT_REPORTS, agent_wrote - AGENT_REPORTS
    assert restarter_wrote <= RESTARTER_OWN, restarter_wrote - RESTARTER_OWN
    touched = {
        (e["objectRef"].get("resource"), e["objectRef"].get("name"))
        for e in writes
        if e["user"]["username"] in (agent_user, restarter_user)
        and e["objectRef"].get("resource") == "nodes"
    }
    assert touched == {("nodes", node.name)}, touched  # its own Node only
    assert min(_time(e) for e in writes) >= began - 1
    # The objects say the same.
    after = {p.metadata.name: p.metadata.uid for p in k8s.core.list_namespaced_pod(ns).items}
    assert after == before
    assert _policy(k8s)["metadata"]["resourceVersion"] == policy_version
    # No namespace controller runs here to remove them with the namespace.
    client.CustomObjectsApi(k8s.api).delete_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, JOB
    )
    k8s.coordination.delete_namespaced_lease(LEASE, ns)


def _policy(k8s: KwokCluster) -> dict[str, Any]:
    found: dict[str, Any] = client.CustomObjectsApi(k8s.api).get_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, JOB
    )
    return found


def _time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
