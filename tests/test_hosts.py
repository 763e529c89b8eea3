"""`edl-agent hosts`: the deciding (pods, nodes, claims → host:slots lines) without a server, and
the command's input and failure handling. Against a real API server and Horovod's own parser:
tests/cluster/test_hosts.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.faults.pod_faults import DISRUPTION_REASON
from edl_agent.hosts.command import default_namespace
from edl_agent.hosts.decide import (
    HostRules,
    Hosts,
    SlotRule,
    Snapshot,
    discover_hosts,
    needs_claims,
    nodes_to_read,
)
from edl_agent.labels.condition import CONDITION_TYPE
from edl_agent.restarter.core.replacement import REPLACES_UID_ANNOTATION

NS = "ml"
IP = "10.0.0.1"
UNREACHABLE = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


def pod(
    name: str,
    *,
    ip: str | None = None,
    node: str = "n1",
    gpus: int = 0,
    resource: str = "nvidia.com/gpu",
    phase: str = "Running",
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    number = sum(map(ord, name)) % 250 + 1
    limits = {resource: str(gpus), "cpu": "4"} if gpus else {"cpu": "4"}
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "worker", "resources": {"limits": limits}}],
            **extra.pop("spec", {}),
        },
        "status": {
            "phase": phase,
            "podIP": ip or f"10.0.0.{number}",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **extra.pop("status", {}),
        },
        **extra,
    }


def node(name: str = "n1", *, ready: str = "True", taints: list[str] | None = None,
         accelerators: str | None = None) -> dict[str, Any]:  # fmt: skip
    conditions = [{"type": "Ready", "status": ready}]
    if accelerators is not None:
        conditions.append({"type": CONDITION_TYPE, "status": accelerators, "reason": "XID79"})
    return {
        "metadata": {"name": name},
        "spec": {"taints": [{"key": t, "effect": "NoExecute"} for t in taints or []]},
        "status": {"conditions": conditions},
    }


def with_health(p: dict[str, Any], *health: str, name: str = "nvidia.com/gpu") -> dict[str, Any]:
    p = copy.deepcopy(p)
    devices = [{"resourceID": f"GPU-{i}", "health": h} for i, h in enumerate(health)]
    p["status"]["containerStatuses"] = [
        {"name": "worker", "allocatedResourcesStatus": [{"name": name, "resources": devices}]}
    ]
    return p


def decide(*pods: dict[str, Any], nodes: dict[str, Any] | None = None, **rules: Any) -> Hosts:
    return discover_hosts(Snapshot(pods=pods, nodes=nodes), HostRules(**rules))


def reasons(hosts: Hosts) -> dict[str, str]:
    return {entry.pod.split("/")[1]: entry.reason for entry in hosts.left_out}


# --- which pods are hosts --------------------------------------------------------------------


def disrupted(reason: str) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True"}
    condition = {"type": "DisruptionTarget", "status": "True", "reason": reason}
    return {"status": {"conditions": [ready, condition]}}


DELETING = {"metadata": {"name": "w", "namespace": NS, "deletionTimestamp": "2026-01-01T00:00:00Z"}}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"phase": "Pending"}, "phase Pending"),
        ({"ready": False}, "not Ready"),
        (DELETING, "being deleted"),
        (disrupted(DISRUPTION_REASON), f"DisruptionTarget ({DISRUPTION_REASON})"),
        (disrupted("DeletionByTaintManager"), "DisruptionTarget (DeletionByTaintManager)"),
        ({"ip": "fd00::5"}, "no IPv4 address"),
    ],
)
def test_a_pod_that_cannot_train_is_left_out(change: dict[str, Any], reason: str) -> None:
    hosts = decide(pod("w", **change), pod("v", ip="10.0.0.2"))
    assert hosts.lines == ("10.0.0.2",)
    assert reasons(hosts)["w"].startswith(reason)


def test_a_false_disruption_target_and_a_running_ready_pod_are_hosts() -> None:
    conditions = [
        {"type": "Ready", "status": "True"},
        {"type": "DisruptionTarget", "status": "False", "reason": "PreemptionByScheduler"},
    ]
    hosts = decide(pod("w", ip="10.0.0.1", status={"conditions": conditions}))
    assert hosts.lines == ("10.0.0.1",)
    assert hosts.left_out == ()


def test_the_pod_a_replacement_names_is_left_out_and_the_replacement_counts_once_ready() -> None:
    old = pod("w-0", ip="10.0.0.1")
    new = pod("w-0-r1", ip="10.0.0.9", annotations={REPLACES_UID_ANNOTATION: "uid-w-0"})
    hosts = decide(old, new)
    assert hosts.lines == ("10.0.0.9",)
    assert reasons(hosts) == {"w-0": "being replaced by w-0-r1"}
    starting = pod("w-0-r1", phase="Pending", annotations={REPLACES_UID_ANNOTATION: "uid-w-0"})
    assert decide(old, starting).lines == ()


def test_a_device_kubelet_reports_unhealthy_leaves_the_pod_out_unknown_does_not() -> None:
    base = pod("w", ip="10.0.0.1", gpus=2)
    assert decide(with_health(base, "Healthy", "Unknown")).lines == ("10.0.0.1:2",)
    hosts = decide(with_health(base, "Healthy", "Unhealthy"))
    assert hosts.lines == ()
    assert reasons(hosts) == {"w": "device unhealthy: GPU-1 (nvidia.com/gpu)"}
    claim = with_health(base, "Unhealthy", name="claim:gpus/gpu")
    assert reasons(decide(claim)) == {"w": "device unhealthy: GPU-0 (claim:gpus/gpu)"}


@pytest.mark.parametrize(
    ("the_node", "reason"),
    [
        (None, "node n1 is gone"),
        (node(ready="False"), "node n1 Ready=False"),
        (node(ready="Unknown"), "node n1 Ready=Unknown"),
        (node(taints=[UNREACHABLE]), f"node n1 tainted {UNREACHABLE}"),
        (node(taints=[OUT_OF_SERVICE]), f"node n1 tainted {OUT_OF_SERVICE}"),
        (node(accelerators="False"), f"node n1 {CONDITION_TYPE}=False (XID79) and kubelet"),
    ],
)
def test_a_pod_on_a_node_that_cannot_train_is_left_out(
    the_node: dict[str, Any] | None, reason: str
) -> None:
    hosts = decide(
        pod("w", gpus=8, node="n1"),
        pod("v", ip="10.0.0.2", gpus=8, node="n2"),
        nodes={"n1": the_node, "n2": node("n2")},
    )
    assert hosts.lines == ("10.0.0.2:8",)
    assert reasons(hosts)["w"].startswith(reason)


def test_an_unhealthy_accelerator_node_leaves_out_only_pods_whose_health_is_unknown() -> None:
    nodes = {"n1": node(accelerators="False")}
    reported = with_health(pod("a", ip="10.0.0.1", gpus=1), "Healthy")
    unreported = pod("b", ip="10.0.0.2", gpus=1)
    cpu_only = pod("c", ip="10.0.0.3")
    hosts = decide(reported, unreported, cpu_only, nodes=nodes)
    assert hosts.lines == ("10.0.0.1:1", "10.0.0.3")
    assert list(reasons(hosts)) == ["b"]
    # A cordon (unschedulable) or a healthy condition says nothing against the pods.
    cordoned = node(accelerators="True")
    cordoned["spec"]["unschedulable"] = True
    assert decide(unreported, nodes={"n1": cordoned}).lines == ("10.0.0.2:1",)


def test_the_not_ready_taint_alone_says_nothing_the_ready_condition_does_not() -> None:
    nodes = {"n1": node(taints=["node.kubernetes.io/not-ready"])}
    assert decide(pod("w", ip="10.0.0.1"), nodes=nodes).lines == ("10.0.0.1",)


def test_without_nodes_only_the_pods_decide() -> None:
    assert decide(pod("w", ip="10.0.0.1"), nodes=None).lines == ("10.0.0.1",)


def test_nodes_are_read_only_for_pods_still_in_the_running() -> None:
    pods = [
        pod("a", node="n1"),
        pod("b", node="n2", phase="Pending"),
        pod("c", node="n3", ready=False),
        with_health(pod("d", node="n4", gpus=1), "Unhealthy"),
        pod("e", node="n5"),
        pod("f", node=""),
    ]
    assert nodes_to_read(pods) == ["n1", "n5"]


# --- addresses and slots ---------------------------------------------------------------------


def test_dns_names_for_pods_with_hostname_and_subdomain_else_their_address() -> None:
    named = pod("w-0", ip="10.0.0.1", spec={"hostname": "w-0", "subdomain": "job"})
    unnamed = pod("w-1", ip="10.0.0.2", spec={"subdomain": "job"})
    assert decide(named, unnamed, dns=True).lines == ("w-0.job", "10.0.0.2")
    assert decide(named, unnamed).lines == ("10.0.0.1", "10.0.0.2")


def test_dual_stack_pods_are_given_their_ipv4_address() -> None:
    dual = pod("w", ip="fd00::1", status={"podIPs": [{"ip": "fd00::1"}, {"ip": "10.1.2.3"}]})
    assert decide(dual).lines == ("10.1.2.3",)


def test_a_host_is_printed_once() -> None:
    a = pod("a", ip="10.0.0.1", spec={"hostname": "w", "subdomain": "job"})
    b = pod("b", ip="10.0.0.2", spec={"hostname": "w", "subdomain": "job"})
    assert decide(a, b, dns=True).lines == ("w.job",)


@pytest.mark.parametrize(
    ("the_pod", "rule", "line"),
    [
        (pod("w", ip=IP, gpus=8), SlotRule(), f"{IP}:8"),
        (pod("w", ip=IP, gpus=2, resource="nvidia.com/mig-1g.10gb"), SlotRule(), f"{IP}:2"),
        (pod("w", ip=IP, gpus=4, resource="huawei.com/Ascend910"), SlotRule(), f"{IP}:4"),
        (pod("w", ip=IP, gpus=4, resource="hygon.com/dcunum"), SlotRule(), f"{IP}:4"),
        (pod("w", ip=IP, gpus=4, resource="nvidia.com/gpumem"), SlotRule(), IP),
        (pod("w", ip=IP, gpus=4, resource="example.com/tpu"), SlotRule(), IP),
        (
            pod("w", ip=IP, gpus=4, resource="example.com/tpu"),
            SlotRule(resources=frozenset({"example.com/tpu"})),
            f"{IP}:4",
        ),
        (pod("w", ip=IP, gpus=8), SlotRule(fixed=3), f"{IP}:3"),
        (pod("w", ip=IP, labels={"slots": "6"}), SlotRule(source=("label", "slots")), f"{IP}:6"),
        (
            pod("w", ip=IP, annotations={"x/slots": "2"}),
            SlotRule(source=("annotation", "x/slots")),
            f"{IP}:2",
        ),
        (pod("w", ip=IP, gpus=8), SlotRule(source=("label", "slots")), IP),
    ],
)
def test_slots(the_pod: dict[str, Any], rule: SlotRule, line: str) -> None:
    assert decide(the_pod, slots=rule).lines == (line,)


def test_a_slots_label_that_is_no_number_is_named_and_the_default_applies() -> None:
    hosts = decide(pod("w", ip="10.0.0.1", labels={"slots": "eight"}),
                   slots=SlotRule(source=("label", "slots")))  # fmt: skip
    assert hosts.lines == ("10.0.0.1",)
    assert hosts.notes == (f"{NS}/w: label slots='eight' is not a positive integer",)


def test_slots_from_the_devices_of_the_pods_resource_claims() -> None:
    spec = {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two-gpus"},
                               {"name": "nic", "resourceClaimName": "shared-nic"}]}  # fmt: skip
    status = {"resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": "w-gpus-x1"}]}
    the_pod = pod("w", ip="10.0.0.1", spec=spec, status=status)

    def claim(*drivers: str) -> dict[str, Any]:
        results = [{"driver": d, "device": f"gpu-{i}"} for i, d in enumerate(drivers)]
        return {"status": {"allocation": {"devices": {"results": results}}}}

    claims = {
        "w-gpus-x1": claim("gpu.nvidia.edl.io", "gpu.nvidia.edl.io"),
        "shared-nic": claim("rdma.example.com"),
    }
    snapshot = Snapshot(pods=[the_pod], nodes=None, claims=claims)
    assert discover_hosts(snapshot, HostRules()).lines == ("10.0.0.1:2",)
    assert needs_claims([the_pod], HostRules())
    assert not needs_claims([the_pod], HostRules(slots=SlotRule(fixed=1)))
    assert not needs_claims([pod("v")], HostRules())
    # Not allocated yet, or not readable: no count.
    assert discover_hosts(Snapshot(pods=[the_pod]), HostRules()).lines == ("10.0.0.1",)


# --- what Horovod reads ----------------------------------------------------------------------


def horovod_parse(output: str, default_slots: int) -> dict[str, int]:
    """horovod.runner.elastic.discovery.HostDiscoveryScript's parsing (v0.28.1), verbatim; the
    real one runs on our command in tests/cluster/test_hosts.py."""
    host_slots = {}
    for line in set(output.strip().split("\n")):
        host = line
        if ":" in line:
            host, slots = line.split(":")
            host_slots[host] = int(slots)
        elif host:
            host_slots[host] = default_slots
    return host_slots


_pods = st.lists(
    st.builds(
        lambda i, gpus, ready, v6, dns: pod(
            f"w-{i}",
            ip=f"fd00::{i}" if v6 else f"10.0.{i // 250}.{i % 250}",
            gpus=gpus,
            ready=ready,
            spec={"hostname": f"w-{i}", "subdomain": "job"} if dns else {},
        ),
        st.integers(0, 600),
        st.integers(0, 16),
        st.booleans(),
        st.booleans(),
        st.booleans(),
    ),
    max_size=12,
    unique_by=lambda p: p["metadata"]["name"],
)


@given(pods=_pods, dns=st.booleans())
def test_every_output_parses_as_horovod_reads_it(pods: list[dict[str, Any]], dns: bool) -> None:
    hosts = discover_hosts(Snapshot(pods=pods), HostRules(dns=dns))
    parsed = horovod_parse("\n".join(hosts.lines), default_slots=1)
    assert len(parsed) == len(hosts.lines)  # one host per line, none lost to a stray ':'
    assert len(hosts.lines) + len(hosts.left_out) <= len(pods)
    assert all(slots > 0 for slots in parsed.values())


# --- the command -----------------------------------------------------------------------------


def hosts_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edl_agent.cli", "hosts", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else {"PATH": "/usr/bin:/bin"},
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "the following arguments are required: -l/--selector"),
        (("-l", " "), "an empty selector would select every pod"),
        (("-l", "a=b", "--slots", "0"), "argument --slots: '0' is not a positive integer"),
        (("-l", "a=b", "--slots-from", "env:X"), "expected label:KEY or annotation:KEY"),
        (("-l", "a=b", "--slots", "2", "--slots-from", "label:x"), "not allowed with argument"),
        (("-l", "a=b"), "no credentials: pass --kubeconfig, set $KUBECONFIG or run in a pod"),
        (("-l", "a=b", "--kubeconfig", "/nonexistent"), "--kubeconfig: /nonexistent does not"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    done = hosts_cli(*args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("edl-agent: error: ")
    assert message in done.stderr


def test_an_api_server_that_does_not_answer_is_exit_1_and_nothing_on_stdout(
    tmp_path: Path,
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    done = hosts_cli("-l", "job-name=x", "--kubeconfig", str(kubeconfig))
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("edl-agent: error: cannot reach the API server: ")


def test_help_says_what_is_left_out_and_the_exit_codes() -> None:
    done = hosts_cli("--help")
    assert done.returncode == 0
    for words in (
        "--host-discovery-script",
        "DisruptionTarget",
        "allocatedResourcesStatus",
        "--slots-from",
        "--skip-nodes",
        "Exit 1",
        "(cluster-wide, a ClusterRole)",
    ):
        assert words in done.stdout, words


def test_the_namespace_comes_from_the_service_account_else_default(tmp_path: Path) -> None:
    file = tmp_path / "namespace"
    assert default_namespace(file) == "default"
    file.write_text("ml-team\n")
    assert default_namespace(file) == "ml-team"
