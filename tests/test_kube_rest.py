"""The agent's own Kubernetes client (edl_agent.kube_rest), without a cluster: credentials from
kubeconfig documents and the service account, and the HTTP it speaks, checked against a real
HTTP(S) server on 127.0.0.1 (no mocks of urllib3)."""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import yaml

from edl_agent import kube_rest
from edl_agent.kube import ApiError, KubeApi, KubeConfigError
from edl_agent.kube_credentials import Credentials, TokenFile
from edl_agent.kube_rest import RestKubeApi, read_kubeconfigs, rest_client

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(
    path: Path,
    *,
    cluster: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
    current: str | None = "ctx",
) -> Path:
    document: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://k8s.test:6443"}}],
        "users": [{"name": "u", "user": user or {}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
    }
    if current is not None:
        document["current-context"] = current
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    return path


def credentials_of(*paths: Path) -> Credentials | None:
    return Credentials.from_kubeconfig(read_kubeconfigs(list(paths)))


# --- credentials from kubeconfig documents ----------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "user", "expected"),
    [
        pytest.param(
            {"server": "https://k8s.test:6443", "certificate-authority-data": b64(b"CA PEM")},
            {"token": "t0k"},
            {"ca_data": b"CA PEM", "ca_file": None, "token": "t0k"},
            id="ca-data-and-token",
        ),
        pytest.param(
            {"server": "https://k8s.test:6443", "certificate-authority": "pki/ca.crt"},
            {"tokenFile": "secrets/token"},
            {"ca_file": "{dir}/pki/ca.crt", "token_file": "{dir}/secrets/token", "token": None},
            id="relative-files-resolved-against-the-kubeconfig",
        ),
        pytest.param(
            {"server": "https://k8s.test", "certificate-authority": "/etc/ca.crt"},
            {"client-certificate": "/etc/c.crt", "client-key": "k.key"},
            {"ca_file": "/etc/ca.crt", "cert_file": "/etc/c.crt", "key_file": "{dir}/k.key"},
            id="absolute-files-kept",
        ),
        pytest.param(
            {
                "server": "https://k8s.test",
                "certificate-authority-data": b64(b"CA"),
                "certificate-authority": "ignored.crt",
            },
            {"client-certificate-data": b64(b"CERT"), "client-key-data": b64(b"KEY")},
            {"ca_data": b"CA", "cert_data": b"CERT", "key_data": b"KEY"},
            id="client-cert-data",
        ),
        pytest.param(
            {"server": "https://k8s.test"},
            {"token": "static", "tokenFile": "/run/token"},
            {"token": "static", "token_file": "/run/token"},
            id="token-and-token-file",
        ),
        pytest.param(
            {"server": "https://k8s.test"},
            {"username": "admin", "password": "pw"},
            {"username": "admin", "password": "pw", "token": None},
            id="basic-auth",
        ),
        pytest.param(
            {"server": "https://k8s.test"},
            {"username": "admin"},
            {"username": None, "password": None},
            id="username-without-password-is-no-basic-auth",
        ),
        pytest.param(
            {
                "server": "https://10.0.0.1",
                "insecure-skip-tls-verify": True,
                "tls-server-name": "kubernetes.default",
            },
            {},
            {"insecure": True, "tls_server_name": "kubernetes.default", "token": None},
            id="insecure-and-tls-server-name",
        ),
    ],
)
def test_credentials_from_a_kubeconfig(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], expected: dict[str, Any]
) -> None:
    path = kubeconfig(tmp_path / "conf" / "config", cluster=cluster, user=user)
    credentials = credentials_of(path)
    assert credentials is not None
    assert credentials.server == cluster["server"]
    for name, value in expected.items():
        wanted = value.format(dir=tmp_path / "conf") if isinstance(value, str) else value
        assert getattr(credentials, name) == wanted, name


@pytest.mark.parametrize(
    ("cluster", "user"),
    [
        pytest.param({}, {"exec": {"command": "aws", "apiVersion": "v1"}}, id="exec"),
        pytest.param({}, {"auth-provider": {"name": "oidc"}}, id="auth-provider"),
        pytest.param({"proxy-url": "http://proxy:3128"}, {"token": "t"}, id="proxy-url"),
    ],
)
def test_what_only_the_kubernetes_package_does_gives_none(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any]
) -> None:
    path = kubeconfig(
        tmp_path / "config", cluster={"server": "https://k8s.test", **cluster}, user=user
    )
    assert credentials_of(path) is None
    assert rest_client([path], environ={}) is None


