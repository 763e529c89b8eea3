"""kubectl and helm for cluster tests, and other projects' CRDs on the test control plane.

The CRDs come from each project's Go module at a pinned version, through the Go module proxy
(`go mod download`), and are cached in .cache/<project>/<version>/:

- the Prometheus Operator's ServiceMonitor and PrometheusRule (deploy/daemonset, the chart);
- cert-manager's Issuer and Certificate (deploy/cert-manager, the chart's intakeTLS.certManager).

A server-side dry run of a ServiceMonitor or a Certificate needs its kind to exist. Installed for
real, their schemas (and the CEL rules in them) check our objects as the API server of a cluster
running those projects does; the projects' own admission webhooks do not run here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import k8sbinaries
import pytest
from k8s_test_helpers import wait_for
from kubernetes import client

REPO = Path(__file__).resolve().parents[2]
CRD_FIELD_MANAGER = "edl-test-crds"

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def kubectl_binary() -> Path:
    path = k8sbinaries.find("kubectl")
    if path is None:
        pytest.fail(
            f"kubectl {k8sbinaries.K8S_VERSION} is not in {k8sbinaries.bin_dir()}: run "
            "scripts/k8s-binaries (or put it in $KUBEBUILDER_ASSETS)",
            pytrace=False,
        )
    return path


def helm_binary() -> Path:
    path = k8sbinaries.find(k8sbinaries.HELM)
    if path is None:
        pytest.fail(
            f"helm {k8sbinaries.HELM_VERSION} is not in {k8sbinaries.bin_dir()}: run "
            "scripts/k8s-binaries (or `scripts/k8s-binaries helm` for helm alone, ~1.5 min)",
            pytrace=False,
        )
    return path


@dataclass(frozen=True)
class ModuleCrds:
    """CRD files in a directory of a Go module, at a pinned version."""

    module: str
    version: str
    directory: str
    files: tuple[str, ...]
    names: tuple[str, ...]
    """The CRDs' names (plural.group), waited for until Established."""

    @property
    def cache(self) -> Path:
        return REPO / ".cache" / self.module.rsplit("/", 1)[-1] / self.version


PROMETHEUS_OPERATOR_CRDS = ModuleCrds(
    module="github.com/prometheus-operator/prometheus-operator",
    version="v0.85.0",
    directory="example/prometheus-operator-crd",
    files=(
        "monitoring.coreos.com_servicemonitors.yaml",
        "monitoring.coreos.com_prometheusrules.yaml",
    ),
    names=("servicemonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com"),
)
# deploy/crds holds the controller-gen output the release's chart and static manifests are
# made from (the chart's copies wrap the same schemas in Helm templating).
CERT_MANAGER_CRDS = ModuleCrds(
    module="github.com/cert-manager/cert-manager",
    version="v1.21.2",
    directory="deploy/crds",
    files=("cert-manager.io_issuers.yaml", "cert-manager.io_certificates.yaml"),
    names=("issuers.cert-manager.io", "certificates.cert-manager.io"),
)


def crd_files(source: ModuleCrds, workdir: Path) -> list[Path]:
    """The CRD files of ``source``, from the cache, else from its module (then cached)."""
    files = [source.cache / name for name in source.files]
    if all(path.is_file() for path in files):
        return files
    module = f"{source.module}@{source.version}"
    go = shutil.which("go")
    if go is None:
        pytest.fail(
            f"the Go toolchain is needed once to fetch the CRDs of {module} into {source.cache}",
            pytrace=False,
        )
    result = subprocess.run(
        [go, "mod", "download", "-json", module],
        cwd=workdir,  # outside any module: nothing to resolve against
        env={**os.environ, "GO111MODULE": "on", "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    try:
        directory = Path(json.loads(result.stdout)["Dir"]) / source.directory
    except (ValueError, KeyError):
        pytest.fail(f"go mod download {module} failed: {result.stderr or result.stdout}")
    source.cache.mkdir(parents=True, exist_ok=True)
    for path in files:
        partial = path.with_suffix(".partial")
        shutil.copyfile(directory / path.name, partial)
        partial.replace(path)
    return files


def install_crds(
    source: ModuleCrds, kubectl: Kubectl, api_client: client.ApiClient, workdir: Path
) -> None:
    """Apply ``source``'s CRDs for real and wait until they are Established. Server-side apply:
    these CRDs are too big for kubectl's last-applied annotation."""
    args = [arg for path in crd_files(source, workdir) for arg in ("-f", str(path))]
    kubectl(
        "apply", "--server-side", "--force-conflicts", f"--field-manager={CRD_FIELD_MANAGER}", *args
    )
    extensions = client.ApiextensionsV1Api(api_client)
    for name in source.names:
        wait_established(extensions, name)


def wait_established(extensions: client.ApiextensionsV1Api, name: str) -> None:
    wait_for(
        f"CRD {name} Established",
        lambda: extensions.read_custom_resource_definition(name),
        lambda crd: any(
            c.type == "Established" and c.status == "True"
            for c in (crd.status and crd.status.conditions) or []
        ),
        timeout=30,
    )
