"""Fixtures for tests that need a real control plane: etcd + kube-apiserver + kwok, and for the
tests that need kube-controller-manager too, a second one with it.

Tests under tests/cluster/ are marked ``cluster`` automatically; deselect them with
``pytest -m "not cluster"``. The binaries come from ``scripts/k8s-binaries`` (built once into
``.cache/k8s/``); when they are missing these tests fail and say so, they never skip.

Fixtures:
  k8s_binaries       session: the bin dir (fails with instructions when binaries are missing)
  k8s_control_plane  session: the running control plane (testcluster.ControlPlane)
  k8s_api_client     session: kubernetes.client.ApiClient with admin credentials
  k8s                function: KwokCluster helper bound to a fresh namespace, cleaned after
  kubelet_nodes      function: starts real kubelet nodes (scripts/testnode.py) on the session's
                     control plane, stopped and removed after the test; marker ``kubelet``
  kubectl            session: `kubectl` against the control plane, failing the test on an error
  monitoring_crds    session: the Prometheus Operator's ServiceMonitor and PrometheusRule CRDs
  cert_manager_crds  session: cert-manager's Issuer and Certificate CRDs (kube_tools.py)

With kube-controller-manager (testcluster.CONTROLLERS: Job, ReplicaSet, Deployment, StatefulSet,
node lifecycle, taint eviction, pod GC, garbage collector, ResourceClaim, device taint eviction,
ServiceAccount tokens, disruption budgets),
a control plane of its own, so that its controllers never act on the session plane's objects:
  k8s_managed_plane         module: the running control plane with the controller manager
  k8s_managed_api_client    module: an admin ApiClient for it
  k8s_managed               function: KwokCluster on it, bound to a fresh namespace, cleaned after
  managed_kubelet_nodes     function: like kubelet_nodes, on that plane
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE.parent.parent / "scripts"
# scripts/ holds the control-plane code shared with scripts/test-cluster; HERE the helpers
# (explicit, so that --import-mode=importlib works too).
for _path in (SCRIPTS, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import k8sbinaries  # noqa: E402
import testcluster  # noqa: E402
from k8s_test_helpers import KwokCluster, admin_client  # noqa: E402
from kube_tools import (  # noqa: E402
    CERT_MANAGER_CRDS,
    PROMETHEUS_OPERATOR_CRDS,
    Kubectl,
    install_crds,
    kubectl_binary,
)
from kubelet_helpers import StartNode, kubelet_node_starter  # noqa: E402
from scheduler import Process, ProcessError, start_scheduler  # noqa: E402

from tests.conftest import session_owns  # noqa: E402

_startup: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.cluster)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if "seconds" in _startup:
        terminalreporter.write_line(
            f"k8s control plane: ready {_startup['seconds']:.1f}s after start "
            f"(etcd + kube-apiserver + kwok from {k8sbinaries.bin_dir()})"
        )
    if "managed seconds" in _startup:
        terminalreporter.write_line(
            f"k8s control plane with kube-controller-manager: healthy "
            f"{_startup['managed seconds']:.1f}s after start"
        )


@pytest.fixture(scope="session")
def k8s_binaries() -> Path:
    """The bin dir; fails (never skips) with instructions when binaries are missing."""
    absent = k8sbinaries.missing(k8sbinaries.CONTROL_PLANE)
    if absent:
        pytest.fail(
            f"cluster tests need {', '.join(absent)} in {k8sbinaries.bin_dir()} (or etcd and "
            "kube-apiserver in $KUBEBUILDER_ASSETS). Run `scripts/k8s-binaries` once (the "
            "first build takes about 10 minutes on 2 cores), or deselect these tests with "
            "-m 'not cluster'.",
            pytrace=False,
        )
    return k8sbinaries.bin_dir()


@pytest.fixture(scope="session")
def k8s_control_plane(
    k8s_binaries: Path, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[testcluster.ControlPlane]:
    directory = tmp_path_factory.mktemp("k8s-control-plane")
    try:
        plane = testcluster.start(directory, attached=True)
    except testcluster.ControlPlaneError as exc:
        pytest.fail(f"could not start the test control plane: {exc}", pytrace=False)
    _startup["seconds"] = plane.startup_seconds
    session_owns(pytestconfig, plane.pids.values)
    yield plane
    pids = plane.stop()
    left = [pid for pid in pids if testcluster.pid_alive(pid)]
    assert not left, f"control-plane processes {left} survived the session teardown"


@pytest.fixture(scope="session")
def k8s_api_client(k8s_control_plane: testcluster.ControlPlane) -> Iterator[client.ApiClient]:
    api = admin_client(k8s_control_plane)
    yield api
    api.close()


def _test_namespace(api: client.ApiClient, request: pytest.FixtureRequest) -> KwokCluster:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    namespace = f"t-{slug}-{secrets.token_hex(2)}"
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
    )
    return KwokCluster(api, namespace)


@pytest.fixture
def k8s(k8s_api_client: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[KwokCluster]:
    cluster = _test_namespace(k8s_api_client, request)
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="module")
def k8s_managed_plane(
    k8s_binaries: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[testcluster.ControlPlane]:
    """A control plane of its own with kube-controller-manager, for the tests of one module (it
    costs a second etcd and kube-apiserver while they run)."""
    absent = k8sbinaries.missing((testcluster.CONTROLLER_MANAGER,))
    if absent:
        pytest.fail(
            f"{', '.join(absent)} missing in {k8sbinaries.bin_dir()}: run scripts/k8s-binaries",
            pytrace=False,
        )
    directory = tmp_path_factory.mktemp("k8s-managed-plane")
    try:
        plane = testcluster.start(directory, attached=True, controller_manager=True)
    except testcluster.ControlPlaneError as exc:
        pytest.fail(
            f"could not start a control plane with the controller manager: {exc}", pytrace=False
        )
    _startup["managed seconds"] = plane.startup_seconds
    yield plane
    pids = plane.stop()
    left = [pid for pid in pids if testcluster.pid_alive(pid)]
    assert not left, f"processes {left} of the plane with the controller manager survived it"


@pytest.fixture(scope="module")
def k8s_managed_api_client(
    k8s_managed_plane: testcluster.ControlPlane,
) -> Iterator[client.ApiClient]:
    api = admin_client(k8s_managed_plane)
    yield api
    api.close()


@pytest.fixture
def k8s_managed(
    k8s_managed_api_client: client.ApiClient, request: pytest.FixtureRequest
) -> Iterator[KwokCluster]:
    """KwokCluster on the plane with the controller manager. Its Jobs go first at cleanup (with
    their pods, by the garbage collector), so that no controller recreates what is removed."""
    cluster = _test_namespace(k8s_managed_api_client, request)
    yield cluster
    client.BatchV1Api(k8s_managed_api_client).delete_collection_namespaced_job(
        cluster.namespace, propagation_policy="Background"
    )
    cluster.cleanup()


@pytest.fixture
def kubelet_nodes(k8s_control_plane: testcluster.ControlPlane) -> Iterator[StartNode]:
    """``start(name=None, **options)`` starts one more real kubelet node (Ready, untainted) on the
    session's control plane; ``options`` go to testnode.start_node_on (``exec_mode=True,
    cdi_dirs=[...]``: its containers run as processes). Each lives in a short directory under
    /tmp (its sockets must fit 107 bytes) that is removed afterwards with the node's processes,
    mounts and Node object. Fails, never skips, where kubelet nodes cannot run (not root, no
    unshare, no overlayfs)."""
    yield from kubelet_node_starter(k8s_control_plane)


@pytest.fixture
def managed_kubelet_nodes(k8s_managed_plane: testcluster.ControlPlane) -> Iterator[StartNode]:
    """``kubelet_nodes`` on the plane with the controller manager."""
    yield from kubelet_node_starter(k8s_managed_plane)


@pytest.fixture(scope="session")
def kubectl(
    k8s_control_plane: testcluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Kubectl:
    """`kubectl --kubeconfig=<the test control plane>` (never ~/.kube), failing on an error."""
    binary = kubectl_binary()
    cache = tmp_path_factory.mktemp("kubectl-cache")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [
                str(binary),
                f"--kubeconfig={k8s_control_plane.kubeconfig}",
                f"--cache-dir={cache}",
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"kubectl {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}",
                pytrace=False,
            )
        return result

    return run


@pytest.fixture(scope="session")
def monitoring_crds(
    kubectl: Kubectl, k8s_api_client: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    install_crds(
        PROMETHEUS_OPERATOR_CRDS, kubectl, k8s_api_client, tmp_path_factory.mktemp("go-mod")
    )


@pytest.fixture(scope="session")
def cert_manager_crds(
    kubectl: Kubectl, k8s_api_client: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    install_crds(CERT_MANAGER_CRDS, kubectl, k8s_api_client, tmp_path_factory.mktemp("go-mod"))


@pytest.fixture(scope="module")
def kube_scheduler(
    k8s_control_plane: testcluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Process]:
    """A real kube-scheduler (admin kubeconfig, no leader election) for one test module."""
    try:
        process = start_scheduler(
            k8s_control_plane.kubeconfig, tmp_path_factory.mktemp("kube-scheduler"), timeout=90.0
        )
    except ProcessError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield process
    process.stop()
    assert not process.alive()
