"""deploy/grafana on a real API server: every panel's every query of edl-agent.json answers with
series on a real Prometheus scraping a simulated agent and `edl-agent restarter` (labelled as
service-monitors.yaml labels them), after an XID, a failing part of the agent, a Restart, a
dry-run Restart and a refused fault report; and the kustomization makes the ConfigMap Grafana's
sidecar loads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import testcluster
from k8s_test_helpers import KwokCluster, wait_for
from kube_tools import Kubectl
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from manifests import DEPLOY, REPO, dry_run_warnings, kustomized
from scheduler import Process, free_port, spawn
from test_e2e import EDL_AGENT, write_kubeconfig
from test_intake import fault, report
from test_node_labels import sa_client
from test_restarter import (  # fixtures too: pytest finds them among the module's names
    GROUP,
    INDEX,
    JOB,
    PLURAL,
    TYPE,
    VERSION,
    crd,  # noqa: F401
    exit_pod,
    labels,
    restarter_rbac,  # noqa: F401
    wait_pod,
)

from tests.dashboard_check import (
    AGENT_POD,
    DASHBOARD,
    NODE,
    SimulatedAgent,
    load_dashboard,
    queries,
    scrape_configs,
    wait_for_series,
)
from tests.prometheus_runner import get, running_prometheus

GRAFANA = REPO / "deploy" / "grafana"
AGENT_SA, RESTARTER_SA, LEASE = "edl-agent", "edl-restarter", "edl-restarter"
# The restarter's pod, as service discovery would name it (its target label stays).
RESTARTER_POD = "edl-restarter-6b9f8c7d5-q4m2w"
STARTUP_TIMEOUT = 90.0
FORBIDDEN = 403


def _readyz(restarter: Process, port: int) -> tuple[int, str]:
    restarter.check_alive()
    try:
        status, body, _ = get(f"http://127.0.0.1:{port}/readyz")
    except OSError:
        return 0, "not listening"
    return status, body.decode()


def _may_list_pods(api: client.ApiClient, namespace: str) -> bool:
    try:
        client.CoreV1Api(api).list_namespaced_pod(namespace, limit=1)
    except ApiException as exc:
        if exc.status == FORBIDDEN:
            return False
        raise
    return True


@contextlib.contextmanager
def running_restarter(
    k8s: KwokCluster, plane: testcluster.ControlPlane, directory: Path
) -> Iterator[tuple[int, int]]:
    """`edl-agent restarter` as deployed: its ServiceAccount under restarter-rbac.yaml, leader
    election, the intake without TLS on loopback; yields (intake port, metrics port) once it
    leads and has listed pods, nodes and policies."""
    ns = k8s.namespace
    token = k8s.mint_token(RESTARTER_SA)
    api = sa_client(k8s.api, token)
    try:
        wait_for("the restarter's RBAC", lambda: _may_list_pods(api, ns), bool, STARTUP_TIMEOUT)
    finally:
        api.close()
    kubeconfig = write_kubeconfig(directory / "restarter.kubeconfig", plane, token, RESTARTER_SA)
    intake, metrics = free_port(), free_port()
    restarter: Process = spawn(
        "restarter",
        [
            EDL_AGENT, "restarter", f"--kubeconfig={kubeconfig}",
            f"--listen=127.0.0.1:{intake}", f"--metrics-addr=127.0.0.1:{metrics}",
            f"--agent-service-account={ns}/{AGENT_SA}", f"--namespace={ns}",
            f"--lease-namespace={ns}", f"--lease-name={LEASE}", "--log-format=json",
        ],
        directory / "restarter",
    )  # fmt: skip
    try:
        wait_for(
            "the restarter to lead and act",
            lambda: _readyz(restarter, metrics),
            lambda answer: answer[0] == 200 and "acting" in answer[1],
            STARTUP_TIMEOUT,
        )
        yield intake, metrics
    finally:
        code = restarter.stop()
    assert code == 0, restarter.log.read_text()


def _policy(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": "train", "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": "train"}},
            "jobLabel": JOB,
            "replicaTypeLabel": TYPE,
            "replicaIndexLabel": INDEX,
            "backoff": {"initialSeconds": 0, "maxSeconds": 0},
            "faultTolerantPolicy": [{"restartPolicy": "ExitCode", "exitCodes": "137"}],
        },
    }


def test_every_panel_query_answers_with_series(
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    restarter_rbac: None,  # noqa: F811 - the fixture imported above
    crd: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    dashboard = load_dashboard()
    # A job the restarter covers, in place before it starts (so that its first list has it).
    objects = client.CustomObjectsApi(k8s.api)
    objects.create_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, _policy(k8s.namespace)
    )
    # And one in a dry run, over another job: its decisions are only told.
    shadow = _policy(k8s.namespace)
    shadow["metadata"]["name"] = "shadow"
    shadow["spec"] |= {"selector": {"matchLabels": {"app": "shadow"}}, "mode": "DryRun"}
    objects.create_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, shadow)
    node = k8s.create_gpu_node().metadata.name
    worker = "resnet-worker-0"
    k8s.create_pod(worker, node=node, labels=labels("resnet", "worker", 0))
    watched = "shadow-worker-0"
    k8s.create_pod(watched, node=node, labels=labels("shadow", "worker", 0) | {"app": "shadow"})

    with (
        running_restarter(k8s, k8s_control_plane, tmp_path) as (intake, metrics),
        SimulatedAgent(tmp_path / "agent") as agent,
    ):
        exit_pod(k8s, worker, 137)
        exit_pod(k8s, watched, 137)  # a dry-run Restart: told, the pod left as it is
        wait_pod(k8s, f"{worker}-r1", timeout=30)  # a Restart, timed fault → replacement
        with pytest.raises(grpc.RpcError) as refused:  # a report without a token
            report(f"127.0.0.1:{intake}", [fault(1, node)], token=None)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        agent.provoke_faults()

        configs = scrape_configs(
            {
                "edl-agent": [(AGENT_POD, NODE, agent.address)],
                "edl-restarter": [(RESTARTER_POD, node, f"127.0.0.1:{metrics}")],
            }
        )
        with running_prometheus([], tmp_path, scrape_configs=configs) as prometheus:
            answers = wait_for_series(prometheus, queries(dashboard))
    assert agent.returncode == 0, agent.log.read_text()

    def series(title: str, ref: str = "A") -> list[dict[str, Any]]:
        [query] = [q for q in answers if (q.panel, q.ref) == (title, ref)]
        return answers[query]

    assert [s["value"][1] for s in series("Leader")] == ["1"]
    decided = {
        (s["metric"]["action"], s["metric"]["reason"])
        for s in series("Decisions since the replicas started")
    }
    assert ("Restart", "ContainerExit") in decided
    assert {s["metric"]["fault"] for s in series("Fault → replacement latency")} == {
        "ContainerExit"
    }
    assert {s["metric"]["reason"] for s in series("Intake refusals and cuts")} == {"no_token"}
    # The restarter keeps the operator's target labels (it exports no pod labels of its own).
    assert [
        s["metric"]["pod"] for s in series("Queue depth per replica, and the dispatcher's pace")
    ] == [RESTARTER_POD]


def test_the_kustomization_makes_the_configmap_the_grafana_sidecar_loads() -> None:
    [config_map] = kustomized(GRAFANA)
    assert (config_map["apiVersion"], config_map["kind"]) == ("v1", "ConfigMap")
    meta = config_map["metadata"]
    assert (meta["namespace"], meta["name"]) == ("edl-system", "edl-agent-dashboard")
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {"edl-agent.json": DASHBOARD.read_text()}


def test_the_dashboard_configmap_passes_a_server_side_dry_run(kubectl: Kubectl) -> None:
    # As in test_deploy: a dry run cannot create the namespace its objects need.
    kubectl("apply", "-f", str(DEPLOY / "namespace.yaml"))

    result = kubectl("apply", "--dry-run=server", "-k", str(GRAFANA))

    assert result.stdout.split() == [
        "configmap/edl-agent-dashboard",
        "created",
        "(server",
        "dry",
        "run)",
    ]
    assert not dry_run_warnings(result.stderr), result.stderr
