"""The training stack users submit to, beside kube-controller-manager on a test control plane:
JobSet's controller and Kueue's manager (built by `scripts/k8s-binaries` from the Go module
proxy, with the CRDs and webhook configurations of the same module versions).

Each runs as its own process with its webhooks served: certificate management inside the
controller is off; it serves with the control plane's own serving certificate (made for
127.0.0.1 by the plane's CA), and the webhook configurations are the module's, with each
webhook's Service reference turned into a URL on loopback (the test API server runs no kube-proxy
and no endpoint reconciler, so a Service cannot be reached) and the CA bundle set. The module's
kustomization patches (object and namespace selectors) are applied as its kustomize build would.
Kueue's webhooks are kept only for the kinds it is set to manage here (batch/v1 Jobs, JobSets)
and its own; a webhook for a framework it does not run would answer no path.

The controllers run as the plane's admin (the RBAC their releases ship is theirs to prove), with
leader election, metrics and Kueue's visibility server off. `stop()` removes the webhook
configurations first, so nothing later on the plane calls a server that is gone.
"""

from __future__ import annotations

import base64
import contextlib
import shlex
import shutil
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k8sbinaries
import testcluster
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from scheduler import LOOPBACK, Process, ProcessError, free_port, spawn, wait_started

ESTABLISHED = 60.0
KUEUE_NAMESPACE = "kueue-system"
KUEUE_FRAMEWORKS = ("batch/job", "jobset.x-k8s.io/jobset")
# The API groups whose webhooks Kueue keeps here: its own and the frameworks above.
KUEUE_GROUPS = frozenset({"kueue.x-k8s.io", "batch", "jobset.x-k8s.io"})
NOT_FOUND = 404
CONFLICT = 409


@dataclass
class Controller:
    """A running controller: its process and the webhook configurations it registered."""

    name: str
    process: Process
    api: client.ApiClient
    webhooks: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)

    def stop(self) -> int:
        admission = client.AdmissionregistrationV1Api(self.api)
        for kind, name in self.webhooks:
            with contextlib.suppress(ApiException):
                if kind == "MutatingWebhookConfiguration":
                    admission.delete_mutating_webhook_configuration(name)
                else:
                    admission.delete_validating_webhook_configuration(name)
        return self.process.stop()


def _manifests(name: str) -> Path:
    found = k8sbinaries.manifests_dir(name)
    binary = k8sbinaries.find(name)
    if found is None or binary is None:
        raise ProcessError(
            f"{name} {k8sbinaries.PINS[name]} is not in {k8sbinaries.bin_dir()}: run "
            f"`scripts/k8s-binaries {name}` (it builds it from the Go module proxy)"
        )
    return found


