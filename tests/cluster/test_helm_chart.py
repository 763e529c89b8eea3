"""deploy/helm/edl-agent, the Helm chart, against deploy/daemonset and the real API server.

- `helm lint --strict` passes, with the defaults and with every option on (ci/all-on-values.yaml).
- With the defaults, `helm template -n edl-system` for a cluster that serves the Prometheus
  Operator's kinds (--api-versions) renders the objects of `kubectl kustomize deploy/daemonset`:
  the same kinds, namespaces and names, the same RBAC rules, container flags and ports; object for
  object the same, but for Helm's labels (and the Namespace, which Helm leaves to
  `--create-namespace` unless namespace.create is set).
- The ServiceMonitors and the PrometheusRule follow the cluster by default (`auto`): each only
  where its kind is served; `true` renders them regardless, `false` never.
- Those objects pass a server-side apply; every option on passes a server-side dry run (its
  privileged DaemonSet must not replace the one test_deploy.py shares), and each value lands
  where it should (read back through the agent's and the restarter's own flag parsers).
- Another release namespace leaves no trace of edl-system; the schema refuses typos and the
  reserved `dra` block.

test_helm_release.py installs, upgrades and uninstalls the chart with helm itself.

helm is built by scripts/k8s-binaries (helm.sh/helm/v3 from the Go module proxy, into
.cache/k8s/). The objects shared with test_deploy.py (namespace, CRD, RBAC, admission policy) are
applied as it applies them, server-side with --force-conflicts, and left in place; the
workloads are deleted afterwards.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_tools import Kubectl
from manifests import (
    CHART,
    DEPLOY,
    HELM_LABELS,
    KEEP,
    NAMESPACE,
    RELEASE,
    WITH_PROMETHEUS_OPERATOR,
    Key,
    as_kustomized,
    by_key,
    cel_spaced,
    delete_workloads,
    find,
    helm,
    key,
    kubectl_name,
    kustomized,
    parsed,
    pod_spec,
    rendered,
)

from edl_agent import log
from edl_agent.cli.command import build_parser
from edl_agent.cli.settings import settings_from_args
from edl_agent.config import Settings
from edl_agent.devices.model import PCI_VENDORS
from edl_agent.restarter import cli as restarter_cli

ALL_ON = CHART / "ci" / "all-on-values.yaml"
FIELD_MANAGER = "edl-test-helm"
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
MONITORING = frozenset(
    {
        ("ServiceMonitor", NAMESPACE, "edl-agent"),
        ("ServiceMonitor", NAMESPACE, "edl-restarter"),
        ("PrometheusRule", NAMESPACE, "edl-agent"),
    }
)


def apply_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.strip()]


# --- lint and the schema ------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["--values", str(ALL_ON)]], ids=["defaults", "all-on"])
def test_helm_lint_passes(values: list[str]) -> None:
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values, check=False)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout
    assert "[ERROR]" not in result.stdout


@pytest.mark.parametrize(
    ("setting", "refusal"),
    [
        ("dra.enabled=true", "/dra/enabled"),
        ("agent.nodeselector.zone=a", "'nodeselector' not allowed"),
        ("restarter.replicas=0", "/restarter/replicas"),
        ("intakeTLS.certManager.issuerRef.name=my-ca", "missing property 'kind'"),
        ("serviceMonitor.interval=30", "/serviceMonitor/interval"),
        ("prometheusRule.enabled=yes", "/prometheusRule/enabled"),
    ],
)
def test_the_schema_refuses_what_the_chart_cannot_honour(setting: str, refusal: str) -> None:
    result = helm("template", RELEASE, str(CHART), "--set", setting, check=False)

    assert result.returncode != 0
    assert refusal in result.stderr


# --- the defaults are deploy/daemonset -----------------------------------------------------


def test_the_defaults_render_the_kustomizations_kinds_namespaces_and_names() -> None:
    kustomize = {key(doc) for doc in kustomized(DEPLOY)}

    chart = {key(doc) for doc in rendered(*WITH_PROMETHEUS_OPERATOR)}
    with_namespace = {
        key(doc) for doc in rendered(*WITH_PROMETHEUS_OPERATOR, "--set", "namespace.create=true")
    }
    without_operator = {key(doc) for doc in rendered()}

    # Helm makes the release namespace itself (--create-namespace) and refuses a chart that
    # renders it again; namespace.create renders it for tools that apply rendered manifests.
    assert kustomize - chart == {("Namespace", None, NAMESPACE)}
    assert chart <= kustomize
    assert with_namespace == kustomize
    assert chart - without_operator == MONITORING
    assert without_operator <= chart


def test_every_object_is_the_kustomizations_but_for_helms_labels() -> None:
    kustomize = by_key(kustomized(DEPLOY))
    chart = by_key(rendered(*WITH_PROMETHEUS_OPERATOR, "--set", "namespace.create=true"))

    assert chart.keys() == kustomize.keys()
    for name in sorted(kustomize, key=str):
        assert as_kustomized(chart[name]) == cel_spaced(kustomize[name]), name


def test_the_volcano_option_is_deploy_volcanos() -> None:
    """vendors.ascend.volcanoDeviceInfo renders what deploy/volcano adds to deploy/daemonset."""
    kustomize = by_key(kustomized(DEPLOY.parent / "volcano"))
    chart = by_key(
        rendered(
            *WITH_PROMETHEUS_OPERATOR,
            "--set",
            "namespace.create=true",
            "--set",
            "vendors.ascend.volcanoDeviceInfo=true",
        )
    )

    assert chart.keys() == kustomize.keys()
    assert chart.keys() - by_key(kustomized(DEPLOY)).keys() == {
        ("Role", "kube-system", "edl-agent-volcano-device-info"),
        ("RoleBinding", "kube-system", "edl-agent-volcano-device-info"),
        ("ValidatingAdmissionPolicy", None, "edl-agent-volcano-device-info"),
        ("ValidatingAdmissionPolicyBinding", None, "edl-agent-volcano-device-info"),
    }
    for name in sorted(kustomize, key=str):
        assert as_kustomized(chart[name]) == cel_spaced(kustomize[name]), name


def node_terms(pod: dict[str, Any]) -> list[str]:
    """The label keys of the pod's required node-affinity terms (each `KEY In [true]`)."""
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = []
    for term in required["nodeSelectorTerms"]:
        (expression,) = term["matchExpressions"]
        assert (expression["operator"], expression["values"]) == ("In", ["true"])
        keys.append(expression["key"])
    return keys


