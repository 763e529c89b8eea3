"""The Kubernetes API adapter: building a client, and the few calls the node agent makes.

Where the credentials come from, first match wins:
1. the kubeconfig given explicitly (`run --kubeconfig`, `node.kubeconfig`, the restarter's
   `--kubeconfig`);
2. `$KUBECONFIG` (files separated by `:` are merged, files that do not exist are skipped, as
   kubectl does);
3. the pod's service account, when running in a cluster (`KUBERNETES_SERVICE_HOST` and the
   mounted token; the token is re-read as kubelet rotates it);
4. nothing: `kube_rest.connect()` returns None and the agent only logs what it would write.
A kubeconfig that is named but missing or broken is an error, never a silent fallback to the
next source. With `ambient=False` (the agent under --simulate) only 1 is used: a simulated node
must not label a real cluster's node because a shell or a pod happened to hold credentials.
`~/.kube/config` is never read.

Objects go in and come out as plain JSON dicts; API errors become `ApiError` with the HTTP status.

The node agent's client (`kube_rest.connect`, the `NodeApi` calls) is our own `kube_rest`
wherever it serves the credentials; the kubernetes package (`api_client`, `KubeApi`, the
restarter's client) is imported only when it is used: it takes about half a second and 35 MiB to
load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edl_agent.kube_errors import ApiError as ApiError  # noqa: PLC0414 - callers import it from here
from edl_agent.kubeconfig_check import kubeconfig_problem, read_documents

if TYPE_CHECKING:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read
KUBECONFIG_ENV = "KUBECONFIG"
CONFLICT = 409
NOT_FOUND = 404
GONE = 410
# Where a pod finds its service account (the kubernetes client's in-cluster loader reads these).
SERVICE_HOST_ENV_NAME = "KUBERNETES_SERVICE_HOST"
SERVICE_TOKEN_FILENAME = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # noqa: S105
SERVICE_CERT_FILENAME = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


class Closable(Protocol):
    """A streaming response another thread may end (urllib3's HTTPResponse)."""

    def close(self) -> None: ...


class KubeConfigError(Exception):
    """The configured credentials cannot be used; the message says why."""


def kubeconfig_to_use(
    kubeconfig: str, *, name: str, environ: Mapping[str, str], ambient: bool
) -> tuple[str, str] | None:
    """(the kubeconfig to load, what to call it in errors): the explicit one, else $KUBECONFIG
    when `ambient`; None: the in-cluster service account (when `ambient`) or nothing. Pure."""
    if kubeconfig:
        return kubeconfig, name
    if ambient and environ.get(KUBECONFIG_ENV, "").strip(os.pathsep + " "):
        return environ[KUBECONFIG_ENV], f"${KUBECONFIG_ENV}"
    return None


def api_client(
    kubeconfig: str,
    *,
    name: str = "node.kubeconfig",
    environ: Mapping[str, str] | None = None,
    ambient: bool = True,
    token_file: str = SERVICE_TOKEN_FILENAME,
    ca_file: str = SERVICE_CERT_FILENAME,
    connections: int | None = None,
) -> client.ApiClient | None:
    """A client from the explicit kubeconfig (`name` says where it was given), else $KUBECONFIG,
    else the in-cluster service account, else None; with `ambient=False` only the explicit one.
    `connections`: the most connections it keeps open (each watch holds one)."""
    env = os.environ if environ is None else environ
    chosen = kubeconfig_to_use(kubeconfig, name=name, environ=env, ambient=ambient)
    in_cluster = (
        chosen is None
        and ambient
        and bool(env.get(SERVICE_HOST_ENV_NAME))
        and is_file(Path(token_file))
    )
    if chosen is None and not in_cluster:
        return None
    if chosen is not None:
        check_exists(*chosen, explicit=bool(kubeconfig))
    from kubernetes import client
    from kubernetes import config as kube_config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    if connections is not None:
        configuration.connection_pool_maxsize = connections
    if chosen is not None:
        return _from_kubeconfig(*chosen, configuration, explicit=bool(kubeconfig))
    try:
        loader = InClusterConfigLoader(token_file, ca_file, environ=env)  # type: ignore[no-untyped-call]
        loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
    except kube_config.ConfigException as exc:
        msg = f"in-cluster service account: {exc}"
        raise KubeConfigError(msg) from None
    return client.ApiClient(configuration)


def check_credentials(
    kubeconfig: str,
    *,
    name: str = "node.kubeconfig",
    environ: Mapping[str, str] | None = None,
    ambient: bool = True,
) -> None:
    """KubeConfigError when the kubeconfig `api_client` would load is missing or cannot work,
    found without importing the kubernetes client (see kubeconfig_check)."""
    env = os.environ if environ is None else environ
    chosen = kubeconfig_to_use(kubeconfig, name=name, environ=env, ambient=ambient)
    if chosen is None:
        return
    path, said = chosen
    check_exists(path, said, explicit=bool(kubeconfig))
    files = kubeconfig_files(path, explicit=bool(kubeconfig))
    try:
        problem = kubeconfig_problem(read_documents([Path(f).expanduser() for f in files]))
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        msg = f"{said}: cannot use {path}: {problem}"
        raise KubeConfigError(msg)


def kubeconfig_files(path: str, *, explicit: bool) -> list[str]:
    """An explicit kubeconfig is one file; $KUBECONFIG may list several, as for kubectl."""
    return [path] if explicit else [p for p in path.split(os.pathsep) if p.strip()]


def check_exists(path: str, name: str, *, explicit: bool) -> None:
    """KubeConfigError unless the kubeconfig (one of $KUBECONFIG's files) is a file."""
    files = kubeconfig_files(path, explicit=explicit)
    if not any(is_file(Path(f).expanduser()) for f in files):
        if len(files) > 1:
            msg = f"{name}: none of {path} exists"
        elif _exists(Path(path)):
            msg = f"{name}: {path} is not a file"
        else:
            msg = f"{name}: {path} does not exist"
        raise KubeConfigError(msg)


def _from_kubeconfig(
    path: str, name: str, configuration: client.Configuration, *, explicit: bool
) -> client.ApiClient:
    import yaml
    from kubernetes import client as kube_client
    from kubernetes import config as kube_config
    from kubernetes.config import kube_config as loader_files

    try:
        kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=configuration, persist_config=False
        )
        _keep_in_memory(configuration, loader_files._temp_files)
        api: client.ApiClient = kube_client.ApiClient(configuration=configuration)
    except (
        kube_config.ConfigException,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        OSError,
        yaml.YAMLError,
        RecursionError,
    ) as exc:
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        msg = f"{name}: cannot use {path}: {why}"
        raise KubeConfigError(msg) from None
    return api


