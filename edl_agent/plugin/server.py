"""One gRPC server per resource on its own unix socket, and registration with kubelet."""

from __future__ import annotations

import contextlib
import hashlib
import re
from concurrent import futures
from pathlib import Path

import grpc

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from edl_agent.config import PluginSettings
from edl_agent.plugin.service import DevicePluginService, plugin_options

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
SOCKET_PREFIX = "edl-"
# Enough workers for kubelet's calls plus one long-lived ListAndWatch stream per connection.
MAX_WORKERS = 8


# sun_path holds 108 bytes; gRPC refuses paths near that limit, so keep a margin.
MAX_SOCKET_PATH = 100
UNIX_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL


def socket_path(directory: Path, resource: str) -> Path:
    """`nvidia.com/gpu` → `<dir>/edl-nvidia.com_gpu.sock`; its base name is kubelet's endpoint.

    A path too long for a unix socket gets a short name derived from a hash of the resource.
    """
    readable = directory / f"{SOCKET_PREFIX}{re.sub(r'[^A-Za-z0-9._-]', '_', resource)}.sock"
    if len(str(readable).encode()) <= MAX_SOCKET_PATH:
        return readable
    digest = hashlib.sha256(resource.encode()).hexdigest()[:12]
    return directory / f"{SOCKET_PREFIX}{digest}.sock"


def socket_dir_problem(directory: Path) -> str | None:
    """Why `directory` cannot hold our sockets and kubelet's (None: it can): a unix socket's
    path is limited to 107 bytes, and even our shortest names would not fit."""
    longest = max(
        len(str(socket_path(directory, "/" * (MAX_SOCKET_PATH + 1))).encode()),
        len(str(directory / "kubelet.sock").encode()),
    )
    if longest <= UNIX_PATH_MAX:
        return None
    return (
        f"kubelet directory {directory} is too long for unix sockets: its socket paths would "
        f"be {longest} bytes, the limit is {UNIX_PATH_MAX}; use a shorter path"
    )


class PluginServer:
    """Serves DevicePluginService for one resource on `socket_path(directory, resource)`."""

    def __init__(self, service: DevicePluginService, directory: Path) -> None:
        self.service = service
        self.path = socket_path(directory, service.resource)
        self._executor: futures.ThreadPoolExecutor | None = None
        self._server: grpc.Server | None = None
        # The socket file we bound, as (device, inode, ctime): an inode number alone is reused
        # at once by the file that replaces ours.
        self._identity: tuple[int, int, int] | None = None

    @property
    def resource(self) -> str:
        return self.service.resource

    def start(self) -> None:
        """Bind and serve; returns once the socket accepts connections."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._executor = futures.ThreadPoolExecutor(
            max_workers=MAX_WORKERS, thread_name_prefix=f"plugin-{self.resource}"
        )
        self._server = grpc.server(self._executor)
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.service, self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"unix://{self.path}")
        self._server.start()
        self._identity = _identity(self.path)  # None: removed at once (kubelet cleaning up)

    def serving(self) -> bool:
        """False when our socket file is gone or replaced (kubelet removes them on restart)."""
        return self._server is not None and _identity(self.path) == self._identity

    def stop(self, grace: float = 0.5) -> None:
        """Stop serving, end the watch streams, release the threads and remove our socket."""
        self.service.stop()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        with contextlib.suppress(FileNotFoundError):
            if self._identity is not None and _identity(self.path) == self._identity:
                self.path.unlink()
        self._identity = None


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_ctime_ns)


def register(
    kubelet_socket: Path, *, resource: str, endpoint: str, settings: PluginSettings, timeout: float
) -> None:
    """Register one resource with kubelet; raises grpc.RpcError when kubelet refuses or is away."""
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        stub.Register(
            api_pb2.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource,
                options=plugin_options(settings),
            ),
            timeout=timeout,
            wait_for_ready=False,
        )
