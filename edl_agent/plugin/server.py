"""One gRPC server per resource on its own unix socket, and registration with kubelet."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import grpc

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from edl_agent.config import PluginSettings
from edl_agent.plugin.service import DevicePluginService, plugin_options
from edl_agent.unix_server import UnixSocketServer

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
        self._socket = UnixSocketServer(
            self.path, workers=MAX_WORKERS, thread_prefix=f"plugin-{service.resource}"
        )

    @property
    def resource(self) -> str:
        return self.service.resource

    def start(self) -> None:
        """Bind and serve; returns once the socket accepts connections."""
        self._socket.start([(api_pb2_grpc.add_DevicePluginServicer_to_server, self.service)])

    def serving(self) -> bool:
        """False when our socket file is gone or replaced (kubelet removes them on restart)."""
        return self._socket.serving()

    def stop(self, grace: float = 0.5) -> None:
        """Stop serving, end the watch streams, release the threads and remove our socket."""
        self.service.stop()
        self._socket.stop(grace)


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
