"""Smoke tests for the etcd + kube-apiserver + kwok control plane (with kube-controller-manager on
request) and its helpers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import k8sbinaries
import pytest
import testcluster
from k8s_test_helpers import (
    GPU_RESOURCE,
    KwokCluster,
    container_state,
    forge_token,
    node_ready,
    wait_for,
)
from kubernetes import client
from kubernetes import config as kube_config

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kwok_node_becomes_ready(k8s: KwokCluster) -> None:
    node = k8s.create_gpu_node(gpus=8)

    assert node_ready(node) is True
    assert node.status.allocatable[GPU_RESOURCE] == "8"
    assert node.status.capacity[GPU_RESOURCE] == "8"
    assert node.status.phase == "Running"


def test_pod_runs_then_exits_with_137(k8s: KwokCluster) -> None:
    node = k8s.create_gpu_node(gpus=8)
    pod = k8s.create_pod(node=node.metadata.name, gpus=8)

    assert pod.status.phase == "Running"
    assert container_state(pod).running is not None

    exited = k8s.exit_pod(pod.metadata.name, 137)

    terminated = container_state(exited).terminated
    assert terminated.exit_code == 137
    reread = k8s.wait_pod_phase(pod.metadata.name, "Failed")
    assert container_state(reread).terminated.exit_code == 137


def test_force_deleted_pod_is_gone(k8s: KwokCluster) -> None:
    node = k8s.create_gpu_node()
    pod = k8s.create_pod(node=node.metadata.name)

    k8s.force_delete_pod(pod.metadata.name)

    pods = k8s.core.list_namespaced_pod(k8s.namespace).items
    assert pod.metadata.name not in [p.metadata.name for p in pods]


def test_node_goes_not_ready_and_back(k8s: KwokCluster) -> None:
    node = k8s.create_gpu_node()
    name = node.metadata.name

    assert node_ready(k8s.make_node_not_ready(name)) is False
    assert node_ready(k8s.make_node_ready(name)) is True


def test_service_account_token_passes_token_review(k8s: KwokCluster) -> None:
    token = k8s.mint_token("edl-agent")

    review = k8s.token_review(token)
    assert review.authenticated is True
    assert review.user.username == f"system:serviceaccount:{k8s.namespace}:edl-agent"

    forged = forge_token(token, sub=f"system:serviceaccount:{k8s.namespace}:admin")
    assert not k8s.token_review(forged).authenticated
    assert not k8s.token_review("not-a-token").authenticated


def test_namespace_cleanup_leaves_nothing(k8s_api_client: client.ApiClient) -> None:
    cluster = KwokCluster(k8s_api_client, "t-cleanup-check")
    cluster.core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=cluster.namespace))
    )
    node = cluster.create_gpu_node()
    cluster.create_pod(node=node.metadata.name)
    cluster.mint_token("worker")

    cluster.cleanup()

    names = [ns.metadata.name for ns in cluster.core.list_namespace().items]
    assert cluster.namespace not in names
    pods = cluster.core.list_pod_for_all_namespaces(
        field_selector="spec.nodeName=" + node.metadata.name
    )
    assert pods.items == []
    assert node.metadata.name not in [n.metadata.name for n in cluster.core.list_node().items]


# --- process lifetime -------------------------------------------------------------------


def _wait_all_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    return wait_for(
        f"pids {pids} to exit",
        lambda: [pid for pid in pids if testcluster.pid_alive(pid)],
        lambda alive: not alive,
        timeout,
    )


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=90)


@pytest.mark.usefixtures("k8s_binaries")
def test_separate_control_plane_stops_without_leftovers(tmp_path: Path) -> None:
    directory = tmp_path / "cp"
    plane = testcluster.start(directory, attached=True)
    pids = list(plane.pids.values())
    assert sorted(plane.pids) == ["etcd", "kube-apiserver", "kwok"]
    assert all(testcluster.pid_alive(pid) for pid in pids)

    stopped = plane.stop()

    assert sorted(stopped) == sorted(pids)
    assert not [pid for pid in pids if testcluster.pid_alive(pid)]
    assert not (directory / "state.json").exists()
    assert not (directory / "etcd-data").exists()


@pytest.mark.usefixtures("k8s_binaries")
def test_cli_up_and_down(tmp_path: Path) -> None:
    directory = tmp_path / "cli"
    script = REPO_ROOT / "scripts" / "test-cluster"
    up = _run(sys.executable, script, "up", directory, "--controller-manager")
    assert up.returncode == 0, up.stderr
    assert Path(up.stdout.strip()) == directory / "kubeconfig"
    state = json.loads((directory / "state.json").read_text())
    pids = [entry["pid"] for entry in state["processes"].values()]
    try:
        assert sorted(state["processes"]) == sorted(testcluster.PROCESS_ORDER)
        assert all(testcluster.pid_alive(pid) for pid in pids)
        # The kubeconfig it wrote works (CA-verified TLS, admin token).
        api = kube_config.new_client_from_config(str(directory / "kubeconfig"))
        try:
            version = client.VersionApi(api).get_code()
            client.CoreV1Api(api).list_namespace()
        finally:
            api.close()
        assert version.git_version == k8sbinaries.K8S_VERSION
    finally:
        down = _run(sys.executable, script, "down", directory)
    assert down.returncode == 0, down.stderr
    assert _wait_all_gone(pids) == []
    assert not directory.exists()


@pytest.mark.usefixtures("k8s_binaries")
def test_processes_die_when_the_test_process_crashes(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed parent (no atexit, no teardown) takes them along, the
    controller manager too."""
    directory = tmp_path / "crash"
    program = (
        "import json, os, signal, sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(REPO_ROOT / 'scripts')!r})\n"
        "import testcluster\n"
        f"plane = testcluster.start(Path({str(directory)!r}), controller_manager=True)\n"
        "print(json.dumps(plane.pids), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = _run(sys.executable, "-c", program)
    assert child.returncode == -signal.SIGKILL, child.stderr
    pids = list(json.loads(child.stdout.strip().splitlines()[-1]).values())
    assert len(pids) == len(testcluster.PROCESS_ORDER)

    assert _wait_all_gone(pids) == []
    # Nothing stopped it cleanly, so its state is still there; stop() copes with that.
    assert sorted(testcluster.stop(directory)) == sorted(pids)
    assert not (directory / "state.json").exists()


def test_warm_start_is_fast(k8s_control_plane: testcluster.ControlPlane) -> None:
    # Target is <= 15 s on 2 cores; allow slack for loaded CI machines.
    assert k8s_control_plane.startup_seconds < 45
    assert k8s_control_plane.kubeconfig.is_file()
