"""The node agent's calls to the Kubernetes API over plain HTTPS: urllib3 and the stdlib only.

`RestKubeApi` has `kube.KubeApi`'s methods and meaning (JSON dicts in and out, every failure an
`ApiError`) without the kubernetes client package, which costs the agent about 0.4 s and 35 MiB
to import for eight calls. Nothing here imports it, not even lazily.

Credentials come from kubeconfig documents (merged as kubectl merges $KUBECONFIG) or from the
pod's service account; which of those to use is `kube`'s decision. What is not implemented here
makes `Credentials.from_kubeconfig` / `rest_client` return None, so that the caller falls back to
the kubernetes package: `exec` and `auth-provider` users, a cluster's `proxy-url`, and a proxy
from the environment (`https_proxy` or `all_proxy`, not bypassed by `no_proxy`). Impersonation
(`as`) is ignored, as the kubernetes package ignores it.
A bearer token file (the in-cluster token, a kubeconfig `tokenFile`) is re-read at most once a
minute and after a 401, as client-go does: kubelet rotates projected tokens.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import urllib3

from edl_agent.kube import (
    MERGE_PATCH,
    REQUEST_TIMEOUT,
    SERVICE_CERT_FILENAME,
    SERVICE_HOST_ENV_NAME,
    SERVICE_TOKEN_FILENAME,
    STRATEGIC_MERGE_PATCH,
    ApiError,
    Closable,
    KubeApi,
    KubeConfigError,
    NodeApi,
    api_client,
    check_exists,
    is_file,
    kubeconfig_files,
    kubeconfig_to_use,
)
from edl_agent.kube_credentials import Credentials, TokenFile
from edl_agent.kubeconfig_check import read_documents

USER_AGENT = "edl-agent"
UNAUTHORIZED = 401
Event = tuple[str, dict[str, Any]]


class _Stream:
    """The open watch response as `opened` gets it: another thread may end it at any time,
    even after the watch is over (a released connection belongs to the pool again)."""

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self._response = response
        self._lock = threading.Lock()
        self._done = False
        self.ended = False

    def shutdown(self) -> None:
        with self._lock:
            self.ended = True
            if not self._done:
                with contextlib.suppress(ValueError, RuntimeError, OSError):
                    self._response.shutdown()  # unblocks the reading thread

    close = shutdown

    def finish(self, *, clean: bool) -> None:
        with self._lock:
            self._done = True
            if not clean:
                self._response.close()  # a half-read or shut down connection is not reusable
            self._response.release_conn()


class RestKubeApi:
    """`kube.KubeApi`'s calls, made directly on one connection pool."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        connections: int = 4,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
    ) -> None:
        self._timeout = timeout  # (connect, read) seconds: `node.api_*_timeout_seconds`
        parts = urlsplit(credentials.server)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            msg = f"server {credentials.server!r} is not an http(s) URL"
            raise KubeConfigError(msg)
        try:
            port = parts.port
        except ValueError as exc:
            msg = f"server {credentials.server!r}: {exc}"
            raise KubeConfigError(msg) from None
        self._prefix = parts.path.rstrip("/")
        self._token_file = TokenFile(credentials.token_file) if credentials.token_file else None
        self._fixed_auth = _fixed_authorization(credentials)
        self._pool: urllib3.HTTPConnectionPool
        if parts.scheme == "https":
            self._pool = urllib3.HTTPSConnectionPool(
                parts.hostname,
                port or 443,
                maxsize=connections,
                retries=False,
                ssl_context=credentials.ssl_context(),
                server_hostname=credentials.tls_server_name,
                assert_hostname=False if credentials.insecure else None,
            )
        else:
            self._pool = urllib3.HTTPConnectionPool(
                parts.hostname, port or 80, maxsize=connections, retries=False
            )

    def close(self) -> None:
        self._pool.close()

    def read_node(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/api/v1/nodes/{quote(name, safe='')}")

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the Node (with `metadata.resourceVersion`: a precondition)."""
        return self._json("PATCH", f"/api/v1/nodes/{quote(name, safe='')}", patch, MERGE_PATCH)

    def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of nodes/status: conditions merge by `type`."""
        path = f"/api/v1/nodes/{quote(name, safe='')}/status"
        return self._json("PATCH", path, patch, STRATEGIC_MERGE_PATCH)

    def create_event(self, namespace: str, event: Mapping[str, Any]) -> dict[str, Any]:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/events"
        return self._json("POST", path, event, "application/json")

    def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/events/{quote(name, safe='')}"
        return self._json("PATCH", path, patch, MERGE_PATCH)

    def watch_node(
        self,
        name: str,
        *,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None = None,
    ) -> Iterator[Event]:
        """(type, object) for one Node until the server ends the watch (`kube.KubeApi`)."""
        return self._watch(
            "/api/v1/nodes", f"metadata.name={name}", resource_version, timeout_seconds, opened
        )

    def list_pods(self, field_selector: str) -> dict[str, Any]:
        """A PodList across namespaces (`items`, `metadata.resourceVersion`)."""
        return self._json("GET", "/api/v1/pods", query={"fieldSelector": field_selector})

    def watch_pods(
        self,
        field_selector: str,
        *,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None = None,
    ) -> Iterator[Event]:
        """(type, object) for the pods matching `field_selector` in every namespace."""
        return self._watch(
            "/api/v1/pods", field_selector, resource_version, timeout_seconds, opened
        )

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """Any call with a JSON object in and out (`kube.NodeApi.request`)."""
        if body is not None and content_type is None:
            content_type = "application/json"
        return self._json(method, path, body, content_type, query)

    def _json(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content_type: str | None = None,
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        payload = None if body is None else json.dumps(dict(body)).encode()
        response = self._send(method, path, query=query, payload=payload, content_type=content_type)
        try:
            data = json.loads(response.data)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ApiError(response.status, "the response is not a JSON object")
        return data

    def _watch(
        self,
        path: str,
        field_selector: str,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None,
    ) -> Iterator[Event]:
        query = {
            "fieldSelector": field_selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if resource_version is not None:
            query["resourceVersion"] = resource_version
        response = self._send(
            "GET", path, query=query, read_timeout=timeout_seconds + 30, stream=True
        )
        stream = _Stream(response)
        if opened is not None:
            opened(stream)
        clean = False
        try:
            for line in response:
                if line.strip():
                    kind, body = _event(line)
                    if kind == "ERROR":
                        raise ApiError(body.get("code"), str(body.get("message", "watch error")))
                    yield kind, body
            clean = True
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            if not stream.ended:  # else our owner ended it: a normal end
                raise ApiError(None, f"watch broke: {type(exc).__name__}: {exc}") from None
        finally:
            stream.finish(clean=clean and not stream.ended)

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        payload: bytes | None = None,
        content_type: str | None = None,
        read_timeout: float | None = None,
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        """The response to a request; ApiError for an error status or none at all. A 401 with
        a token file re-reads the file and, when the token changed, tries once more."""
        url = self._prefix + path + (f"?{urlencode(query)}" if query else "")
        connect, read = self._timeout
        timeout = urllib3.Timeout(
            connect=connect, read=read if read_timeout is None else read_timeout
        )
        while True:
            headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
            authorization = self._authorization()
            if authorization:
                headers["Authorization"] = authorization
            if content_type:
                headers["Content-Type"] = content_type
            try:
                response = self._pool.urlopen(
                    method,
                    url,
                    body=payload,
                    headers=headers,
                    timeout=timeout,
                    retries=False,
                    redirect=False,
                    preload_content=not stream,
                )
                if response.status < 400:
                    return response
                data = response.data  # reads the rest of a streamed response
                response.release_conn()
            except (OSError, urllib3.exceptions.HTTPError) as exc:
                raise ApiError(None, f"{type(exc).__name__}: {exc}") from None
            if not (
                response.status == UNAUTHORIZED
                and self._token_file is not None
                and self._token_file.reread()
            ):
                raise ApiError(response.status, _message(response.status, response.reason, data))

    def _authorization(self) -> str | None:
        if self._token_file is not None:
            return f"Bearer {self._token_file.get()}"
        return self._fixed_auth


def _fixed_authorization(credentials: Credentials) -> str | None:
    if credentials.token:
        return f"Bearer {credentials.token}"
    if credentials.username is not None and credentials.password is not None:
        pair = f"{credentials.username}:{credentials.password}".encode()
        return f"Basic {base64.b64encode(pair).decode()}"
    return None


def _event(line: bytes) -> Event:
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict) or not isinstance(event.get("object") or {}, dict):
        raise ApiError(None, f"watch: not an event: {line[:200]!r}")
    return str(event.get("type")), event.get("object") or {}


def _message(status: int, reason: str | None, data: bytes) -> str:
    """The Status object's message, else the reason phrase."""
    try:
        message = json.loads(data)["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    return str(message) if message else reason or f"status {status}"


def read_kubeconfigs(paths: Sequence[Path]) -> list[tuple[Path, object]]:
    """(file, parsed YAML) for each of `paths` that is a file; ValueError when one is broken."""
    return [(path, read_documents([path])[0]) for path in paths if path.is_file()]


def rest_client(
    kubeconfig_paths: Sequence[Path] | None,
    *,
    environ: Mapping[str, str],
    token_file: str = SERVICE_TOKEN_FILENAME,
    ca_file: str = SERVICE_CERT_FILENAME,
    connections: int = 4,
    timeout: tuple[float, float] = REQUEST_TIMEOUT,
) -> RestKubeApi | None:
    """A client from these kubeconfig files (merged in order), or with None from the in-cluster
    service account. None: only the kubernetes package can serve these credentials (see the
    module's docstring). KubeConfigError: they cannot work at all. `environ`: the process's
    environment (the service host and port, proxy variables)."""
    if kubeconfig_paths is None:
        credentials: Credentials | None = Credentials.from_service_account(
            environ, token_file, ca_file
        )
    else:
        try:
            documents = read_kubeconfigs(kubeconfig_paths)
        except ValueError as exc:
            raise KubeConfigError(str(exc)) from None
        credentials = Credentials.from_kubeconfig(documents)
    if credentials is None or _proxied(credentials.server, environ):
        return None
    return RestKubeApi(credentials, connections=connections, timeout=timeout)


def _proxied(server: str, environ: Mapping[str, str]) -> bool:
    """Whether the environment sends requests for `server` through a proxy (the variables and
    `no_proxy` rules the kubernetes package follows): not implemented here."""
    parts = urlsplit(server)
    names = (f"{parts.scheme}_proxy", "all_proxy")
    if not any(environ.get(n) or environ.get(n.upper()) for n in names):
        return False
    host, netloc = (parts.hostname or "").lower(), parts.netloc.lower()
    for rule in (environ.get("no_proxy") or environ.get("NO_PROXY") or "").lower().split(","):
        domain = rule.strip().lstrip(".")
        if rule.strip() == "*" or _in_network(host, rule.strip()):
            return False
        if domain and (host == domain or host.endswith(f".{domain}") or netloc == domain):
            return False
    return True


def _in_network(host: str, rule: str) -> bool:
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network(rule, strict=False)
    except ValueError:
        return False


def connect(
    kubeconfig: str,
    *,
    environ: Mapping[str, str] | None = None,
    ambient: bool = True,
    token_file: str = SERVICE_TOKEN_FILENAME,
    ca_file: str = SERVICE_CERT_FILENAME,
    timeout: tuple[float, float] = REQUEST_TIMEOUT,
    name: str = "node.kubeconfig",
) -> NodeApi | None:
    """The node agent's API client, from the same credentials as `api_client`: our own thin
    client where it serves them, else the kubernetes package's (exec and auth-provider users,
    proxies). None: no credentials. `timeout`: (connect, read) seconds of our own client's
    requests. `name`: what errors call an explicit kubeconfig."""
    env = os.environ if environ is None else environ
    chosen = kubeconfig_to_use(kubeconfig, name=name, environ=env, ambient=ambient)
    if chosen is not None:
        path, said = chosen
        check_exists(path, said, explicit=bool(kubeconfig))
        files = kubeconfig_files(path, explicit=bool(kubeconfig))
        try:
            rest = rest_client([Path(f).expanduser() for f in files], environ=env, timeout=timeout)
        except KubeConfigError as exc:
            msg = f"{said}: cannot use {path}: {exc}"
            raise KubeConfigError(msg) from None
    elif ambient and env.get(SERVICE_HOST_ENV_NAME) and is_file(Path(token_file)):
        rest = rest_client(
            None, environ=env, token_file=token_file, ca_file=ca_file, timeout=timeout
        )
    else:
        return None
    if rest is not None:
        return rest
    api = api_client(
        kubeconfig, name=name, environ=env, ambient=ambient, token_file=token_file, ca_file=ca_file
    )
    return None if api is None else KubeApi(api)