def test_the_agent_runs_only_where_a_label_says_accelerators_are() -> None:
    kustomize = node_terms(pod_spec(kustomized(DEPLOY), "DaemonSet", "edl-agent"))
    chart = node_terms(pod_spec(rendered(), "DaemonSet", "edl-agent"))
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    assert chart == kustomize == values["agent"]["acceleratorNodeLabels"]
    assert {"nvidia.com/gpu.present", "edl.io/accelerator.present"} <= set(chart)
    nfd = "feature.node.kubernetes.io/pci-"
    for vendor, pci_id in PCI_VENDORS.items():
        assert any(k.startswith(nfd) and pci_id in k for k in chart), vendor
    # Huawei's BMC graphics and network cards share Ascend's id: its processing accelerators only.
    assert [k for k in chart if "19e5" in k] == [f"{nfd}1200_19e5.present"]


def test_the_accelerator_node_labels_can_be_changed_or_turned_off() -> None:
    def agent_pod(*args: str) -> dict[str, Any]:
        return pod_spec(rendered(*args), "DaemonSet", "edl-agent")

    assert "affinity" not in agent_pod("--set-json", "agent.acceleratorNodeLabels=[]")
    assert node_terms(agent_pod("--set-json", 'agent.acceleratorNodeLabels=["pool/gpu"]')) == [
        "pool/gpu"
    ]
    # Other affinities are kept beside it; a nodeAffinity of one's own replaces it.
    anti = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}
    both = agent_pod("--set-json", f"agent.affinity={json.dumps(anti)}")
    assert both["affinity"]["podAntiAffinity"] == anti["podAntiAffinity"]
    assert len(node_terms(both)) > 1
    own = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "mine", "operator": "In", "values": ["true"]}]}
                ]
            }
        }
    }
    assert agent_pod("--set-json", f"agent.affinity={json.dumps(own)}")["affinity"] == own


def test_the_rbac_rules_are_the_kustomizations() -> None:
    kustomize = kustomized(DEPLOY)
    chart = rendered()

    for kind in ("ClusterRole", "Role"):
        roles = {key(doc): doc["rules"] for doc in kustomize if doc["kind"] == kind}
        assert roles, kind
        assert {key(doc): doc["rules"] for doc in chart if doc["kind"] == kind} == roles
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        bindings = {
            key(doc): (doc["roleRef"], doc["subjects"]) for doc in kustomize if doc["kind"] == kind
        }
        assert bindings, kind
        assert {
            key(doc): (doc["roleRef"], doc["subjects"]) for doc in chart if doc["kind"] == kind
        } == bindings
    for name in ("edl-agent-own-node", "edl-agent-own-resourceslices"):
        policies = [find(docs, "ValidatingAdmissionPolicy", name) for docs in (chart, kustomize)]
        assert cel_spaced(policies[0]["spec"]) == cel_spaced(policies[1]["spec"]), name