def install_crds(api: client.ApiClient, name: str) -> None:
    """Create (or leave as they are) the CRDs of controller `name`; returns once established."""
    extensions = client.ApiextensionsV1Api(api)
    names = []
    for path in sorted((_manifests(name) / "crd").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not document:
                continue
            names.append(document["metadata"]["name"])
            try:
                extensions.create_custom_resource_definition(document)
            except ApiException as exc:
                if exc.status != CONFLICT:
                    raise
    deadline = time.monotonic() + ESTABLISHED
    for crd in names:
        while not _established(extensions.read_custom_resource_definition(crd)):
            if time.monotonic() > deadline:
                raise ProcessError(f"CRD {crd} not established in {ESTABLISHED:.0f}s")
            time.sleep(0.2)


def _established(crd: Any) -> bool:
    return any(
        c.type == "Established" and c.status == "True" for c in (crd.status.conditions or [])
    )


def _patched(configuration: dict[str, Any], patches: Iterable[Mapping[str, Any]]) -> None:
    """Apply a kustomization's patches to one webhook configuration: JSON patches replacing
    `/webhooks/N`, or strategic merges naming webhooks (merged by name)."""
    webhooks = configuration["webhooks"]
    for patch in patches:
        if "op" in patch:
            index = int(str(patch["path"]).rsplit("/", 1)[1])
            webhooks[index] = patch["value"]
            continue
        for partial in patch.get("webhooks") or []:
            for webhook in webhooks:
                if webhook["name"] == partial["name"]:
                    webhook.update({k: v for k, v in partial.items() if k != "name"})


def _kustomize_patches(webhook_dir: Path) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    """The patches of webhook/kustomization.yaml by (kind, configuration name)."""
    kustomization = yaml.safe_load((webhook_dir / "kustomization.yaml").read_text()) or {}
    found: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for entry in kustomization.get("patches") or []:
        if "path" in entry:
            target = entry.get("target") or {}
            key = (str(target.get("kind")), str(target.get("name")))
            ops = yaml.safe_load((webhook_dir / entry["path"]).read_text()) or []
            found.setdefault(key, []).extend(ops)
        elif "patch" in entry:
            body = yaml.safe_load(entry["patch"])
            key = (str(body["kind"]), str(body["metadata"]["name"]))
            found.setdefault(key, []).append(body)
    return found


def webhook_configurations(
    name: str, *, port: int, ca_bundle: str, groups: frozenset[str] | None = None
) -> list[dict[str, Any]]:
    """The module's webhook configurations for controller `name`, served at
    https://127.0.0.1:`port`, named after the controller (JobSet's and Kueue's share names);
    `groups`: keep only webhooks whose rules are all for these API groups."""
    webhook_dir = _manifests(name) / "webhook"
    patches = _kustomize_patches(webhook_dir)
    found = []
    for document in yaml.safe_load_all((webhook_dir / "manifests.yaml").read_text()):
        if not document:
            continue
        _patched(document, patches.get((document["kind"], document["metadata"]["name"]), []))
        kept = []
        for webhook in document["webhooks"]:
            rule_groups = {g for rule in webhook.get("rules") or [] for g in rule["apiGroups"]}
            if groups is not None and not rule_groups <= groups:
                continue
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {
                "url": f"https://{LOOPBACK}:{port}{path}",
                "caBundle": ca_bundle,
            }
            kept.append(webhook)
        suffix = "mutating" if document["kind"].startswith("Mutating") else "validating"
        document["metadata"] = {"name": f"{name}-{suffix}"}
        document["webhooks"] = kept
        if kept:
            found.append(document)
    return found


def _register(api: client.ApiClient, configurations: list[dict[str, Any]]) -> list[tuple[str, str]]:
    admission = client.AdmissionregistrationV1Api(api)
    made = []
    for body in configurations:
        name = body["metadata"]["name"]
        if body["kind"] == "MutatingWebhookConfiguration":
            with contextlib.suppress(ApiException):
                admission.delete_mutating_webhook_configuration(name)
            admission.create_mutating_webhook_configuration(body)
        else:
            with contextlib.suppress(ApiException):
                admission.delete_validating_webhook_configuration(name)
            admission.create_validating_webhook_configuration(body)
        made.append((body["kind"], name))
    return made


def _serving_cert_dir(plane: testcluster.ControlPlane, directory: Path) -> Path:
    """The plane's serving certificate (127.0.0.1, signed by its CA) where controller-runtime's
    webhook server looks for it."""
    certs = directory / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    pki = plane.directory / "pki"
    shutil.copyfile(pki / "serving.crt", certs / "tls.crt")
    shutil.copyfile(pki / "serving.key", certs / "tls.key")
    (certs / "tls.key").chmod(0o600)
    return certs


def _with_certs_at(path: str, certs: Path, directory: Path, argv: list[str]) -> list[str]:
    """`argv` run in a mount namespace of its own where `path` (under /etc) holds `certs`: an
    overlay on /etc whose upper layer is in `directory`, gone with the process; the host's /etc
    is never written."""
    upper, work = directory / "etc-upper", directory / "etc-work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    script = "\n".join(
        [
            "set -e",
            "mount -n -t overlay overlay -o "
            + shlex.quote(f"lowerdir=/etc,upperdir={upper},workdir={work}")
            + " /etc",
            f"mkdir -p {shlex.quote(path)}",
            f"cp {shlex.quote(str(certs))}/tls.crt {shlex.quote(str(certs))}/tls.key "
            + shlex.quote(path),
            "exec " + " ".join(shlex.quote(arg) for arg in argv),
        ]
    )
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
    except urllib.error.HTTPError as exc:
        exc.close()
        return False
    except OSError:
        return False


def _webhook_answers(port: int, ca_file: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca_file))
    try:
        with urllib.request.urlopen(f"https://{LOOPBACK}:{port}/", context=context, timeout=2):
            return True
    except urllib.error.HTTPError as exc:
        exc.close()
        return True  # a 404 from the webhook server: it serves
    except OSError:
        return False


def _start(
    name: str,
    plane: testcluster.ControlPlane,
    api: client.ApiClient,
    directory: Path,
    config: dict[str, Any],
    *,
    groups: frozenset[str] | None = None,
    metrics_certs: str = "",
    timeout: float = 90.0,
) -> Controller:
    _manifests(name)
    binary = k8sbinaries.find(name)
    assert binary is not None
    install_crds(api, name)
    directory.mkdir(parents=True, exist_ok=True)
    certs = _serving_cert_dir(plane, directory)
    webhook_port, health_port = free_port(), free_port()
    config = {
        **config,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {
            "port": webhook_port,
            "host": LOOPBACK,
            "certDir": str(certs),
        },
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"{LOOPBACK}:{health_port}"},
    }
    config_file = directory / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    argv = [str(binary), f"--config={config_file}", f"--kubeconfig={plane.kubeconfig}"]
    if metrics_certs:
        argv = _with_certs_at(metrics_certs, certs, directory, argv)
    process = spawn(name, argv, directory)
    wait_started(
        process,
        lambda: _ready(health_port) and _webhook_answers(webhook_port, plane.ca_file),
        timeout,
    )
    ca_bundle = base64.b64encode(plane.ca_file.read_bytes()).decode()
    controller = Controller(name, process, api)
    try:
        controller.webhooks = _register(
            api,
            webhook_configurations(name, port=webhook_port, ca_bundle=ca_bundle, groups=groups),
        )
    except BaseException:
        controller.stop()
        raise
    return controller


