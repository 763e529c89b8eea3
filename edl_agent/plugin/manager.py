"""Keeps one registered plugin server per advertised resource, through kubelet restarts.

Kubelet deletes every socket in its device-plugin directory when it restarts and then creates a
new `kubelet.sock`. `sync()` (called every tick) notices both — our socket gone, kubelet's socket
replaced — re-serves what is missing and registers again, retrying with backoff while kubelet is
away. Resources that appear or vanish on re-discovery get servers started or stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from edl_agent.config import PluginSettings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.state import DeviceState
from edl_agent.plugin.server import KUBELET_SOCKET, PluginServer, register
from edl_agent.plugin.service import DevicePluginService
from edl_agent.runtime.backoff import Backoff

FIRST_RETRY_SECONDS = 0.1
MAX_RETRY_SECONDS = 5.0
REGISTER_TIMEOUT_SECONDS = 2.0


@dataclass
class Counters:
    registrations: int = 0
    registration_failures: int = 0
    server_restarts: int = 0


@dataclass
class _Registration:
    due: float = 0.0
    backoff: Backoff = field(
        default_factory=lambda: Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS)
    )
    done: bool = False


@dataclass
class _Plugin:
    server: PluginServer
    registration: _Registration = field(default_factory=_Registration)


class PluginManager:
    def __init__(
        self,
        *,
        settings: PluginSettings,
        state: DeviceState,
        root: HostRoot,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._state = state
        self._root = root
        self._clock = clock
        self.directory = Path(settings.kubelet_dir)
        self.kubelet_socket = self.directory / KUBELET_SOCKET
        self._plugins: dict[str, _Plugin] = {}
        self._kubelet_identity: tuple[int, int] | None = None
        self._synced_once = False
        self.counters = Counters()
        self._log = structlog.get_logger().bind(kubelet_dir=str(self.directory))

    @property
    def resources(self) -> list[str]:
        return sorted(self._plugins)

    def unserved(self) -> list[str]:
        """The node's resources without a socket served for them now (any thread)."""
        wanted = set(self._state.snapshot().resources)
        plugins = dict(self._plugins)
        return sorted(r for r in wanted if r not in plugins or not plugins[r].server.serving())

    @property
    def registering(self) -> bool:
        """True while kubelet is there and some resource still waits to be registered (its
        retries are due on the tick)."""
        return self._kubelet_identity is not None and any(
            not plugin.registration.done for plugin in self._plugins.values()
        )

    def sync(self) -> None:
        """Converge servers and registrations on the current inventory and kubelet."""
        self.directory.mkdir(parents=True, exist_ok=True)
        wanted = set(self._state.snapshot().resources)
        for resource in sorted(set(self._plugins) - wanted):
            self._log.info("resource gone, stopping its server", resource=resource)
            self._plugins.pop(resource).server.stop()
        for resource in sorted(wanted - set(self._plugins)):
            self._plugins[resource] = _Plugin(self._start_server(resource))
        for resource, plugin in self._plugins.items():
            if not plugin.server.serving():
                self._log.warning("plugin socket gone, serving again", resource=resource)
                self.counters.server_restarts += 1
                plugin.server.stop(grace=0)
                plugin.server = self._start_server(resource)
                plugin.registration = _Registration()
        identity = self._kubelet_socket_identity()
        if identity != self._kubelet_identity or not self._synced_once:
            if identity is not None:
                self._log.info("kubelet socket appeared, registering", plugins=len(self._plugins))
            else:
                self._log.info("waiting for kubelet", socket=str(self.kubelet_socket))
            self._synced_once = True
            self._kubelet_identity = identity
            for plugin in self._plugins.values():
                plugin.registration = _Registration()
        if identity is not None:
            self._register_due()

    def close(self) -> None:
        for plugin in self._plugins.values():
            plugin.server.stop()
        self._plugins.clear()

    def _start_server(self, resource: str) -> PluginServer:
        service = DevicePluginService(
            resource=resource, state=self._state, settings=self._settings, root=self._root
        )
        server = PluginServer(service, self.directory)
        server.start()
        self._log.info("serving", resource=resource, socket=str(server.path))
        return server

    def _register_due(self) -> None:
        now = self._clock()
        for resource, plugin in self._plugins.items():
            attempt = plugin.registration
            if attempt.done or now < attempt.due:
                continue
            if not plugin.server.serving():  # removed since this sync looked: served anew first
                continue
            try:
                register(
                    self.kubelet_socket,
                    resource=resource,
                    endpoint=plugin.server.path.name,
                    settings=self._settings,
                    timeout=REGISTER_TIMEOUT_SECONDS,
                )
            except grpc.RpcError as exc:
                delay = attempt.backoff.next_delay()
                self.counters.registration_failures += 1
                self._log.warning(
                    "registration failed, will retry",
                    resource=resource,
                    error=_rpc_error(exc),
                    attempt=attempt.backoff.failures,
                    retry_in=round(delay, 3),
                )
                attempt.due = now + delay
                continue
            attempt.done = True
            self.counters.registrations += 1
            self._log.info("registered with kubelet", resource=resource)

    def _kubelet_socket_identity(self) -> tuple[int, int] | None:
        try:
            stat = self.kubelet_socket.stat()
        except FileNotFoundError:
            return None
        return (stat.st_ino, stat.st_ctime_ns)


def _rpc_error(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code is not None else 'UNKNOWN'}: {details}"
