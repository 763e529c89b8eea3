"""`edl-agent hosts` against the real API server, with KWOK nodes and pods in every state the
command must judge, through the credentials deploy/examples grants, and read by Horovod's own
host-discovery parser (`HostDiscoveryScript`, installed by tests/horovod_runner.py).

- The example manifests pass a server-side dry run.
- Of one job's pods only those Running and Ready, on a Ready untainted node with healthy
  accelerators, with no Unhealthy device, not being deleted, disrupted or replaced are printed,
  with their GPUs as slots; another job's pods are not.
- The example's ServiceAccount, Role and ClusterRole are enough; without the ClusterRole the
  command fails (exit 1, one line) unless told --skip-nodes.
- Horovod reads the example's script as we mean it: the hosts and slots; {} when none is fit; a
  RuntimeError when the API server cannot be asked.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from k8s_test_helpers import KwokCluster, wait_for
from kube_tools import Kubectl
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from manifests import dry_run_warnings

from edl_agent.faults.pod_faults import DISRUPTION_REASON
from edl_agent.labels.condition import CONDITION_TYPE
from edl_agent.restarter.core.replacement import REPLACES_UID_ANNOTATION
from tests import horovod_runner

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "examples" / "horovod-host-discovery.yaml"
EXAMPLE_SELECTOR = "app=resnet,role=worker"
BIN = Path(sys.executable).parent  # the venv's, with the `edl-agent` command
HOLD = "edl.io/test-hold"
MERGE = "application/merge-patch+json"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def hosts(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "edl-agent"), "hosts", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )


def kubeconfig(path: Path, server: str, ca_file: Path, token: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": server, "certificate-authority": str(ca_file)},
                    }
                ],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return path


def test_the_example_passes_a_server_side_dry_run(kubectl: Kubectl, k8s: KwokCluster) -> None:
    tried = kubectl("apply", "--dry-run=server", "-n", k8s.namespace, f"-f={EXAMPLE}")
    assert len([ln for ln in tried.stdout.splitlines() if "(server dry run)" in ln]) == len(
        documents()
    )
    assert not dry_run_warnings(tried.stderr), tried.stderr
    script = next(d for d in documents() if d["kind"] == "ConfigMap")["data"]["discover_hosts.sh"]
    assert f"edl-agent hosts --selector {EXAMPLE_SELECTOR}" in script


class Job:
    """One job's worker pods in every state, on nodes in every state."""

    def __init__(self, k8s: KwokCluster) -> None:
        self.k8s = k8s
        self.app = f"hosts-{secrets.token_hex(3)}"
        self.labels = {"app": self.app, "role": "worker"}
        self.selector = f"app={self.app},role=worker"
        self.held: list[str] = []

    def node(self, **kwargs: Any) -> str:
        return str(self.k8s.create_gpu_node(**kwargs).metadata.name)

    def pod(self, name: str, node: str, **kwargs: Any) -> Any:
        kwargs.setdefault("labels", self.labels)
        return self.k8s.create_pod(name, node=node, gpus=8, **kwargs)

    def patch_status(self, name: str, status: dict[str, Any]) -> None:
        self.k8s.core.patch_namespaced_pod_status(
            name, self.k8s.namespace, {"status": status}, _content_type=MERGE
        )

    def device_health(self, name: str, health: str) -> None:
        """kubelet's report (KEP-4680) of the pod's GPUs, as a ListAndWatch health gives it."""
        pod = self.k8s.read_pod(name)
        statuses = self.k8s.api.sanitize_for_serialization(pod.status.container_statuses)
        statuses[0]["allocatedResourcesStatus"] = [
            {
                "name": "nvidia.com/gpu",
                "resources": [{"resourceID": f"GPU-{i}", "health": health} for i in range(8)],
            }
        ]
        self.patch_status(name, {"containerStatuses": statuses})

    def hold_deleting(self, name: str) -> None:
        """Deleted, but kept by a finalizer: it shows its deletionTimestamp."""
        self.k8s.core.patch_namespaced_pod(
            name, self.k8s.namespace, {"metadata": {"finalizers": [HOLD]}}
        )
        self.held.append(name)
        self.k8s.core.delete_namespaced_pod(name, self.k8s.namespace)

    def release(self) -> None:
        for name in self.held:
            try:
                self.k8s.core.patch_namespaced_pod(
                    name, self.k8s.namespace, {"metadata": {"finalizers": None}}
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise


def ip(pod: Any) -> str:
    return str(pod.status.pod_ip)


def test_hosts_of_a_job_through_the_examples_credentials_and_horovods_parser(
    k8s: KwokCluster, kubectl: Kubectl, k8s_control_plane: Any, tmp_path: Path
) -> None:
    job = Job(k8s)
    good, down, tainted, sick, gone = (job.node() for _ in range(5))
    try:
        a = job.pod("w-0", good)
        healthy_on_sick = job.pod("w-1", sick)
        job.device_health("w-1", "Healthy")
        job.pod("w-2", good)
        job.device_health("w-2", "Unhealthy")
        job.pod("w-3", down)
        job.pod("w-4", tainted)
        job.pod("w-5", sick)
        job.pod("w-6", gone)
        job.pod("w-7", good)
        job.patch_status("w-7", {"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "DisruptionTarget", "status": "True", "reason": DISRUPTION_REASON},
        ]})  # fmt: skip
        job.pod("w-8", good)
        job.hold_deleting("w-8")
        replaced = job.pod("w-9", good)
        replacement = job.pod(
            "w-9-r1", good, annotations={REPLACES_UID_ANNOTATION: replaced.metadata.uid}
        )
        job.pod("w-10", good, wait_running=False)  # Running by the time it is read
        job.k8s.create_pod("other-0", node=good, gpus=8, labels={"app": "other", "role": "worker"})
        k8s.make_node_not_ready(down)
        k8s.core.patch_node(tainted, {"spec": {"taints": [
            {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]}})  # fmt: skip
        k8s.core.patch_node_status(sick, {"status": {"conditions": [
            {"type": CONDITION_TYPE, "status": "False", "reason": "XID79",
             "message": "1 of 8 accelerators unhealthy"}]}})  # fmt: skip
        k8s.core.delete_node(gone)
        w10 = k8s.wait_pod_phase("w-10", "Running")
        expected = sorted([f"{ip(a)}:8", f"{ip(healthy_on_sick)}:8", f"{ip(replacement)}:8",
                           f"{ip(w10)}:8"])  # fmt: skip

        admin = ("--namespace", k8s.namespace, "--kubeconfig", str(k8s_control_plane.kubeconfig))
        done = hosts("--selector", job.selector, *admin, "--explain")
        assert done.returncode == 0, done.stderr
        assert sorted(done.stdout.splitlines()) == expected, done.stderr
        left_out = {line.split(": ", 2)[1].split("/")[1]: line.split(": ", 2)[2]
                    for line in done.stderr.splitlines()}  # fmt: skip
        assert left_out == {
            "w-2": "device unhealthy: " + ", ".join(f"GPU-{i} (nvidia.com/gpu)" for i in range(8)),
            "w-3": f"node {down} Ready=False",
            "w-4": f"node {tainted} tainted node.kubernetes.io/unreachable",
            "w-5": f"node {sick} {CONDITION_TYPE}=False (XID79) and kubelet reports no device "
            "health for the pod",
            "w-6": f"node {gone} is gone",
            "w-7": f"DisruptionTarget ({DISRUPTION_REASON})",
            "w-8": "being deleted",
            "w-9": "being replaced by w-9-r1",
        }
        fixed = hosts("--selector", job.selector, *admin, "--slots", "2", "--skip-nodes")
        assert fixed.returncode == 0, fixed.stderr
        assert len(fixed.stdout.splitlines()) == 8  # and w-3..w-6: Ready as far as pods say
        assert all(line.endswith(":2") for line in fixed.stdout.splitlines())
        bad = hosts("--selector", "app in (", *admin)
        assert bad.returncode == 2
        assert bad.stderr.startswith("edl-agent: error: --selector: HTTP 400")

        # --- the example's credentials ----------------------------------------------------
        binding = f"edl-hosts-test-{secrets.token_hex(3)}"
        docs = documents()
        for doc in docs:
            if doc["kind"] == "ClusterRoleBinding":
                doc["metadata"]["name"] = binding
                doc["subjects"][0]["namespace"] = k8s.namespace
        manifest = tmp_path / "example.yaml"
        manifest.write_text(yaml.safe_dump_all(d for d in docs if d["kind"] != "Job"))
        kubectl("apply", "-n", k8s.namespace, f"-f={manifest}")
        try:
            token = k8s.mint_token("resnet-launcher")
            config = kubeconfig(tmp_path / "launcher.kubeconfig", k8s_control_plane.server,
                                k8s_control_plane.ca_file, token)  # fmt: skip
            launcher = ("--namespace", k8s.namespace, "--kubeconfig", str(config))
            done = wait_for(
                "the launcher's RBAC to take effect",
                lambda: hosts("--selector", job.selector, *launcher),
                lambda d: d.returncode == 0,
            )
            assert sorted(done.stdout.splitlines()) == expected

            # --- Horovod's own parser on the example's script ----------------------------
            script_text = next(d for d in docs if d["kind"] == "ConfigMap")["data"][
                "discover_hosts.sh"
            ]
            script = tmp_path / "discover_hosts.sh"
            script.write_text(script_text.replace(EXAMPLE_SELECTOR, job.selector))

            def wrapper(name: str, *flags: str) -> Path:
                path = tmp_path / name
                path.write_text(
                    f'#!/bin/sh\nPATH="{BIN}:$PATH" exec sh {script} {" ".join(flags)}\n'
                )
                path.chmod(0o755)
                return path

            found = horovod_runner.discover(wrapper("job.sh", *launcher), default_slots=1)
            assert found == {"hosts": {line.split(":")[0]: 8 for line in expected}}
            script.write_text(script_text.replace(EXAMPLE_SELECTOR, "app=nothing-here"))
            empty = horovod_runner.discover(wrapper("none.sh", *launcher))
            assert empty == {"hosts": {}}
            unreachable = tmp_path / "unreachable.kubeconfig"
            kubeconfig(unreachable, "https://127.0.0.1:9", k8s_control_plane.ca_file, token)
            failed = horovod_runner.discover(
                wrapper("down.sh", "--namespace", k8s.namespace, "--kubeconfig", str(unreachable))
            )
            assert str(failed.get("error", "")).startswith(
                "RuntimeError: Failed to execute discovery script"
            )

            # --- without the ClusterRole's binding: only pods ----------------------------
            client.RbacAuthorizationV1Api(k8s.api).delete_cluster_role_binding(binding)
            refused = wait_for(
                "the binding's removal to take effect",
                lambda: hosts("--selector", job.selector, *launcher),
                lambda d: d.returncode != 0,
            )
            assert refused.returncode == 1
            assert refused.stdout == ""
            assert refused.stderr.count("\n") == 1
            assert "HTTP 403" in refused.stderr
            assert "get nodes unless --skip-nodes" in refused.stderr
            skipped = hosts("--selector", job.selector, *launcher, "--skip-nodes")
            assert skipped.returncode == 0, skipped.stderr
            assert len(skipped.stdout.splitlines()) == 8
        finally:
            try:
                client.RbacAuthorizationV1Api(k8s.api).delete_cluster_role_binding(binding)
            except ApiException as exc:
                if exc.status != 404:
                    raise
    finally:
        job.release()
