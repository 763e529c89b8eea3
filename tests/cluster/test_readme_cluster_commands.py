"""The README's commands that need a cluster (its `<!-- cluster -->` blocks), on the test control
plane: the label clean-up after an uninstall is run as written, and every `kubectl apply` of this
repository's manifests is tried as `kubectl create --dry-run=client -o name` with the same
arguments: kubectl builds the kustomizations and maps every kind through the API server's
discovery, so a file that does not parse or a kind the cluster does not serve (with the
FaultTolerancePolicy and Prometheus Operator CRDs installed) fails. (`apply --dry-run=client`
would compute patches against what other tests left on the shared control plane.)

Not run here: what needs agents and restarters running in pods from a built image (Verify's
`get pods`, `port-forward`, `curl`, `rollout status`, `kubectl logs`), docker, and `helm install`
with `--set image.repository` (tests/cluster/test_helm_release.py runs the README's plain
`helm install`, `helm upgrade` and `helm uninstall`)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testcluster
from kube_tools import Kubectl, kubectl_binary
from kubernetes import client
from test_restarter import install_policy_crd

from tests.readme_blocks import README, Block, command_blocks

pytestmark = pytest.mark.cluster

REPO = README.parent
APPLY = re.compile(r"^kubectl apply (?P<args>(?:-n \S+ )?-[fk] (?P<path>(?:deploy)/\S+))$", re.M)
OWNED = ("edl.io/nvidia.count", "nvidia.com/gpu.product")


def cluster_blocks() -> list[Block]:
    return command_blocks("cluster")


def applies() -> list[str]:
    """Every `kubectl apply` of a manifest of this repository in the cluster blocks."""
    return sorted({m.group("args") for b in cluster_blocks() for m in APPLY.finditer(b.body)})


def test_the_readme_applies_the_manifests_it_describes() -> None:
    """The extraction finds the quick start's manifests (else the dry runs below test nothing)."""
    found = " ".join(applies())
    for path in ("deploy/daemonset", "deploy/examples/gpu-pod.yaml"):
        assert path in found


@pytest.fixture
def policy_crd(k8s_api_client: client.ApiClient) -> Any:
    return install_policy_crd(k8s_api_client)


@pytest.mark.parametrize("args", applies())
def test_each_kubectl_apply_builds_and_maps_every_kind(
    args: str, kubectl: Kubectl, policy_crd: Any, monitoring_crds: None
) -> None:
    made = kubectl("create", "--dry-run=client", "-o", "name", *args.split()).stdout.split()
    assert made, args


@pytest.fixture
def labelled_node(k8s_api_client: client.ApiClient) -> Iterator[str]:
    """A Node as an agent leaves it: its labels and the annotation that lists them, beside a
    label of someone else's."""
    core = client.CoreV1Api(k8s_api_client)
    name = "readme-uninstall-node"
    labels = dict.fromkeys(OWNED, "8") | {"example.com/team": "ml"}
    core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name,
                labels=labels,
                annotations={"edl.io/owned-labels": ",".join(OWNED)},
            )
        )
    )
    yield name
    core.delete_node(name)


def test_the_label_clean_up_removes_the_agents_labels_only(
    labelled_node: str,
    k8s_control_plane: testcluster.ControlPlane,
    k8s_api_client: client.ApiClient,
    tmp_path: Path,
) -> None:
    [block] = [b for b in cluster_blocks() if "owned-labels" in b.body]
    env = {
        "PATH": f"{kubectl_binary().parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(k8s_control_plane.kubeconfig),
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.commands()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    node = client.CoreV1Api(k8s_api_client).read_node(labelled_node)
    assert not set(OWNED) & set(node.metadata.labels)
    assert node.metadata.labels["example.com/team"] == "ml"
    assert "edl.io/owned-labels" not in (node.metadata.annotations or {})