@pytest.mark.parametrize(
    ("kind", "name"), [("DaemonSet", "edl-agent"), ("Deployment", "edl-restarter")]
)
def test_the_containers_flags_ports_and_mounts_are_the_kustomizations(kind: str, name: str) -> None:
    kustomize = pod_spec(kustomized(DEPLOY), kind, name)
    chart = pod_spec(rendered(), kind, name)

    ((want,), (got,)) = kustomize["containers"], chart["containers"]
    for field in ("image", "command", "args", "ports", "env", "volumeMounts", "securityContext"):
        assert got[field] == want[field], field
    assert chart["volumes"] == kustomize["volumes"]
    for field in ("serviceAccountName", "priorityClassName", "tolerations", "securityContext"):
        assert chart.get(field) == kustomize.get(field), field


def test_the_services_and_monitors_are_the_kustomizations() -> None:
    kustomize = kustomized(DEPLOY)
    chart = rendered(*WITH_PROMETHEUS_OPERATOR)

    for kind in ("Service", "ServiceMonitor", "PrometheusRule"):
        specs = {key(doc): doc["spec"] for doc in kustomize if doc["kind"] == kind}
        assert specs, kind
        assert {key(doc): doc["spec"] for doc in chart if doc["kind"] == kind} == specs


def test_the_charts_copies_of_the_crd_and_the_rules_are_deploy_daemonsets() -> None:
    for name in ("crd-faulttolerancepolicy.yaml", "prometheus-rules.yaml"):
        copied = (CHART / "files" / name).read_text()
        assert copied == (DEPLOY / name).read_text(), f"copy deploy/daemonset/{name} to files/"


def test_every_object_carries_helms_labels_and_pods_only_their_selectors() -> None:
    docs = rendered("--values", str(ALL_ON))

    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", key(doc)
        assert labels["app.kubernetes.io/instance"] == RELEASE, key(doc)
        assert labels["app.kubernetes.io/part-of"] == "edl-agent", key(doc)
    # A chart upgrade that changes nothing in the pods must restart none.
    for kind, name in (("DaemonSet", "edl-agent"), ("Deployment", "edl-restarter")):
        template = find(docs, kind, name)["spec"]["template"]["metadata"]["labels"]
        assert not HELM_LABELS & template.keys()


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "monitoring"),
    [
        ((), set()),
        (WITH_PROMETHEUS_OPERATOR, MONITORING),
        (
            ("--api-versions", SERVICE_MONITOR_API),
            {key for key in MONITORING if key[0] == "ServiceMonitor"},
        ),
        (
            ("--api-versions", PROMETHEUS_RULE_API),
            {("PrometheusRule", NAMESPACE, "edl-agent")},
        ),
        (("--set", "serviceMonitor.enabled=true,prometheusRule.enabled=true"), MONITORING),
        (
            (*WITH_PROMETHEUS_OPERATOR, "--set", "serviceMonitor.enabled=false"),
            {("PrometheusRule", NAMESPACE, "edl-agent")},
        ),
        (
            (*WITH_PROMETHEUS_OPERATOR, "--set", "prometheusRule.enabled=false"),
            {key for key in MONITORING if key[0] == "ServiceMonitor"},
        ),
        (("--set", "serviceMonitor.enabled=auto,prometheusRule.enabled=auto"), set()),
    ],
    ids=[
        "no-operator",
        "operator",
        "servicemonitor-kind-only",
        "prometheusrule-kind-only",
        "forced-on",
        "servicemonitors-off",
        "rule-off",
        "auto-named",
    ],
)
def test_monitoring_objects_follow_the_cluster_unless_set(
    args: tuple[str, ...], monitoring: set[Key]
) -> None:
    """`auto` (the default) renders each Prometheus Operator object where the cluster serves its
    kind: `helm install` asks the API server, `helm template` takes --api-versions. true and
    false decide alone; nothing else of the chart changes."""
    everything_else = {key(doc) for doc in rendered()}

    docs = {key(doc) for doc in rendered(*args)}

    assert docs - everything_else == monitoring
    assert everything_else <= docs


