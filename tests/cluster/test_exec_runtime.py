"""Kubelet v1.37 nodes whose runtime runs containers as host processes (testnode exec mode): a
pod's command runs with kubelet's environment plus its CDI devices' env edits, on a loopback
address of its own, logs where kubelet (and the API's pods/log) read them, and exits with a code
kubelet sees; kubelet restarts containers in place; a deleted pod's whole process tree ends.

Pods are placed by spec.nodeName, except the DRA one (kube-scheduler). Commands are the venv's
python by absolute path: no image is pulled.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import testcluster
import testnode
from k8s_test_helpers import KwokCluster
from kube_tools import Kubectl
from kubelet_helpers import claim_body, node_agent, wait_for, wait_phase
from kubernetes import client
from kubernetes.client.rest import ApiException
from scheduler import Process

pytestmark = pytest.mark.kubelet

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
STEP = 30.0
StartNode = Callable[..., testnode.Node]


def exec_pod(
    name: str,
    node: str | None,
    script: str,
    *,
    restart_policy: str = "Never",
    grace: int = 0,
    container: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod whose one container `main` runs `python -c script`, with POD_IP from its status."""
    main = {
        "name": "main",
        "image": "registry.invalid/not-pulled:exec",
        "command": [PYTHON, "-c", script],
        "env": [
            {"name": "GREETING", "value": "hello"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
    } | (container or {})
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": grace,
            "containers": [main],
        }
        | (spec or {}),
    }
    if node is not None:
        body["spec"]["nodeName"] = node
    return body


def log_lines(node: testnode.Node, namespace: str, pod: str, attempt: int = 0) -> list[str]:
    """`stream tag line` of each line of the container log file kubelet reads."""
    [view] = [
        v
        for v in node.containers()
        if (v["namespace"], v["pod"], v["container"], v["attempt"])
        == (namespace, pod, "main", attempt)
    ]
    path = node.host_path(str(view["log_path"]))
    lines = []
    for line in path.read_text().splitlines():
        stamp, rest = line.split(" ", 1)
        time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")  # an RFC 3339 time leads every line
        lines.append(rest)
    return lines


def terminated(pod: Any) -> Any:
    statuses = pod.status.container_statuses or []
    return statuses[0].state.terminated if statuses else None


