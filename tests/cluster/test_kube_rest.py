"""The agent's own Kubernetes client (edl_agent.kube_rest) against the real kube-apiserver: every
call, once with an admin's client certificate from a kubeconfig and once with the agent's
pod-bound service-account token as a pod finds it (bound by deploy/daemonset/agent-rbac.yaml and
its admission policy), compared with kube.KubeApi (the kubernetes package) where that is cheap."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import queue
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import testcluster
import yaml
from k8s_test_helpers import KwokCluster
from test_node_labels import agent_view, pod_bound_token

from edl_agent.kube import ApiError, Closable, KubeApi, api_client
from edl_agent.kube_credentials import Credentials
from edl_agent.kube_rest import RestKubeApi, read_kubeconfigs, rest_client

Event = tuple[str, dict[str, Any]]
CONDITION = "AcceleratorHealthy"


@pytest.fixture(scope="module")
def admin_cert_kubeconfig(
    k8s_control_plane: testcluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A kubeconfig with a client certificate (group system:masters) signed by the cluster's CA,
    as PEM data, and the CA as a file relative to the kubeconfig."""
    pki = k8s_control_plane.ca_file.parent
    directory = tmp_path_factory.mktemp("rest-admin")
    (directory / "pki").mkdir()
    (directory / "pki" / "ca.crt").write_bytes(k8s_control_plane.ca_file.read_bytes())

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "admin.key", "-out", "admin.csr",
            "-subj", "/O=system:masters/CN=edl-rest-admin")  # fmt: skip
    (directory / "admin.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", "admin.csr", "-CA", str(pki / "ca.crt"),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-CAserial", "ca.srl",
            "-out", "admin.crt", "-days", "1", "-extfile", "admin.ext")  # fmt: skip

    def data(name: str) -> str:
        return base64.b64encode((directory / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": k8s_control_plane.server,
                    "certificate-authority": "pki/ca.crt",
                },
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": data("admin.crt"),
                    "client-key-data": data("admin.key"),
                },
            }
        ],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "admin"}}],
        "current-context": "x",
    }
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def in_cluster(plane: testcluster.ControlPlane, token_file: Path) -> RestKubeApi:
    """The client as the agent's pod builds it: the service host and port, the mounted token."""
    server = urlsplit(plane.server)
    environ = {
        "KUBERNETES_SERVICE_HOST": str(server.hostname),
        "KUBERNETES_SERVICE_PORT": str(server.port),
    }
    api = rest_client(None, environ=environ, token_file=str(token_file), ca_file=str(plane.ca_file))
    assert api is not None
    return api


def package_client(kubeconfig: Path) -> KubeApi:
    """kube.KubeApi on the kubernetes package, from the same kubeconfig."""
    api = api_client(str(kubeconfig), environ={})
    assert api is not None
    return KubeApi(api)


@dataclass
class Identity:
    """One identity's two clients for one test's node: ours and the kubernetes package's."""

    node: str
    rest: RestKubeApi
    kube: KubeApi


@pytest.fixture(params=["admin-cert", "agent-token"])
def who(
    request: pytest.FixtureRequest,
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    admin_cert_kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[Identity]:
    node = k8s.create_gpu_node(labels={"team": "ml"}).metadata.name
    with contextlib.ExitStack() as stack:
        if request.param == "admin-cert":
            rest = rest_client([admin_cert_kubeconfig], environ={})
            assert rest is not None
            kube = package_client(admin_cert_kubeconfig)
            stack.callback(kube.close)
        else:
            view = stack.enter_context(agent_view(k8s, node))
            token = tmp_path / "token"
            token.write_text(pod_bound_token(k8s, node))
            rest, kube = in_cluster(k8s_control_plane, token), view.api
        stack.callback(rest.close)
        yield Identity(node, rest, kube)
        selector = f"involvedObject.name={node}"
        k8s.core.delete_collection_namespaced_event("default", field_selector=selector)


class Watching:
    """A watch consumed on its own thread, ended from the test's thread through `opened`."""

    def __init__(self, start: Callable[[Callable[[Closable], None]], Iterator[Event]]) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.error: BaseException | None = None
        self._stream: Closable | None = None
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start,), daemon=True)
        self._thread.start()

    def _run(self, start: Callable[[Callable[[Closable], None]], Iterator[Event]]) -> None:
        try:
            for item in start(self._open):
                self.events.put(item)
        except BaseException as exc:  # the test thread reports it
            self.error = exc

    def _open(self, stream: Closable) -> None:
        self._stream = stream
        self._opened.set()

    def wait(self, want: Callable[[Event], bool], timeout: float = 20.0) -> Event:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self.events.get(timeout=left)
            except queue.Empty:
                break
            if want(item):
                return item
        raise AssertionError(f"no such watch event in {timeout:.0f}s (error: {self.error})")

    def stop(self) -> float:
        """End the watch from this thread; how long the watching thread took to notice."""
        assert self._opened.wait(10), "the watch never opened"
        assert self._stream is not None
        started = time.monotonic()
        self._stream.shutdown()  # type: ignore[attr-defined]
        self._thread.join(10)
        assert not self._thread.is_alive(), "the watch did not end"
        assert self.error is None, f"ending the watch raised {self.error!r}"
        return time.monotonic() - started


