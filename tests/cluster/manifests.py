"""deploy/ as the tools render it (`kubectl kustomize`, `helm template`), keyed by kind, namespace
and name, and normalized for comparing a rendering with another."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_tools import helm_binary, kubectl_binary

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "daemonset"
CERT_MANAGER = REPO / "deploy" / "cert-manager"
CHART = REPO / "deploy" / "helm" / "edl-agent"
NAMESPACE = "edl-system"
RELEASE = "edl-agent"
# What Helm's conventions add to every object's labels, beyond deploy/daemonset's.
HELM_LABELS = frozenset(
    {
        "helm.sh/chart",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/version",
    }
)
KEEP = "helm.sh/resource-policy"
# `helm template` arguments for a cluster that serves the Prometheus Operator's kinds: the chart
# renders its ServiceMonitors and PrometheusRule only there (`helm install` asks the API server).
WITH_PROMETHEUS_OPERATOR = (
    "--api-versions",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
)

Key = tuple[str, str | None, str]
Doc = dict[str, Any]


def parsed(text: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def kustomized(directory: Path) -> list[Doc]:
    """`kubectl kustomize DIRECTORY`, read without a cluster."""
    result = subprocess.run(
        [str(kubectl_binary()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return parsed(result.stdout)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, check=False, timeout=60
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def rendered(*args: str, namespace: str = NAMESPACE) -> list[Doc]:
    """`helm template edl-agent deploy/helm/edl-agent --namespace NAMESPACE ARGS`, parsed."""
    return parsed(helm("template", RELEASE, str(CHART), "--namespace", namespace, *args).stdout)


def key(doc: Doc) -> Key:
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]


def by_key(docs: list[Doc]) -> dict[Key, Doc]:
    keyed = {key(doc): doc for doc in docs}
    assert len(keyed) == len(docs), "two objects of the same kind, namespace and name"
    return keyed


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_spec(docs: list[Doc], kind: str, name: str) -> Doc:
    spec: Doc = find(docs, kind, name)["spec"]["template"]["spec"]
    return spec


def kubectl_name(doc: Doc) -> str:
    """How kubectl names an object in its output: `daemonset.apps/edl-agent`, `service/x`."""
    group = doc["apiVersion"].rpartition("/")[0]
    return f"{doc['kind'].lower()}{'.' + group if group else ''}/{doc['metadata']['name']}"


def as_kustomized(doc: Doc) -> Doc:
    """A rendered chart object as the kustomization has it: without Helm's labels and the CRD's
    keep policy, and with CEL's whitespace collapsed (see cel_spaced)."""
    bare = copy.deepcopy(doc)
    meta = bare["metadata"]
    meta["labels"] = {k: v for k, v in meta.get("labels", {}).items() if k not in HELM_LABELS}
    annotations = {k: v for k, v in meta.pop("annotations", {}).items() if k != KEEP}
    if annotations:
        meta["annotations"] = annotations
    result: Doc = cel_spaced(bare)
    return result


def cel_spaced(value: Any) -> Any:
    """``value`` with the whitespace of every CEL `expression` collapsed. kustomize reads a
    folded (>-) scalar with more-indented lines with an extra line break; CEL ignores it."""
    if isinstance(value, dict):
        return {
            k: " ".join(v.split()) if k == "expression" and isinstance(v, str) else cel_spaced(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [cel_spaced(v) for v in value]
    return value


def dry_run_warnings(stderr: str) -> list[str]:
    """kubectl's warnings on a dry run: a deprecated API, Pod Security, an unknown field. (An
    object that other tests or a real apply made without kubectl's client-side apply draws a
    note about its last-applied annotation that is no fault of ours.)"""
    return [
        line
        for line in stderr.splitlines()
        if "Warning" in line and "last-applied-configuration annotation" not in line
    ]


def delete_workloads(kubectl: Any) -> None:
    """Removes the DaemonSet and the Deployment a test applied (a controller-manager started by a
    later test would run them); the namespace, RBAC, admission policy and CRD stay: other tests
    share them."""
    kubectl(
        "delete",
        "-n",
        NAMESPACE,
        "--ignore-not-found",
        "--wait=false",
        "daemonset/edl-agent",
        "deployment/edl-restarter",
    )