def _keep_in_memory(configuration: client.Configuration, copies: dict[str, str]) -> None:
    """The kubernetes client writes a kubeconfig's certificate-authority-data (and client
    certificate and key data) to temporary files that only a clean exit removes: a killed agent
    would leave them behind. Each moves into an anonymous memory file kept for the process's
    life, and the copy on disk goes at once. `copies` is the loader's record of its files (by
    content), which must not hand out a removed one again. Where memory files are unavailable the
    copies stay, as the client made them."""
    made = set(copies.values())
    for field in ("ssl_ca_cert", "cert_file", "key_file"):
        path = getattr(configuration, field, None)
        if not path or path not in made:
            continue
        try:
            fd = os.memfd_create(f"kubeconfig-{field}", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return
        with open(path, "rb") as copy:  # noqa: PTH123 - the client's own file
            os.write(fd, copy.read())
        setattr(configuration, field, f"/proc/self/fd/{fd}")
        os.unlink(path)  # noqa: PTH108
        for key in [key for key, value in copies.items() if value == path]:
            del copies[key]


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a directory on the way we may not search
        return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return True


class NodeApi(Protocol):
    """The calls the node agent makes (`KubeApi`, and `kube_rest.RestKubeApi` without the
    kubernetes package)."""

    def close(self) -> None: ...

    def read_node(self, name: str) -> dict[str, Any]: ...

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...

    def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...

    def create_event(self, namespace: str, event: Mapping[str, Any]) -> dict[str, Any]: ...

    def patch_event(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    def watch_node(
        self,
        name: str,
        *,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]: ...

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        """Any call with a JSON object in and out: `path` from the server's root
        (`/apis/resource.k8s.io/v1/resourceslices`), `query` its parameters, `content_type` the
        body's (JSON unless given). ApiError on a failure, with the HTTP status."""
        ...

    def list_pods(self, field_selector: str) -> dict[str, Any]: ...

    def watch_pods(
        self,
        field_selector: str,
        *,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]: ...


class KubeApi:
    """The calls the node agent makes, on one ApiClient."""

    def __init__(self, api: client.ApiClient) -> None:
        from kubernetes import client

        self.api = api
        # Typed as Any: with `_preload_content=False` the calls return the raw HTTP response,
        # which the client's annotations do not describe.
        self._core: Any = client.CoreV1Api(api)

    def close(self) -> None:
        self.api.close()  # type: ignore[no-untyped-call]

    def read_node(self, name: str) -> dict[str, Any]:
        return self._call(self._core.read_node, name)

    def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the Node (with `metadata.resourceVersion`: a precondition)."""
        return self._call(self._core.patch_node, name, dict(patch), _content_type=MERGE_PATCH)

    def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of nodes/status: conditions merge by `type`."""
        return self._call(
            self._core.patch_node_status, name, dict(patch), _content_type=STRATEGIC_MERGE_PATCH
        )

    def create_event(self, namespace: str, event: Mapping[str, Any]) -> dict[str, Any]:
        return self._call(self._core.create_namespaced_event, namespace, dict(event))

    def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._call(
            self._core.patch_namespaced_event,
            name,
            namespace,
            dict(patch),
            _content_type=MERGE_PATCH,
        )

    def watch_node(
        self,
        name: str,
        *,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, object) for one Node until the server ends the watch. Needs only `watch` on
        nodes (the name is a field selector). A 410 (too old a version) raises ApiError(410).
        `opened` gets the connection: closing it from another thread ends the watch."""
        return watch_events(
            self._core.list_node,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            opened=opened,
        )

    def list_pods(self, field_selector: str) -> dict[str, Any]:
        """A PodList across namespaces (`items`, `metadata.resourceVersion`); needs `list`."""
        return self._call(self._core.list_pod_for_all_namespaces, field_selector=field_selector)

    def watch_pods(
        self,
        field_selector: str,
        *,
        resource_version: str | None,
        timeout_seconds: int,
        opened: Callable[[Closable], None] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, object) for the pods matching `field_selector` in every namespace, as
        `watch_node`; BOOKMARK events carry only `metadata.resourceVersion`."""
        return watch_events(
            self._core.list_pod_for_all_namespaces,
            field_selector=field_selector,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            opened=opened,
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
        """Any call with a JSON object in and out (`NodeApi.request`), on the ApiClient's
        connections and credentials."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        try:
            status, data = self._send(method, path, dict(body) if body is not None else None,
                                      list((query or {}).items()), headers)  # fmt: skip
        except ApiException as exc:
            raise ApiError(exc.status or None, _message(exc)) from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            raise ApiError(None, f"{type(exc).__name__}: {exc}") from None
        try:
            decoded = json.loads(data)
        except ValueError:
            decoded = None
        if not 200 <= status <= 299:
            message = decoded.get("message") if isinstance(decoded, dict) else None
            raise ApiError(status, str(message or f"status {status}"))
        if not isinstance(decoded, dict):
            raise ApiError(status, "the response is not a JSON object")
        return decoded

    def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        query: list[tuple[str, str]],
        headers: dict[str, str],
    ) -> tuple[int, bytes]:
        """(status, body) of one request, through whichever request API this version of the
        kubernetes package has: `param_serialize` (v34 on) or the older `call_api`."""
        # Typed as Any: the two request APIs cannot both match the installed package's stubs.
        api: Any = self.api
        if hasattr(api, "param_serialize"):
            serialized = api.param_serialize(
                method, path, query_params=query, header_params=headers, body=body,
                auth_settings=["BearerToken"],
            )  # fmt: skip
            response = api.call_api(*serialized, _request_timeout=REQUEST_TIMEOUT)
            return int(response.status), bytes(response.read())
        raw = api.call_api(
            path, method, query_params=query, header_params=headers, body=body,
            auth_settings=["BearerToken"], _preload_content=False,
            _return_http_data_only=True, _request_timeout=REQUEST_TIMEOUT,
        )  # fmt: skip
        return int(raw.status), bytes(raw.data)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return call_json(method, *args, **kwargs)


def watch_events(
    list_method: Any,
    *,
    resource_version: str | None,
    timeout_seconds: int,
    opened: Callable[[Closable], None] | None = None,
    **params: Any,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, object) from a watch through a kubernetes client list method (`params`: its
    namespace-free arguments such as field_selector) until the server ends it; ApiError on a
    failure, ApiError(410) when the version is too old. `opened` gets the connection: closing
    it from another thread ends the watch."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        response = list_method(
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            _preload_content=False,
            _request_timeout=(REQUEST_TIMEOUT[0], timeout_seconds + 30),
            **params,
        )
    except ApiException as exc:
        raise ApiError(exc.status, _message(exc)) from None
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        raise ApiError(None, f"{type(exc).__name__}: {exc}") from None
    if opened is not None:
        opened(response)
    try:
        for line in response:
            if not line.strip():
                continue
            event = json.loads(line)
            kind, body = str(event.get("type")), event.get("object") or {}
            if kind == "ERROR":
                raise ApiError(body.get("code"), str(body.get("message", "watch error")))
            yield kind, body
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        raise ApiError(None, f"watch broke: {type(exc).__name__}: {exc}") from None
    finally:
        response.release_conn()


def call_json(method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call a kubernetes client method and return the decoded JSON body; `ApiError` on any
    failure (an HTTP error status, or none: refused, TLS, timeouts)."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        response = method(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    except ApiException as exc:
        raise ApiError(exc.status, _message(exc)) from None
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        raise ApiError(None, f"{type(exc).__name__}: {exc}") from None
    data: dict[str, Any] = json.loads(response.data)
    return data


def _message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason or exc)