def labels_patch(labels: dict[str, str | None], version: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": labels}
    if version is not None:
        metadata["resourceVersion"] = version
    return {"metadata": metadata}


def test_read_and_patch_node_labels_with_a_precondition(who: Identity) -> None:
    node = who.rest.read_node(who.node)
    theirs = who.kube.read_node(who.node)
    assert node["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert node["metadata"]["labels"]["team"] == "ml"
    version = node["metadata"]["resourceVersion"]

    patched = who.rest.patch_node(who.node, labels_patch({"edl.io/rest": "1"}, version))
    assert patched["metadata"]["labels"]["edl.io/rest"] == "1"
    assert patched["metadata"]["labels"]["team"] == "ml"  # a merge patch keeps the others
    assert patched["metadata"]["resourceVersion"] != version

    stale = labels_patch({"edl.io/rest": "2"}, version)
    with pytest.raises(ApiError) as ours:
        who.rest.patch_node(who.node, stale)
    with pytest.raises(ApiError) as kubes:
        who.kube.patch_node(who.node, stale)
    assert ours.value.status == 409
    assert str(ours.value) == str(kubes.value)
    assert "has been modified" in str(ours.value)

    removed = who.rest.patch_node(who.node, labels_patch({"edl.io/rest": None}))
    assert "edl.io/rest" not in removed["metadata"]["labels"]
    assert who.kube.read_node(who.node)["metadata"]["labels"] == removed["metadata"]["labels"]


def test_patch_node_status_merges_conditions_by_type(who: Identity) -> None:
    stamp = "2026-05-01T12:00:00Z"
    condition = {
        "type": CONDITION,
        "status": "True",
        "reason": "AcceleratorsHealthy",
        "message": "8 of 8 healthy",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
    result = who.rest.patch_node_status(who.node, {"status": {"conditions": [condition]}})
    conditions = {c["type"]: c for c in result["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "True"  # kwok's, kept by the strategic merge
    assert conditions[CONDITION]["message"] == "8 of 8 healthy"

    who.kube.patch_node_status(
        who.node, {"status": {"conditions": [{**condition, "status": "False"}]}}
    )
    after = {c["type"]: c for c in who.rest.read_node(who.node)["status"]["conditions"]}
    assert after[CONDITION]["status"] == "False"
    assert "Ready" in after


def test_create_and_patch_an_event(who: Identity, k8s: KwokCluster) -> None:
    name = f"{who.node}.{secrets.token_hex(6)}"
    stamp = "2026-05-01T12:00:00Z"
    body = {
        "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": who.node},
        "type": "Warning",
        "reason": "AcceleratorUnhealthy",
        "message": "GPU 3: XID 79",
        "count": 1,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "source": {"component": "edl-agent", "host": who.node},
    }
    created = who.rest.create_event("default", body)
    assert (created["metadata"]["name"], created["count"]) == (name, 1)

    bumped = who.rest.patch_event("default", name, {"count": 2, "lastTimestamp": stamp})
    assert bumped["count"] == 2
    assert bumped["reason"] == "AcceleratorUnhealthy"
    assert who.kube.patch_event("default", name, {"count": 3})["count"] == 3
    assert k8s.core.read_namespaced_event(name, "default").count == 3

    with pytest.raises(ApiError) as ours:
        who.rest.patch_event("default", f"{name}.absent", {"count": 2})
    with pytest.raises(ApiError) as kubes:
        who.kube.patch_event("default", f"{name}.absent", {"count": 2})
    assert ours.value.status == 404
    assert str(ours.value) == str(kubes.value)


def test_list_and_watch_pods(who: Identity, k8s: KwokCluster) -> None:
    selector = f"spec.nodeName={who.node}"
    listing = who.rest.list_pods(selector)
    names = sorted(p["metadata"]["name"] for p in listing["items"])
    assert names == sorted(p["metadata"]["name"] for p in who.kube.list_pods(selector)["items"])
    version = listing["metadata"]["resourceVersion"]

    watching = Watching(
        lambda opened: who.rest.watch_pods(
            selector, resource_version=version, timeout_seconds=120, opened=opened
        )
    )
    pod = k8s.create_pod(node=who.node, wait_running=False).metadata.name
    kind, body = watching.wait(lambda e: e[1].get("metadata", {}).get("name") == pod)
    assert kind == "ADDED"
    assert body["spec"]["nodeName"] == who.node
    assert watching.stop() < 3


def test_watch_a_node_see_a_label_change_then_end_it(who: Identity) -> None:
    version = who.rest.read_node(who.node)["metadata"]["resourceVersion"]
    watching = Watching(
        lambda opened: who.rest.watch_node(
            who.node, resource_version=version, timeout_seconds=120, opened=opened
        )
    )
    who.rest.patch_node(who.node, labels_patch({"edl.io/watched": "yes"}))

    def labelled(item: Event) -> bool:
        return bool(item[1]["metadata"].get("labels", {}).get("edl.io/watched") == "yes")

    kind, body = watching.wait(labelled)
    assert kind == "MODIFIED"
    assert body["metadata"]["name"] == who.node
    assert watching.stop() < 3  # a watch that would run two more minutes


def test_a_too_old_resource_version_is_gone(who: Identity) -> None:
    def first(api: RestKubeApi | KubeApi) -> ApiError | Event:
        try:
            return next(iter(api.watch_node(who.node, resource_version="1", timeout_seconds=5)))
        except ApiError as exc:
            return exc

    ours = first(who.rest)
    if not isinstance(ours, ApiError):
        # The API server's watch cache keeps every node event since it started until it holds
        # more than it may (about 100 after 75 s); etcd's compaction does not change that.
        pytest.skip("resourceVersion 1 is still in the API server's watch cache")
    theirs = first(who.kube)
    assert ours.status == 410
    assert isinstance(theirs, ApiError)
    assert (theirs.status, str(theirs)) == (410, str(ours))


def test_a_rotated_service_account_token_is_reread(
    k8s: KwokCluster, k8s_control_plane: testcluster.ControlPlane, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("not-a-token")
    api = in_cluster(k8s_control_plane, token)
    try:
        with pytest.raises(ApiError) as caught:
            api.read_node("absent")
        assert caught.value.status == 401
        # kubelet writes the new token; the next 401 re-reads it without waiting a minute.
        token.write_text(k8s.mint_token("rest-reader"))
        with pytest.raises(ApiError) as caught:
            api.read_node("absent")
        assert caught.value.status == 403  # authenticated now; this account may not read nodes
        assert "system:serviceaccount:" in str(caught.value)
    finally:
        api.close()


def test_tls_server_name_and_a_wrong_one(admin_cert_kubeconfig: Path, k8s: KwokCluster) -> None:
    node = k8s.create_gpu_node(wait_ready=False).metadata.name
    credentials = Credentials.from_kubeconfig(read_kubeconfigs([admin_cert_kubeconfig]))
    assert credentials is not None
    for name, works in (("localhost", True), ("wrong.test", False)):
        api = RestKubeApi(dataclasses.replace(credentials, tls_server_name=name))
        try:
            if works:
                assert api.read_node(node)["metadata"]["name"] == node
            else:
                with pytest.raises(ApiError, match="SSLError") as caught:
                    api.read_node(node)
                assert caught.value.status is None
        finally:
            api.close()


def test_the_clusters_own_token_kubeconfig(
    k8s_control_plane: testcluster.ControlPlane, k8s: KwokCluster
) -> None:
    node = k8s.create_gpu_node(wait_ready=False).metadata.name
    rest = rest_client([k8s_control_plane.kubeconfig], environ={})
    kube = package_client(k8s_control_plane.kubeconfig)
    assert rest is not None
    try:
        ours, theirs = rest.read_node(node), kube.read_node(node)
        assert ours["metadata"]["uid"] == theirs["metadata"]["uid"]
        with pytest.raises(ApiError) as caught:
            rest.read_node(f"{node}-absent")
        assert caught.value.status == 404
        assert str(caught.value) == f'HTTP 404: nodes "{node}-absent" not found'
    finally:
        rest.close()
        kube.close()