def test_merged_kubeconfigs_resolve_paths_against_the_file_that_defined_the_entry(
    tmp_path: Path,
) -> None:
    # kubectl's merge: the first file to set current-context wins, and so does the first to
    # define a name; each entry's relative paths belong to its own file.
    first = tmp_path / "a" / "config"
    first.parent.mkdir()
    first.write_text(
        yaml.safe_dump(
            {
                "current-context": "ctx",
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
            }
        )
    )
    second = kubeconfig(
        tmp_path / "b" / "config",
        cluster={"server": "https://second:1", "certificate-authority": "ca.crt"},
        user={"token": "shadowed"},
        current="other",
    )
    credentials = credentials_of(tmp_path / "missing", first, second)
    assert credentials == Credentials(
        server="https://second:1",
        ca_file=str(tmp_path / "b" / "ca.crt"),
        token_file=str(tmp_path / "a" / "token"),
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("clusters: []\n", "no current-context"),
        ("current-context: x\n", "current-context 'x' names no context"),
        (
            "current-context: x\ncontexts: [{name: x, context: {cluster: c}}]\n"
            "clusters: [{name: c, cluster: {server: 'https://s', "
            "certificate-authority-data: '%%%'}}]\n",
            "certificate-authority-data is not base64",
        ),
    ],
)
def test_an_unusable_kubeconfig_is_an_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(KubeConfigError, match=problem):
        credentials_of(path)


def test_a_kubeconfig_that_is_not_yaml_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("clusters: [unclosed\n")
    with pytest.raises(KubeConfigError):
        rest_client([path], environ={})


# --- the service account -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "server"),
    [
        ("10.96.0.1", "https://10.96.0.1:443"),
        ("fd00:10:96::1", "https://[fd00:10:96::1]:443"),
        ("kubernetes.default.svc", "https://kubernetes.default.svc:443"),
    ],
)
def test_the_service_account_server(host: str, server: str) -> None:
    environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "443"}
    credentials = Credentials.from_service_account(environ, "/sa/token", "/sa/ca.crt")
    assert credentials == Credentials(server=server, ca_file="/sa/ca.crt", token_file="/sa/token")  # noqa: S106


def test_the_service_account_needs_host_and_port() -> None:
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST/PORT"):
        Credentials.from_service_account({"KUBERNETES_SERVICE_HOST": "10.96.0.1"})