def start_jobset(
    plane: testcluster.ControlPlane, api: client.ApiClient, directory: Path
) -> Controller:
    """JobSet's controller on `plane`, its webhooks served; running when this returns."""
    return _start(
        k8sbinaries.JOBSET,
        plane,
        api,
        directory,
        {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration"},
    )


def start_kueue(
    plane: testcluster.ControlPlane, api: client.ApiClient, directory: Path
) -> Controller:
    """Kueue's manager on `plane`, managing Jobs and JobSets that name a queue (the
    `kueue.x-k8s.io/queue-name` label), its webhooks for those and its own kinds served."""
    with contextlib.suppress(ApiException):
        client.CoreV1Api(api).create_namespace({"metadata": {"name": KUEUE_NAMESPACE}})
    return _start(
        k8sbinaries.KUEUE,
        plane,
        api,
        directory,
        {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE,
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
            # Its on-demand visibility API server would take a fixed port of its own.
            "featureGates": {"VisibilityOnDemand": False},
        },
        groups=KUEUE_GROUPS,
        # Without its own certificate management Kueue reads its metrics server's certificate
        # from this fixed path, even with metrics off, and exits when it is not there.
        metrics_certs="/etc/kueue/metrics/certs",
    )


def start_stack(
    plane: testcluster.ControlPlane, api: client.ApiClient, directory: Path
) -> list[Controller]:
    """JobSet's controller, then Kueue's manager (under `directory`/jobset and /kueue), both
    running when this returns; ProcessError, with what had started stopped, when one cannot."""
    started: list[Controller] = []
    try:
        started.append(start_jobset(plane, api, directory / "jobset"))
        started.append(start_kueue(plane, api, directory / "kueue"))
    except BaseException:
        stop_stack(started)
        raise
    return started


def stop_stack(controllers: list[Controller]) -> None:
    for controller in reversed(controllers):
        controller.stop()


# --- Kueue's objects --------------------------------------------------------------------------

KUEUE_GROUP, KUEUE_VERSION_API = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def gpu_queue(api: client.ApiClient, namespace: str, name: str, gpus: int, resource: str) -> None:
    """A ClusterQueue `name` with a quota of `gpus` of `resource` (one flavor, `name` too) and a
    LocalQueue `name` in `namespace` pointing at it."""
    objects = client.CustomObjectsApi(api)
    group, version = KUEUE_GROUP, KUEUE_VERSION_API
    objects.create_cluster_custom_object(
        group,
        version,
        "resourceflavors",
        {"apiVersion": f"{group}/{version}", "kind": "ResourceFlavor", "metadata": {"name": name}},
    )
    quota = {"name": resource, "nominalQuota": gpus}
    objects.create_cluster_custom_object(
        group,
        version,
        "clusterqueues",
        {
            "apiVersion": f"{group}/{version}",
            "kind": "ClusterQueue",
            "metadata": {"name": name},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": [resource],
                        "flavors": [{"name": name, "resources": [quota]}],
                    }
                ],
            },
        },
    )
    objects.create_namespaced_custom_object(
        group,
        version,
        namespace,
        "localqueues",
        {
            "apiVersion": f"{group}/{version}",
            "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": name},
        },
    )


def remove_queue(api: client.ApiClient, name: str) -> None:
    objects = client.CustomObjectsApi(api)
    for plural in ("clusterqueues", "resourceflavors"):
        with contextlib.suppress(ApiException):
            objects.delete_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION_API, plural, name)


def queue_usage(api: client.ApiClient, name: str, resource: str) -> dict[str, int]:
    """What ClusterQueue `name` counts of `resource`: reserved and in use (its status)."""
    body = client.CustomObjectsApi(api).get_cluster_custom_object(
        KUEUE_GROUP, KUEUE_VERSION_API, "clusterqueues", name
    )
    status = body.get("status") or {}
    found = {}
    for key in ("flavorsReservation", "flavorsUsage"):
        total = 0
        for flavor in status.get(key) or []:
            for entry in flavor.get("resources") or []:
                if entry.get("name") == resource:
                    total += int(entry.get("total") or 0)
        found[key] = total
    found["admittedWorkloads"] = int(status.get("admittedWorkloads") or 0)
    found["pendingWorkloads"] = int(status.get("pendingWorkloads") or 0)
    return found