def test_another_namespace_leaves_no_trace_of_edl_system() -> None:
    text = helm(
        "template", RELEASE, str(CHART), "--namespace", "ml-infra", *WITH_PROMETHEUS_OPERATOR
    ).stdout
    docs = parsed(text)

    assert NAMESPACE not in text
    assert ("PrometheusRule", "ml-infra", "edl-agent") in {key(doc) for doc in docs}
    namespaces = {doc["metadata"].get("namespace") for doc in docs}
    assert namespaces == {None, "ml-infra", "default"}
    assert {key(doc) for doc in docs if doc["metadata"].get("namespace") == "default"} == {
        ("Role", "default", "edl-agent-events"),
        ("RoleBinding", "default", "edl-agent-events"),
    }
    (agent,) = pod_spec(docs, "DaemonSet", "edl-agent")["containers"]
    assert "--restarter-address=edl-restarter.ml-infra.svc:8443" in agent["args"]
    (restarter,) = pod_spec(docs, "Deployment", "edl-restarter")["containers"]
    assert "--agent-service-account=ml-infra/edl-agent" in restarter["args"]
    policy = find(docs, "ValidatingAdmissionPolicy", "edl-agent-own-node")
    (condition,) = policy["spec"]["matchConditions"]
    assert "'system:serviceaccount:ml-infra:edl-agent'" in condition["expression"]
    subjects = [s for d in docs if d["kind"].endswith("Binding") for s in d.get("subjects", [])]
    assert subjects
    assert {s["namespace"] for s in subjects} == {"ml-infra"}


