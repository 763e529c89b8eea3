"""The Helm chart installed, upgraded and uninstalled by helm itself, as the README tells a new
user to (Deploy), on a real API server.

- The README's `helm install` succeeds on a cluster without the Prometheus Operator and creates
  every object of the chart but the ServiceMonitors and the PrometheusRule; a `helm upgrade`
  with changed values changes the objects in the cluster; `helm uninstall` removes every object
  of the release and its record, and leaves nothing else behind in the whole cluster but what
  Helm documents it keeps: the FaultTolerancePolicy CRD (crds.keep, helm.sh/resource-policy) and
  the namespace `--create-namespace` made.
- Where the cluster serves the Prometheus Operator's CRDs (installed for real, no operator
  runs), the same command creates the ServiceMonitors and the PrometheusRule too, with no flag;
  serviceMonitor.enabled=false on an upgrade removes the ServiceMonitors; where the CRDs arrive
  after the install, the next `helm upgrade` adds the objects.

A control plane of this module's own: the session's plane holds what test_deploy.py and
test_helm_chart.py apply with kubectl and leave for other tests (edl-system's Services,
ServiceAccounts and PodDisruptionBudget, the ClusterRoles and their bindings, the admission
policies, the FaultTolerancePolicy CRD). Helm refuses to install over objects it does not own
("exists and cannot be imported into the current release: invalid ownership metadata"), and its
uninstall would delete what those tests share. Here the plane starts empty, so what remains after
an uninstall is what the chart left. No kubelet or controller manager runs: the workloads make no
pods, and nothing pulls the image.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import testcluster
import yaml
from kube_tools import PROMETHEUS_OPERATOR_CRDS, helm_binary, install_crds, kubectl_binary
from kubernetes import client
from manifests import NAMESPACE, REPO, WITH_PROMETHEUS_OPERATOR, Key, key, parsed, rendered

from tests.waiting import wait_for

README = REPO / "README.md"
# The README's commands (Deploy), run as written from the repository's root.
INSTALL = "helm install edl-agent deploy/helm/edl-agent -n edl-system --create-namespace"
UPGRADE = "helm upgrade edl-agent deploy/helm/edl-agent -n edl-system --reuse-values"
UNINSTALL = "helm uninstall edl-agent -n edl-system"

CRD = ("CustomResourceDefinition", None, "faulttolerancepolicies.edl.io")
# What Helm leaves on uninstall: objects marked helm.sh/resource-policy: keep (crds.keep), as its
# documentation and its output say, and the release's namespace, which is not part of the
# release (--create-namespace only makes it).
KEPT = frozenset({CRD, ("Namespace", None, NAMESPACE)})
SERVICE_MONITORS = frozenset(
    {("ServiceMonitor", NAMESPACE, "edl-agent"), ("ServiceMonitor", NAMESPACE, "edl-restarter")}
)
PROMETHEUS_RULE = ("PrometheusRule", NAMESPACE, "edl-agent")
MONITORING = SERVICE_MONITORS | {PROMETHEUS_RULE}
# Records of what happened, not objects anyone left: they expire on their own.
TRANSIENT = frozenset({"events", "events.events.k8s.io"})
# The APIServices the API server makes for every group it serves, a CRD's among them (and
# removes with it): counted as their CRD.
AUTOMANAGED = "kube-aggregator.kubernetes.io/automanaged"


@dataclass(frozen=True)
class Cluster:
    """The module's control plane, with helm and kubectl that reach it and nothing else."""

    plane: testcluster.ControlPlane
    api: client.ApiClient
    home: Path

    def env(self) -> dict[str, str]:
        """helm's environment: this plane's kubeconfig (as a user's shell would name it), its
        caches and settings (and client-go's discovery cache under HOME) in a scratch home,
        nothing of the shell running the tests."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "KUBECONFIG": str(self.plane.kubeconfig),
            "HELM_CACHE_HOME": str(self.home / "helm-cache"),
            "HELM_CONFIG_HOME": str(self.home / "helm-config"),
            "HELM_DATA_HOME": str(self.home / "helm-data"),
        }

    def helm(self, command: str, *more: str) -> subprocess.CompletedProcess[str]:
        """A README command (`helm ...`), with more arguments, from the repository's root."""
        argv = shlex.split(command)
        assert argv[0] == "helm", command
        result = subprocess.run(
            [str(helm_binary()), *argv[1:], *more],
            cwd=REPO,
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert result.returncode == 0, f"{command} {' '.join(more)}:\n{result.stderr}"
        return result

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [
                str(kubectl_binary()),
                f"--kubeconfig={self.plane.kubeconfig}",
                f"--cache-dir={self.home / 'kubectl-cache'}",
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert result.returncode == 0, f"kubectl {' '.join(args)}:\n{result.stderr}"
        return result

    def everything(self) -> set[Key]:
        """Every object the API server holds, of every kind it lists (events aside), cluster-wide
        and in every namespace."""
        kinds = self.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
        listed = self.kubectl(
            "get", ",".join(k for k in kinds if k not in TRANSIENT), "-A", "-o", "json"
        )
        return {
            key(doc)
            for doc in yaml.safe_load(listed.stdout)["items"]
            if doc["metadata"].get("labels", {}).get(AUTOMANAGED) != "true"
        }

    def release_objects(self) -> set[Key]:
        manifest = self.helm("helm get manifest edl-agent -n edl-system").stdout
        return {key(doc) for doc in parsed(manifest)}


@pytest.fixture(scope="module")
def helm_plane(k8s_binaries: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An etcd + kube-apiserver + kwok of this module's own, stopped after its tests."""
    try:
        plane = testcluster.start(tmp_path_factory.mktemp("helm-plane"), attached=True)
    except testcluster.ControlPlaneError as exc:
        pytest.fail(f"could not start a control plane for the Helm release: {exc}", pytrace=False)
    config = client.Configuration()
    config.host = plane.server
    config.ssl_ca_cert = str(plane.ca_file)
    config.api_key = {"authorization": plane.token}
    config.api_key_prefix = {"authorization": "Bearer"}
    api = client.ApiClient(config)
    yield Cluster(plane, api, tmp_path_factory.mktemp("helm-home"))
    api.close()
    pids = plane.stop()
    left = [pid for pid in pids if testcluster.pid_alive(pid)]
    assert not left, f"processes {left} of the Helm test's control plane survived it"


@pytest.fixture
def cluster(helm_plane: Cluster) -> Iterator[Cluster]:
    """The module's plane for one test; a release the test failed to uninstall goes after it,
    so that the next test can install again."""
    yield helm_plane
    helm_plane.helm(f"{UNINSTALL} --ignore-not-found")


@pytest.fixture
def operator_crds(cluster: Cluster, tmp_path: Path) -> Iterator[None]:
    """The Prometheus Operator's ServiceMonitor and PrometheusRule CRDs (kube_tools.py), removed
    after the test: the other tests here need a cluster without them."""
    install_crds(PROMETHEUS_OPERATOR_CRDS, cluster.kubectl, cluster.api, tmp_path)
    yield
    cluster.kubectl("delete", "crd", "--wait=true", *PROMETHEUS_OPERATOR_CRDS.names)


def readme_says(command: str) -> None:
    assert command in README.read_text(), f"the README no longer says `{command}`"


def uninstall_leaves_only_what_helm_keeps(cluster: Cluster, before: set[Key]) -> None:
    """The README's uninstall, then: the release's objects are gone, with its record (Helm's
    Secret), and the cluster holds what it held before, plus the CRD and the namespace."""
    release = cluster.release_objects()

    result = cluster.helm(UNINSTALL)

    assert 'release "edl-agent" uninstalled' in result.stdout
    assert f"[CustomResourceDefinition] {CRD[2]}" in result.stdout  # kept, and Helm says so
    wait_for(
        "nothing new in the cluster but what Helm keeps (last: all that is new)",
        lambda: cluster.everything() - before,
        lambda new: new <= KEPT,
        timeout=30,
    )
    after = cluster.everything()
    assert not before - after, "the uninstall removed something that was there before"
    assert (release - KEPT) & after == set()
    assert not any(k[0] == "Secret" and k[2].startswith("sh.helm.release.") for k in after)
    helm_list = cluster.helm("helm list -A -a -q").stdout
    assert "edl-agent" not in helm_list


def test_the_readmes_helm_install_upgrade_and_uninstall_on_a_cluster_without_prometheus(
    cluster: Cluster,
) -> None:
    for command in (INSTALL, UPGRADE, UNINSTALL):
        readme_says(command)
    before = cluster.everything()

    installed = cluster.helm(INSTALL)

    assert "STATUS: deployed" in installed.stdout
    assert "no ServiceMonitors and no PrometheusRule" in installed.stdout  # NOTES say why
    release = cluster.release_objects()
    # Everything of the chart, as `helm template` renders it for a cluster without the operator,
    # and nothing of the Prometheus Operator.
    assert release == {key(doc) for doc in rendered()}
    assert not release & MONITORING
    now = cluster.everything()
    assert release <= now
    assert ("Namespace", None, NAMESPACE) in now
    apps = client.AppsV1Api(cluster.api)
    assert apps.read_namespaced_deployment("edl-restarter", NAMESPACE).spec.replicas == 2

    upgraded = cluster.helm(
        UPGRADE, "--set", "restarter.replicas=3", "--set", "image.tag=0.2.0-test"
    )

    assert "REVISION: 2" in upgraded.stdout
    deployment = apps.read_namespaced_deployment("edl-restarter", NAMESPACE)
    assert deployment.spec.replicas == 3
    daemonset = apps.read_namespaced_daemon_set("edl-agent", NAMESPACE)
    for workload in (deployment, daemonset):
        (container,) = workload.spec.template.spec.containers
        assert container.image == "ghcr.io/edl-agent/edl-agent:0.2.0-test"
        assert workload.metadata.labels["app.kubernetes.io/version"] == "0.2.0-test"
    assert cluster.release_objects() == release

    uninstall_leaves_only_what_helm_keeps(cluster, before)


def test_a_cluster_with_the_prometheus_operators_crds_gets_the_monitoring_objects(
    cluster: Cluster, operator_crds: None
) -> None:
    before = cluster.everything()

    installed = cluster.helm(INSTALL)

    assert "the ServiceMonitors edl-agent and edl-restarter and the PrometheusRule" in (
        installed.stdout
    )
    release = cluster.release_objects()
    assert release == {key(doc) for doc in rendered(*WITH_PROMETHEUS_OPERATOR)}
    assert release >= MONITORING
    assert cluster.everything() >= MONITORING
    # What the API server stored is what the chart renders (the operator's schemas keep it all).
    rule = yaml.safe_load(
        cluster.kubectl("get", "-n", NAMESPACE, "prometheusrule/edl-agent", "-o", "yaml").stdout
    )
    (want,) = (doc for doc in rendered(*WITH_PROMETHEUS_OPERATOR) if key(doc) == PROMETHEUS_RULE)
    assert rule["spec"] == want["spec"]

    cluster.helm(UPGRADE, "--set", "serviceMonitor.enabled=false")

    now = cluster.everything()
    assert not now & SERVICE_MONITORS
    assert PROMETHEUS_RULE in now

    uninstall_leaves_only_what_helm_keeps(cluster, before)


def test_crds_installed_after_the_chart_bring_the_monitoring_objects_with_the_next_upgrade(
    cluster: Cluster, tmp_path: Path
) -> None:
    before = cluster.everything()
    cluster.helm(INSTALL)
    assert not cluster.release_objects() & MONITORING
    install_crds(PROMETHEUS_OPERATOR_CRDS, cluster.kubectl, cluster.api, tmp_path)
    before |= {("CustomResourceDefinition", None, name) for name in PROMETHEUS_OPERATOR_CRDS.names}
    try:
        cluster.helm(UPGRADE)

        assert cluster.release_objects() >= MONITORING
        assert cluster.everything() >= MONITORING
        uninstall_leaves_only_what_helm_keeps(cluster, before)
    finally:
        cluster.kubectl("delete", "crd", "--wait=true", *PROMETHEUS_OPERATOR_CRDS.names)