def pod_with_token(token: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if any(token in arg for arg in process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


REPORT = """
import json, os, sys, time
print(json.dumps({"started": time.time(), "greeting": os.environ.get("GREETING"),
                  "pod_ip": os.environ.get("POD_IP"), "path": os.environ.get("PATH")}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_pod_runs_its_command_and_reports_its_exit_code_env_ip_and_log(
    kubelet_nodes: StartNode, k8s: KwokCluster
) -> None:
    node = kubelet_nodes(exec_mode=True)
    ns = k8s.namespace
    created = time.time()
    k8s.core.create_namespaced_pod(ns, exec_pod("report", node.name, REPORT))
    pod = wait_phase(k8s.core, ns, "report", "Failed", timeout=STEP)
    state = terminated(pod)
    assert (state.exit_code, state.reason) == (3, "Error")
    assert state.finished_at is not None
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(node.pod_ip_range)

    stdout, stderr = sorted(log_lines(node, ns, "report"), reverse=True)
    assert stderr == "stderr F to stderr"
    stream, tag, text = stdout.split(" ", 2)
    assert (stream, tag) == ("stdout", "F")
    report = json.loads(text)
    assert report["greeting"] == "hello"
    assert report["pod_ip"] == pod.status.pod_ip
    assert report["path"]  # the runtime's default, as for an image without ENV
    print(f"pod created → process running: {report['started'] - created:.2f}s")

    # The API server reaches kubelet's log endpoint, which reads the same file.
    text = k8s.core.read_namespaced_pod_log("report", ns, container="main")
    assert sorted(text.splitlines()) == sorted([stdout.split(" ", 2)[2], "to stderr"])


SERVE = """
import os, socket
with socket.create_server((os.environ["POD_IP"], 18080)) as server:
    print("listening", flush=True)
    connection, _ = server.accept()
    with connection:
        connection.sendall(os.environ["NAME"].encode())
"""


def test_two_pods_on_one_node_bind_the_same_port_on_their_own_ip(
    kubelet_nodes: StartNode, k8s: KwokCluster
) -> None:
    node = kubelet_nodes(exec_mode=True)
    ns = k8s.namespace
    for name in ("left", "right"):
        env = {"env": [*exec_pod("", None, "")["spec"]["containers"][0]["env"],
                       {"name": "NAME", "value": name}]}  # fmt: skip
        k8s.core.create_namespaced_pod(ns, exec_pod(name, node.name, SERVE, container=env))
    ips = {}
    for name in ("left", "right"):
        pod = wait_phase(k8s.core, ns, name, "Running", timeout=STEP)
        ips[name] = pod.status.pod_ip
        wait_for(f"{name} listening", lambda n=name: log_lines(node, ns, n), bool, timeout=STEP)
    assert ips["left"] != ips["right"]
    for name, ip in ips.items():
        with socket.create_connection((ip, 18080), timeout=5) as connection:
            assert connection.recv(64) == name.encode()
    for name in ("left", "right"):
        pod = wait_phase(k8s.core, ns, name, "Succeeded", timeout=STEP)
        assert terminated(pod).exit_code == 0


FAIL_ONCE = """
import os, sys
marker = os.environ["MARKER"]
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(int(os.environ["FIRST_CODE"]))
print("second run")
"""


@pytest.mark.parametrize(
    "case",
    [
        ("OnFailure", {}, 1),
        # KEP-5307 (ContainerRestartRules, beta and on in 1.37): restart on exit code 42 only.
        (
            "Never",
            {
                "restartPolicy": "Never",
                "restartPolicyRules": [
                    {"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}
                ],
            },
            42,
        ),
    ],
    ids=["OnFailure", "restartPolicyRules"],
)
def test_kubelet_restarts_a_failed_container_in_place(
    kubelet_nodes: StartNode,
    k8s: KwokCluster,
    tmp_path: Path,
    case: tuple[str, dict[str, Any], int],
) -> None:
    restart_policy, container, first_code = case
    node = kubelet_nodes(exec_mode=True)
    ns = k8s.namespace
    env = [
        {"name": "MARKER", "value": str(tmp_path / "ran-once")},
        {"name": "FIRST_CODE", "value": str(first_code)},
    ]
    body = exec_pod(
        "flaky",
        node.name,
        FAIL_ONCE,
        restart_policy=restart_policy,
        container=container | {"env": env},
    )
    k8s.core.create_namespaced_pod(ns, body)
    pod = wait_phase(k8s.core, ns, "flaky", "Succeeded", timeout=STEP)
    status = pod.status.container_statuses[0]
    assert status.restart_count == 1
    assert status.state.terminated.exit_code == 0
    assert status.last_state.terminated.exit_code == first_code
    assert log_lines(node, ns, "flaky", attempt=1) == ["stdout F second run"]


TREE = """
import subprocess, sys, time
CHILD = '''
import os, subprocess, sys, time
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(3600)  # TOKEN"], start_new_session=True
)
with open(os.environ["PIDS"], "a") as f:
    print(os.getppid(), os.getpid(), grandchild.pid, file=f)
time.sleep(3600)
'''
subprocess.Popen([sys.executable, "-c", CHILD + "# TOKEN"])
time.sleep(3600)
"""


def test_deleting_a_pod_ends_its_whole_process_tree_with_sigterm(
    kubelet_nodes: StartNode, k8s: KwokCluster, tmp_path: Path
) -> None:
    node = kubelet_nodes(exec_mode=True)
    ns = k8s.namespace
    token = f"edl-exec-{secrets.token_hex(4)}"
    pids_file = tmp_path / "pids"
    env = {"env": [{"name": "PIDS", "value": str(pids_file)}]}
    body = exec_pod("tree", node.name, TREE.replace("TOKEN", token), grace=20, container=env)
    k8s.core.create_namespaced_pod(ns, body)
    wait_phase(k8s.core, ns, "tree", "Running", timeout=STEP)
    text = wait_for("the tree's pids", lambda: pids_file.read_text() if pids_file.exists() else "",
                    lambda t: t.endswith("\n"), timeout=STEP)  # fmt: skip
    pids = [int(p) for p in text.split()]
    processes = [psutil.Process(pid) for pid in pids]
    assert len({os.getsid(pid) for pid in pids}) == 2  # the grandchild left the session
    began = time.monotonic()
    k8s.core.delete_namespaced_pod("tree", ns)
    _gone, alive = psutil.wait_procs(processes, timeout=15)
    took = time.monotonic() - began
    assert not alive, f"survived the pod's deletion: {alive}"
    assert took < 15, "SIGTERM (not the SIGKILL after the 20 s grace) must end them"

    def deleted() -> bool:
        try:
            k8s.core.read_namespaced_pod("tree", ns)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for("the pod gone", deleted, bool, timeout=STEP)
    assert pod_with_token(token) == []


# --- a GPU claim's CDI env edits (the agent's DRA driver) ------------------------------------


@pytest.fixture(scope="module")
def device_classes(kubectl: Kubectl, kube_scheduler: Process) -> Iterator[None]:
    manifest = str(REPO / "deploy/dra/deviceclasses.yaml")
    kubectl("apply", "-f", manifest)
    yield
    kubectl("delete", "-f", manifest, "--ignore-not-found")


PRINT_GPUS = """
import os
print(os.environ.get("NVIDIA_VISIBLE_DEVICES"), os.environ.get("EDL_CLAIM_UID"))
"""


def test_a_gpu_claim_gets_the_env_of_its_cdi_spec(
    kubelet_nodes: StartNode,
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    device_classes: None,
    tmp_path: Path,
) -> None:
    cdi_dir = tmp_path / "cdi"
    node = kubelet_nodes(exec_mode=True, cdi_dirs=[cdi_dir])
    agent = node_agent(
        node,
        "dgx-h100",
        tmp_path / "agent",
        f"--kubeconfig={k8s_control_plane.kubeconfig}",
        f"--set=dra.plugins_registry_dir={node.paths.plugins_registry}",
        f"--set=dra.cdi_dir={cdi_dir}",
        "--set=nvidia.serve=dra",
    )
    try:
        ns = k8s.namespace
        custom = client.CustomObjectsApi(k8s.core.api_client)
        claim = custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", ns, "resourceclaims", claim_body("gpu", "gpu.nvidia.edl.io")
        )
        spec = {"resourceClaims": [{"name": "gpu", "resourceClaimName": "gpu"}]}
        resources = {"resources": {"claims": [{"name": "gpu"}]}}
        body = exec_pod("gpu", None, PRINT_GPUS, container=resources, spec=spec)
        k8s.core.create_namespaced_pod(ns, body)
        pod = wait_phase(k8s.core, ns, "gpu", "Succeeded", timeout=STEP, alive=agent.process)
        assert pod.spec.node_name == node.name
        uid = claim["metadata"]["uid"]
        # Only the claim's CDI spec (gone once the pod ended) sets these two.
        [created] = [e for e in testnode.cri_log(node.paths.cri_log) if e["pod_name"] == "gpu"]
        env = dict(e.split("=", 1) for e in created["cdi_edits"]["env"])
        assert env["EDL_CLAIM_UID"] == uid
        assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
        assert log_lines(node, ns, "gpu") == [f"stdout F {env['NVIDIA_VISIBLE_DEVICES']} {uid}"]
        assert created["cdi_edits"]["device_nodes"]  # recorded, not made
    finally:
        assert agent.stop() == 0