def test_the_token_file_is_reread_each_minute_and_on_demand(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    now = [100.0]
    token = TokenFile(str(path), clock=lambda: now[0])
    assert token.get() == "first"

    path.write_text("second")  # kubelet rotated it
    now[0] += 59
    assert token.get() == "first"  # not yet re-read
    now[0] += 1
    assert token.get() == "second"

    path.write_text("third")
    assert token.reread() is True  # after a 401
    assert token.get() == "third"
    assert token.reread() is False

    path.unlink()  # mid-swap: keep what we have
    now[0] += 60
    assert token.get() == "third"


def test_an_empty_token_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    with pytest.raises(KubeConfigError, match="empty or unreadable"):
        TokenFile(str(tmp_path / "token"))
    with pytest.raises(KubeConfigError, match="empty or unreadable"):
        TokenFile(str(tmp_path / "absent"))


# --- HTTP against a real server -----------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class Stream:
    """A watch response: these lines, one chunk each, then the connection held open."""

    lines: list[bytes]
    hold: float = 0.0


Reply = tuple[int, Any]  # (status, a JSON body, raw bytes or a Stream)


@dataclass
class FakeApi:
    url: str
    answer: Callable[[Seen], Reply] = lambda seen: (200, {"kind": "Node"})
    seen: list[Seen] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ApiServer

    def do_GET(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        seen = Seen(
            self.command,
            parts.path,
            dict(parse_qsl(parts.query)),
            {k.lower(): v for k, v in self.headers.items()},
            json.loads(raw) if raw else None,
        )
        fake = self.server.fake
        fake.seen.append(seen)
        status, body = fake.answer(seen)
        if isinstance(body, Stream):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in body.lines:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            fake.closing.wait(body.hold)
            self.wfile.write(b"0\r\n\r\n")
            return
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeApi

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up mid-stream is what some tests do


@contextlib.contextmanager
def running(tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> Iterator[FakeApi]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (ApiServer,), {"address_family": family})
    server = server_class((host, 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    netloc = f"[{host}]" if ":" in host else host
    server.fake = FakeApi(f"{'https' if tls else 'http'}://{netloc}:{server.server_port}")
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield server.fake
    finally:
        server.fake.closing.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def fake() -> Iterator[FakeApi]:
    with running() as api:
        yield api


@contextlib.contextmanager
def client(
    server: str, *, timeout: tuple[float, float] = (5.0, 30.0), **credentials: Any
) -> Iterator[RestKubeApi]:
    api = RestKubeApi(Credentials(server=server, **credentials), timeout=timeout)
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def api(fake: FakeApi) -> Iterator[RestKubeApi]:
    with client(fake.url, token="t0k") as rest:  # noqa: S106
        yield rest


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


NODE = {"kind": "Node", "metadata": {"name": "n1", "resourceVersion": "41"}}
LABELS = {"metadata": {"labels": {"edl.io/x": "1"}, "resourceVersion": "41"}}
CONDITION = {"status": {"conditions": [{"type": "AcceleratorHealthy", "status": "True"}]}}
EVENT = {"metadata": {"name": "n1.abc"}, "reason": "R", "involvedObject": {"name": "n1"}}


@pytest.mark.parametrize(
    ("call", "method", "path", "query", "content_type", "body"),
    [
        (lambda a: a.read_node("n1"), "GET", "/api/v1/nodes/n1", {}, None, None),
        (lambda a: a.patch_node("n1", LABELS), "PATCH", "/api/v1/nodes/n1", {}, MERGE, LABELS),
        (
            lambda a: a.patch_node_status("n1", CONDITION),
            "PATCH", "/api/v1/nodes/n1/status", {}, STRATEGIC, CONDITION,
        ),
        (
            lambda a: a.create_event("default", EVENT),
            "POST", "/api/v1/namespaces/default/events", {}, "application/json", EVENT,
        ),
        (
            lambda a: a.patch_event("default", "n1.abc", {"count": 2}),
            "PATCH", "/api/v1/namespaces/default/events/n1.abc", {}, MERGE, {"count": 2},
        ),
        (
            lambda a: a.list_pods("spec.nodeName=n1"),
            "GET", "/api/v1/pods", {"fieldSelector": "spec.nodeName=n1"}, None, None,
        ),
    ],
    ids=["read_node", "patch_node", "patch_node_status", "create_event", "patch_event", "list"],
)  # fmt: skip
def test_each_call_sends_its_request(
    fake: FakeApi,
    api: RestKubeApi,
    *,
    call: Callable[[RestKubeApi], dict[str, Any]],
    method: str,
    path: str,
    query: dict[str, str],
    content_type: str | None,
    body: Any,
) -> None:
    fake.answer = lambda seen: (200 if seen.method == "GET" else 201, NODE)
    assert call(api) == NODE
    [seen] = fake.seen
    assert (seen.method, seen.path, seen.query, seen.body) == (method, path, query, body)
    assert seen.headers["authorization"] == "Bearer t0k"
    assert seen.headers["accept"] == "application/json"
    assert seen.headers.get("content-type") == content_type


def test_names_are_escaped_and_a_server_path_prefix_kept(fake: FakeApi) -> None:
    with client(f"{fake.url}/k8s/clusters/c-1/") as api:
        api.read_node("a/b")
    [seen] = fake.seen
    assert seen.path == "/k8s/clusters/c-1/api/v1/nodes/a%2Fb"
    assert "authorization" not in seen.headers


def test_basic_auth(fake: FakeApi) -> None:
    with client(fake.url, username="admin", password="p:w") as api:  # noqa: S106
        api.read_node("n1")
    assert fake.seen[0].headers["authorization"] == f"Basic {b64(b'admin:p:w')}"


def test_a_watch_streams_events(fake: FakeApi, api: RestKubeApi) -> None:
    bookmark = {"kind": "Node", "metadata": {"resourceVersion": "50"}}
    lines = [event("ADDED", NODE), b"\n", event("BOOKMARK", bookmark), event("MODIFIED", NODE)]
    fake.answer = lambda seen: (200, Stream(lines))
    events = list(api.watch_node("n1", resource_version="41", timeout_seconds=30))
    assert events == [("ADDED", NODE), ("BOOKMARK", bookmark), ("MODIFIED", NODE)]
    assert list(api.watch_pods("spec.nodeName=n1", resource_version=None, timeout_seconds=9))
    node_watch, pod_watch = fake.seen
    assert (node_watch.path, node_watch.query) == (
        "/api/v1/nodes",
        {
            "fieldSelector": "metadata.name=n1",
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "30",
            "resourceVersion": "41",
        },
    )
    assert (pod_watch.path, pod_watch.query["fieldSelector"]) == (
        "/api/v1/pods",
        "spec.nodeName=n1",
    )
    assert "resourceVersion" not in pod_watch.query
    assert node_watch.headers["authorization"] == "Bearer t0k"


def test_an_error_event_raises_its_code(fake: FakeApi, api: RestKubeApi) -> None:
    gone = {"kind": "Status", "code": 410, "message": "too old resource version: 1 (50)"}
    fake.answer = lambda seen: (200, Stream([event("ADDED", NODE), event("ERROR", gone)]))
    watch = api.watch_node("n1", resource_version="1", timeout_seconds=30)
    assert next(watch) == ("ADDED", NODE)
    with pytest.raises(ApiError, match="too old resource version") as caught:
        next(watch)
    assert caught.value.status == 410


def test_a_410_answer_to_a_watch(fake: FakeApi, api: RestKubeApi) -> None:
    fake.answer = lambda seen: (410, {"kind": "Status", "code": 410, "message": "Gone away"})
    with pytest.raises(ApiError) as caught:
        list(api.watch_pods("", resource_version="1", timeout_seconds=30))
    assert (caught.value.status, str(caught.value)) == (410, "HTTP 410: Gone away")


def test_a_line_that_is_no_event(fake: FakeApi, api: RestKubeApi) -> None:
    fake.answer = lambda seen: (200, Stream([event("ADDED", NODE), b"<html>\n"]))
    with pytest.raises(ApiError, match="not an event") as caught:
        list(api.watch_node("n1", resource_version=None, timeout_seconds=30))
    assert caught.value.status is None


def test_a_watch_ended_from_another_thread(fake: FakeApi, api: RestKubeApi) -> None:
    fake.answer = lambda seen: (
        (200, Stream([event("ADDED", NODE)], hold=30)) if seen.query else (200, NODE)
    )
    opened: list[Any] = []
    watch = api.watch_node("n1", resource_version=None, timeout_seconds=30, opened=opened.append)
    assert next(watch) == ("ADDED", NODE)
    started = time.monotonic()
    threading.Timer(0.2, opened[0].shutdown).start()
    assert list(watch) == []  # ended as the server ending it would, not as a failure
    assert time.monotonic() - started < 5
    opened[0].shutdown()  # again, and after the watch is over: harmless
    opened[0].close()
    assert api.read_node("n1") == NODE  # the pool still works


def test_ending_a_watch_that_is_over_is_harmless(fake: FakeApi, api: RestKubeApi) -> None:
    fake.answer = lambda seen: (200, Stream([event("ADDED", NODE)])) if seen.query else (200, NODE)
    opened: list[Any] = []
    assert len(list(api.watch_node("n1", resource_version=None, timeout_seconds=3,
                                   opened=opened.append))) == 1  # fmt: skip
    opened[0].shutdown()  # the connection went back to the pool: it must not be cut
    assert api.read_node("n1") == NODE
    assert len(fake.seen) == 2


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (409, {"kind": "Status", "reason": "Conflict", "message": "the object has been modified"},
         "HTTP 409: the object has been modified"),
        (404, b"<html>not here</html>", "HTTP 404: Not Found"),
        (403, {"kind": "Status"}, "HTTP 403: Forbidden"),
        (200, b"[1, 2]", "HTTP 200: the response is not a JSON object"),
    ],
)  # fmt: skip
def test_error_answers(
    fake: FakeApi, api: RestKubeApi, *, status: int, body: Any, message: str
) -> None:
    fake.answer = lambda seen: (status, body)
    with pytest.raises(ApiError) as caught:
        api.patch_node("n1", LABELS)
    assert (caught.value.status, str(caught.value)) == (status, message)


def test_connection_refused() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with client(f"http://127.0.0.1:{port}") as api, pytest.raises(ApiError) as caught:
        api.read_node("n1")
    assert caught.value.status is None
    assert "NewConnectionError" in str(caught.value)
    assert "refused" in str(caught.value)


def test_a_read_timeout(fake: FakeApi) -> None:
    fake.answer = lambda seen: (fake.closing.wait(1.0), (200, NODE))[1]
    with (
        client(fake.url, timeout=(5.0, 0.2)) as api,
        pytest.raises(ApiError, match="ReadTimeoutError") as caught,
    ):
        api.read_node("n1")
    assert caught.value.status is None


def test_a_rotated_token_is_reread_after_a_401(fake: FakeApi, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old")

    def answer(seen: Seen) -> Reply:
        if seen.headers.get("authorization") == "Bearer new":
            return 200, NODE
        return 401, {"kind": "Status", "code": 401, "message": "Unauthorized"}

    fake.answer = answer
    with client(fake.url, token_file=str(token)) as api:
        with pytest.raises(ApiError) as caught:
            api.read_node("n1")  # the same token after re-reading: no second try
        assert caught.value.status == 401
        assert len(fake.seen) == 1
        token.write_text("new\n")
        assert api.read_node("n1") == NODE
        assert [s.headers["authorization"] for s in fake.seen] == [
            "Bearer old", "Bearer old", "Bearer new",
        ]  # fmt: skip


def test_ipv6_server() -> None:
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    with running(host="::1") as fake, client(fake.url) as api:
        assert api.read_node("n1") == {"kind": "Node"}
        assert fake.seen[0].headers["host"] == fake.url.removeprefix("http://")


# --- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a serving certificate for 127.0.0.1 and localhost, and a client certificate."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl CLI makes the test certificates")
    pki = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=pki, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=rest-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    (pki / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject in (("server", "/CN=apiserver"), ("client", "/CN=agent/O=edl")):
        run("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", f"{name}.ext")  # fmt: skip
    return pki


@pytest.fixture
def tls_fake(pki: Path) -> Iterator[FakeApi]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.crt", pki / "server.key")
    context.load_verify_locations(pki / "ca.crt")
    context.verify_mode = ssl.CERT_REQUIRED  # only our client certificate gets in
    with running(context) as api:
        yield api


def client_cert(pki: Path, *, data: bool) -> dict[str, Any]:
    if data:
        return {
            "ca_data": (pki / "ca.crt").read_bytes(),
            "cert_data": (pki / "client.crt").read_bytes(),
            "key_data": (pki / "client.key").read_bytes(),
        }
    return {
        "ca_file": str(pki / "ca.crt"),
        "cert_file": str(pki / "client.crt"),
        "key_file": str(pki / "client.key"),
    }


@pytest.mark.parametrize("data", [True, False], ids=["pem-data", "files"])
def test_tls_with_a_client_certificate(tls_fake: FakeApi, pki: Path, *, data: bool) -> None:
    with client(tls_fake.url, **client_cert(pki, data=data)) as api:
        assert api.read_node("n1") == {"kind": "Node"}


def test_tls_server_name(tls_fake: FakeApi, pki: Path) -> None:
    with client(tls_fake.url, tls_server_name="localhost", **client_cert(pki, data=True)) as api:
        assert api.read_node("n1") == {"kind": "Node"}
    with client(tls_fake.url, tls_server_name="other.test", **client_cert(pki, data=True)) as api:
        with pytest.raises(ApiError, match="SSLError") as caught:
            api.read_node("n1")
        assert caught.value.status is None


def test_an_unknown_server_certificate(tls_fake: FakeApi, pki: Path) -> None:
    # The serving certificate checked against another CA: its client certificate's.
    credentials = {**client_cert(pki, data=False), "ca_file": str(pki / "client.crt")}
    with client(tls_fake.url, **credentials) as api, pytest.raises(ApiError) as caught:
        api.read_node("n1")
    assert caught.value.status is None
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_insecure_skip_tls_verify(tls_fake: FakeApi, pki: Path) -> None:
    credentials = {**client_cert(pki, data=True), "ca_data": None, "insecure": True}
    with client(tls_fake.url, **credentials) as api:
        assert api.read_node("n1") == {"kind": "Node"}


def test_no_client_certificate_is_refused(tls_fake: FakeApi, pki: Path) -> None:
    with client(tls_fake.url, ca_file=str(pki / "ca.crt")) as api, pytest.raises(ApiError) as c:
        api.read_node("n1")
    assert c.value.status is None


@pytest.mark.parametrize(
    ("credentials", "problem"),
    [
        ({"cert_file": "client.crt"}, "needs both the certificate and its key"),
        ({"cert_file": "client.crt", "key_file": "server.key"}, "KEY_VALUES_MISMATCH"),
        ({"ca_file": "absent.crt"}, "FileNotFoundError"),
        ({"ca_data": b"not a certificate"}, "SSLError"),
    ],
)
def test_unusable_tls_material(pki: Path, credentials: dict[str, Any], problem: str) -> None:
    files: dict[str, Any] = {
        k: str(pki / v) if k.endswith("_file") else v for k, v in credentials.items()
    }
    with pytest.raises(KubeConfigError, match=problem):
        RestKubeApi(Credentials(server="https://127.0.0.1:1", **files))


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "temporary-file"])
def test_client_certificate_data_leaves_no_file(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, memfd: bool
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if not memfd:
        monkeypatch.delattr(os, "memfd_create")
    context = Credentials(server="https://x", **client_cert(pki, data=True)).ssl_context()
    assert isinstance(context, ssl.SSLContext)
    assert list(tmp_path.iterdir()) == []


# --- rest_client ---------------------------------------------------------------------------------


def test_rest_client_from_kubeconfig_files(fake: FakeApi, tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "config", cluster={"server": fake.url}, user={"token": "k"})
    api = rest_client([tmp_path / "absent", path], environ={})
    assert api is not None
    try:
        assert api.read_node("n1") == {"kind": "Node"}
    finally:
        api.close()
    assert fake.seen[0].headers["authorization"] == "Bearer k"


def test_rest_client_in_cluster(tls_fake: FakeApi, pki: Path, tmp_path: Path) -> None:
    port = urlsplit(tls_fake.url).port
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
    (tmp_path / "token").write_text("sa-token")
    api = rest_client(None, environ=environ, token_file=str(tmp_path / "token"),
                      ca_file=str(pki / "ca.crt"))  # fmt: skip
    assert api is not None
    api.close()
    with pytest.raises(KubeConfigError, match="token"):
        rest_client(None, environ=environ, token_file=str(tmp_path / "absent"),
                    ca_file=str(pki / "ca.crt"))  # fmt: skip


PROXY = "http://proxy:3128"


@pytest.mark.parametrize(
    ("environ", "by_name", "by_address"),
    [
        ({}, False, False),
        ({"HTTPS_PROXY": PROXY}, True, True),
        ({"ALL_PROXY": "socks5://proxy"}, True, True),
        ({"http_proxy": PROXY}, False, False),  # not for https
        ({"https_proxy": PROXY, "no_proxy": "example.com, 10.0.0.0/8"}, True, False),
        ({"https_proxy": PROXY, "NO_PROXY": ".internal"}, False, True),
        ({"https_proxy": PROXY, "no_proxy": "k8s.internal,10.1.2.3"}, False, False),
        ({"https_proxy": PROXY, "no_proxy": "*"}, False, False),
        ({"https_proxy": PROXY, "no_proxy": "other.internal,10.1.2.30"}, True, True),
    ],
)
def test_a_proxy_from_the_environment_means_none(
    environ: dict[str, str], *, by_name: bool, by_address: bool
) -> None:
    assert kube_rest._proxied("https://api.k8s.internal:6443", environ) is by_name
    assert kube_rest._proxied("https://10.1.2.3:6443", environ) is by_address


def test_rest_client_gives_none_behind_a_proxy(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "config", user={"token": "k"})
    assert rest_client([path], environ={"HTTPS_PROXY": PROXY}) is None


# --- what the agent gets -------------------------------------------------------------------------


def test_the_same_calls_as_kube_api() -> None:
    def methods(cls: type) -> dict[str, list[tuple[str, Any, Any]]]:
        return {
            name: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
            for name, f in vars(cls).items()
            if callable(f) and not name.startswith("_")
        }

    assert methods(RestKubeApi) == methods(KubeApi)


def test_importing_it_loads_no_kubernetes_package() -> None:
    code = (
        "import sys, edl_agent.kube_rest; "
        "print([m for m in sys.modules if m.split('.')[0] == 'kubernetes'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