def test_every_option_lands_where_it_should(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = yaml.safe_load(ALL_ON.read_text())
    docs = rendered("--values", str(ALL_ON))
    agent_pod = pod_spec(docs, "DaemonSet", "edl-agent")
    (agent,) = agent_pod["containers"]
    restarter_pod = pod_spec(docs, "Deployment", "edl-restarter")
    (restarter,) = restarter_pod["containers"]

    image = f"{values['image']['repository']}:{values['image']['tag']}"
    for pod, container in ((agent_pod, agent), (restarter_pod, restarter)):
        assert container["image"] == image
        assert container["imagePullPolicy"] == values["image"]["pullPolicy"]
        assert pod["imagePullSecrets"] == values["imagePullSecrets"]
    namespace = find(docs, "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert KEEP not in find(docs, "CustomResourceDefinition", "faulttolerancepolicies.edl.io")[
        "metadata"
    ].get("annotations", {})

    # The agent: privileged, where it was asked to run, its vendors as its own settings read them.
    assert agent["securityContext"]["privileged"] is True
    assert agent["securityContext"]["allowPrivilegeEscalation"] is True
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert agent_pod["nodeSelector"] == values["agent"]["nodeSelector"]
    assert agent_pod["affinity"] == values["agent"]["affinity"]
    assert agent["resources"] == values["agent"]["resources"]
    taints = [k for vendor in values["vendors"].values() for k in vendor["taintKeys"]]
    assert agent_pod["tolerations"] == [
        *({"key": k, "operator": "Exists"} for k in taints),
        *values["agent"]["tolerations"],
    ]
    args = build_parser().parse_args(agent["args"])  # exits 2 on an unknown flag
    env = {e["name"]: e.get("value", "") for e in agent["env"]}
    env["NODE_NAME"] = "gpu-node-1"
    monkeypatch.setattr(log, "configure", lambda *_args, **_kw: None)
    settings: Settings = settings_from_args(args, environ=env)
    assert settings.log_level == "debug"  # agent.extraArgs
    assert settings.nvidia.mig_strategy == "mixed"  # agent.extraEnv
    enabled = {
        "nvidia": settings.nvidia.enabled,
        "ascend": settings.ascend.enabled,
        "kunlunxin": settings.kunlunxin.enabled,
        "hygon": settings.hygon.enabled,
    }
    assert enabled == {name: v["enabled"] for name, v in values["vendors"].items()}

    # The restarter.
    deployment = find(docs, "Deployment", "edl-restarter")
    assert deployment["spec"]["replicas"] == values["restarter"]["replicas"]
    assert restarter["resources"] == values["restarter"]["resources"]
    assert restarter_pod["nodeSelector"] == values["restarter"]["nodeSelector"]
    assert restarter_pod["tolerations"] == values["restarter"]["tolerations"]
    assert "affinity" not in restarter_pod
    parsed = restarter_cli.settings_from_args(
        build_parser().parse_args(restarter["args"]), environ={}
    )
    assert parsed.node_grace_seconds == 60
    assert list(parsed.namespaces) == ["training"]

    # TLS from cert-manager: the restarter serves the intake's Secret, the agents trust the CA
    # from the trust Secret, the certificate names the host the agents call.
    certificate = find(docs, "Certificate", "edl-restarter-tls")["spec"]
    (tls,) = (v for v in restarter_pod["volumes"] if v["name"] == "tls")
    assert certificate["secretName"] == tls["secret"]["secretName"]
    host = settings.faults.restarter_address.rsplit(":", 1)[0]
    assert certificate["dnsNames"] == [host]
    assert certificate["duration"] == values["intakeTLS"]["certManager"]["duration"]
    (ca,) = (v for v in agent_pod["volumes"] if v["name"] == "restarter-ca")
    trust = find(docs, "Certificate", "edl-restarter-trust")["spec"]
    assert ca == {
        "name": "restarter-ca",
        "secret": {
            "secretName": trust["secretName"],
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
        },
    }
    assert (
        certificate["issuerRef"]
        == trust["issuerRef"]
        == {"kind": "Issuer", "name": "edl-restarter-ca"}
    )

    # Monitoring: the labels a Prometheus selects on, the scrape interval.
    for kind, name in (
        ("ServiceMonitor", "edl-agent"),
        ("ServiceMonitor", "edl-restarter"),
        ("PrometheusRule", "edl-agent"),
    ):
        assert find(docs, kind, name)["metadata"]["labels"]["release"] == "prometheus"
    for name in ("edl-agent", "edl-restarter"):
        (endpoint,) = find(docs, "ServiceMonitor", name)["spec"]["endpoints"]
        assert endpoint["interval"] == values["serviceMonitor"]["interval"]


def test_an_issuer_of_your_own_signs_both_certificates() -> None:
    issuer = {"kind": "ClusterIssuer", "name": "corp-ca", "group": "cert-manager.io"}
    settings = [f"intakeTLS.certManager.issuerRef.{k}={v}" for k, v in issuer.items()]

    docs = rendered("--set", "intakeTLS.certManager.enabled=true", "--set", ",".join(settings))

    cert_manager = {key(d) for d in docs if d["apiVersion"].startswith("cert-manager.io/")}
    assert cert_manager == {
        ("Certificate", NAMESPACE, "edl-restarter-tls"),
        ("Certificate", NAMESPACE, "edl-restarter-trust"),
    }
    for name in ("edl-restarter-tls", "edl-restarter-trust"):
        assert find(docs, "Certificate", name)["spec"]["issuerRef"] == issuer


# --- on the API server -------------------------------------------------------------------------


@pytest.fixture
def applied_workloads(kubectl: Kubectl) -> Iterator[None]:
    """Deletes the workloads a test applied for real (the shared objects stay, as in
    test_deploy.py: other tests share them)."""
    yield
    delete_workloads(kubectl)


def test_the_defaults_pass_a_server_side_apply(
    kubectl: Kubectl, monitoring_crds: None, applied_workloads: None, tmp_path: Path
) -> None:
    docs = rendered(*WITH_PROMETHEUS_OPERATOR, "--set", "namespace.create=true")
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))

    result = kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        f"--field-manager={FIELD_MANAGER}",
        "-f",
        str(manifest),
    )

    lines = apply_lines(result)
    assert {line.split()[0] for line in lines} == {kubectl_name(doc) for doc in docs}
    assert all(line.endswith("serverside-applied") for line in lines), result.stdout
    assert "Warning" not in result.stderr, result.stderr
    stored = kubectl("get", "-n", NAMESPACE, "daemonset/edl-agent", "-o", "yaml").stdout
    assert yaml.safe_load(stored)["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_every_option_on_passes_a_server_side_dry_run(
    kubectl: Kubectl, monitoring_crds: None, cert_manager_crds: None, tmp_path: Path
) -> None:
    docs = rendered("--values", str(ALL_ON))
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    # A dry run stores nothing, so the namespace its objects go to must exist for real.
    kubectl("apply", "-f", str(DEPLOY / "namespace.yaml"))

    result = kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--dry-run=server",
        f"--field-manager={FIELD_MANAGER}",
        "-f",
        str(manifest),
    )

    lines = apply_lines(result)
    assert {line.split()[0] for line in lines} == {kubectl_name(doc) for doc in docs}
    assert all(line.endswith("(server dry run)") for line in lines), result.stdout
    assert "Warning" not in result.stderr, result.stderr
