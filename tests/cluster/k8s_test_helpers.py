"""Helpers for tests against the etcd + kube-apiserver + kwok control plane.

One ``KwokCluster`` per test, bound to that test's namespace. Nodes carry the
``kwok.x-k8s.io/node: fake`` annotation so kwok drives their status through the stages in the
bin dir (node-initialize, node-heartbeat-with-lease, node-not-ready, pod-ready, pod-complete,
pod-delete, pod-container-running-failed). The session's plane has no scheduler and no
controller-manager: pods are bound by setting ``spec.nodeName``, and ServiceAccounts are created
explicitly. The plane of the ``k8s_managed`` fixture runs kube-controller-manager; there too pods
are bound by ``spec.nodeName`` (no scheduler), and ``cleanup`` does what no controller of it
does (the namespace controller's part).
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.waiting import wait_for

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
NODE_NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_FAIL_EXIT_CODE = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"
POD_FAIL_CONTAINER = "pod-container-running-failed.stage.kwok.x-k8s.io/container-name"
GPU_RESOURCE = "nvidia.com/gpu"
# Never pulled: kwok only pretends to run containers.
FAKE_IMAGE = "registry.invalid/edl/worker:test"
NOT_FOUND = 404
CONFLICT = 409

T = TypeVar("T")


def node_ready(node: Any) -> bool | None:
    """True/False from the node's Ready condition; None when it has none yet."""
    for condition in (node.status and node.status.conditions) or []:
        if condition.type == "Ready":
            return bool(condition.status == "True")
    return None


def container_state(pod: Any, container: str | None = None) -> Any:
    for status in (pod.status and pod.status.container_statuses) or []:
        if container is None or status.name == container:
            return status.state
    return None


def forge_token(token: str, **claims: object) -> str:
    """``token`` with its claims changed but the original signature: must not authenticate."""
    header, payload, signature = token.split(".")
    decoded = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    decoded.update(claims)
    forged = base64.urlsafe_b64encode(json.dumps(decoded).encode()).rstrip(b"=").decode()
    return f"{header}.{forged}.{signature}"


def bound_tokens(
    core: client.CoreV1Api,
    namespace: str,
    node: str,
    service_account: str,
    audiences: list[list[str]],
    *,
    pod_labels: dict[str, str] | None = None,
    command: list[str] | None = None,
) -> list[str]:
    """Tokens as kubelet projects them into a pod of `service_account` on `node`, one per
    audience list ([] is the API server's): bound to that pod, so they name the node. `command`:
    what the pod runs where the node's runtime runs processes (exec mode), so that it stays up."""
    pod = core.create_namespaced_pod(
        namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(
                name=f"{service_account}-{secrets.token_hex(3)}", labels=pod_labels
            ),
            spec=client.V1PodSpec(
                node_name=node,
                service_account_name=service_account,
                containers=[
                    client.V1Container(name="c", image="registry.invalid/edl:test", command=command)
                ],
            ),
        ),
    )
    reference = client.V1BoundObjectReference(
        kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid
    )
    tokens = []
    for wanted in audiences:
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=wanted, bound_object_ref=reference)
        )
        response = core.create_namespaced_service_account_token(service_account, namespace, request)
        tokens.append(str(response.status.token))
    return tokens


class KwokCluster:
    """Typed shortcuts for one test: its namespace, fake GPU nodes, pods and tokens."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.core = client.CoreV1Api(api)
        self.auth = client.AuthenticationV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self._nodes: list[str] = []

    # --- nodes ---------------------------------------------------------------------------

    def unique_name(self, prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(3)}"

    def create_gpu_node(
        self,
        name: str | None = None,
        *,
        gpus: int = 8,
        gpu_resource: str = GPU_RESOURCE,
        cpu: str = "96",
        memory: str = "1Ti",
        pods: str = "110",
        labels: dict[str, str] | None = None,
        wait_ready: bool = True,
        timeout: float = 30.0,
    ) -> Any:
        """A node kwok manages, with GPUs in capacity and allocatable; deleted after the test."""
        name = name or self.unique_name("gpu-node")
        resources = {"cpu": cpu, "memory": memory, "pods": pods, gpu_resource: str(gpus)}
        body = client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name,
                annotations={KWOK_NODE_ANNOTATION: "fake"},
                labels={
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "type": "kwok",
                    **(labels or {}),
                },
            ),
            status=client.V1NodeStatus(capacity=resources, allocatable=dict(resources)),
        )
        node = self.core.create_node(body)
        self._nodes.append(name)
        if wait_ready:
            return self.wait_node_ready(name, True, timeout=timeout)
        return node

    def wait_node_ready(self, name: str, ready: bool = True, *, timeout: float = 30.0) -> Any:
        return wait_for(
            f"node {name} Ready={ready}",
            lambda: self.core.read_node(name),
            lambda node: node_ready(node) is ready,
            timeout,
        )

    def make_node_not_ready(self, name: str, *, timeout: float = 30.0) -> Any:
        """kwok's node-not-ready stage turns the Ready condition False (after about 1 s)."""
        self.core.patch_node(name, {"metadata": {"labels": {NODE_NOT_READY_LABEL: "true"}}})
        return self.wait_node_ready(name, False, timeout=timeout)

    def make_node_ready(self, name: str, *, timeout: float = 30.0) -> Any:
        """Drop the chaos label: kwok's node-initialize stage makes the node Ready again."""
        self.core.patch_node(name, {"metadata": {"labels": {NODE_NOT_READY_LABEL: None}}})
        return self.wait_node_ready(name, True, timeout=timeout)

    # --- pods ----------------------------------------------------------------------------

    def create_pod(
        self,
        name: str | None = None,
        *,
        node: str,
        gpus: int = 0,
        gpu_resource: str = GPU_RESOURCE,
        containers: tuple[str, ...] = ("worker",),
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        restart_policy: str = "Never",
        wait_running: bool = True,
        timeout: float = 30.0,
    ) -> Any:
        """A pod bound to ``node`` (spec.nodeName; no scheduler runs), Running via kwok."""
        name = name or self.unique_name("pod")
        limits = {gpu_resource: str(gpus)} if gpus else None
        body = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, labels=labels, annotations=annotations),
            spec=client.V1PodSpec(
                node_name=node,
                restart_policy=restart_policy,
                containers=[
                    client.V1Container(
                        name=container,
                        image=FAKE_IMAGE,
                        resources=client.V1ResourceRequirements(limits=limits),
                    )
                    for container in containers
                ],
            ),
        )
        pod = self.core.create_namespaced_pod(self.namespace, body)
        if wait_running:
            return self.wait_pod_phase(name, "Running", timeout=timeout)
        return pod

    def read_pod(self, name: str) -> Any:
        return self.core.read_namespaced_pod(name, self.namespace)

    def wait_pod_phase(self, name: str, phase: str, *, timeout: float = 30.0) -> Any:
        return wait_for(
            f"pod {self.namespace}/{name} phase {phase}",
            lambda: self.read_pod(name),
            lambda pod: pod.status is not None and pod.status.phase == phase,
            timeout,
        )

    def exit_pod(
        self, name: str, exit_code: int, *, container: str | None = None, timeout: float = 30.0
    ) -> Any:
        """Make a Running pod's container(s) terminate with ``exit_code`` (pod goes Failed)."""
        annotations = {POD_FAIL_EXIT_CODE: str(exit_code)}
        if container is not None:
            annotations[POD_FAIL_CONTAINER] = container
        patch = {"metadata": {"labels": {POD_FAIL_LABEL: "true"}, "annotations": annotations}}
        self.core.patch_namespaced_pod(name, self.namespace, patch)

        def exited(pod: Any) -> bool:
            state = container_state(pod, container)
            return bool(state and state.terminated and state.terminated.exit_code == exit_code)

        return wait_for(
            f"pod {self.namespace}/{name} to exit with {exit_code}",
            lambda: self.read_pod(name),
            exited,
            timeout,
        )

    def force_delete_pod(self, name: str, *, timeout: float = 30.0) -> None:
        """Delete with grace period 0 (like ``kubectl delete --force``); wait until gone."""
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
        wait_for(
            f"pod {self.namespace}/{name} to be gone",
            lambda: self._exists(lambda: self.read_pod(name)),
            lambda exists: not exists,
            timeout,
        )

    # --- service accounts and tokens -----------------------------------------------------

    def create_service_account(self, name: str) -> Any:
        body = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
        try:
            return self.core.create_namespaced_service_account(self.namespace, body)
        except ApiException as exc:
            if exc.status != CONFLICT:
                raise
            return self.core.read_namespaced_service_account(name, self.namespace)

    def mint_token(
        self,
        service_account: str = "default",
        *,
        audiences: list[str] | None = None,
        expiration_seconds: int = 3600,
    ) -> str:
        """A bound token for ``service_account`` via the TokenRequest API (SA made if absent)."""
        self.create_service_account(service_account)
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=audiences or [], expiration_seconds=expiration_seconds
            )
        )
        response = self.core.create_namespaced_service_account_token(
            service_account, self.namespace, request
        )
        return str(response.status.token)

    def token_review(self, token: str, audiences: list[str] | None = None) -> Any:
        review = client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=audiences)
        )
        return self.auth.create_token_review(review).status

    # --- cleanup -------------------------------------------------------------------------

    @staticmethod
    def _exists(read: Callable[[], object]) -> bool:
        try:
            read()
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return False
            raise
        return True

    def cleanup(self) -> None:
        """Remove what the test made, doing the namespace controller's part by hand (the
        session's plane runs no controller-manager; the ``k8s_managed`` one no namespace
        controller)."""
        ns = self.namespace
        self.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        for node in self._nodes:
            for delete in (
                lambda n=node: self.core.delete_node(n),
                lambda n=node: self.coordination.delete_namespaced_lease(n, "kube-node-lease"),
            ):
                try:
                    delete()
                except ApiException as exc:
                    if exc.status != NOT_FOUND:
                        raise
        for collection in (
            self.core.delete_collection_namespaced_service_account,
            self.core.delete_collection_namespaced_config_map,
            self.core.delete_collection_namespaced_secret,
            self.core.delete_collection_namespaced_event,
        ):
            collection(ns)
        self.core.delete_namespace(ns)
        # The namespace controller would empty spec.finalizers; without it, finalize directly.
        try:
            namespace = self.core.read_namespace(ns)
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return
            raise
        namespace.spec.finalizers = []
        self.core.replace_namespace_finalize(ns, namespace)
        wait_for(
            f"namespace {ns} to be gone",
            lambda: self._exists(lambda: self.core.read_namespace(ns)),
            lambda exists: not exists,
            timeout=30,
        )


def admin_client(plane: Any) -> client.ApiClient:
    """A client of `plane` (a `testcluster.ControlPlane`) with its admin token."""
    config = client.Configuration()
    config.host = plane.server
    config.ssl_ca_cert = str(plane.ca_file)
    config.api_key = {"authorization": plane.token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(config)
