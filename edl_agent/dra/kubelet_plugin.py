"""The DRA kubelet plugin of one driver: one gRPC server on one unix socket in kubelet's
plugins_registry directory, serving plugin registration, the DRA plugin API and device health.

Kubelet's plugin watcher finds the socket, asks GetInfo and reports back through
NotifyRegistrationStatus; an empty endpoint makes kubelet call the DRA services on this same
socket. Kubelet then opens NodeWatchResources and keeps it open: the stream carries every
device's health at once, again on each change, and again every third of the health timeout, as
kubelet calls a device's health Unknown when a report is older than that timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import structlog

from edl_agent._proto.dra.v1 import api_pb2 as dra_pb2
from edl_agent._proto.dra.v1 import api_pb2_grpc as dra_grpc
from edl_agent._proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from edl_agent._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from edl_agent._proto.pluginregistration.v1 import api_pb2 as registration_pb2
from edl_agent._proto.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from edl_agent.dra.checkpoint import PreparedDevice
from edl_agent.dra.prepare import ClaimRef, Preparer, PrepareResult
from edl_agent.errors import shorten
from edl_agent.threaded_servicer import CallContext
from edl_agent.unix_server import Service, UnixSocketServer

PLUGIN_TYPE = "DRAPlugin"
# "<proto package tail>.<service>" of the DRA services kubelet may choose from. Kubelet 1.37 opens
# the health stream only to a plugin that names its service here (1.34-1.36 opened it to every
# plugin, and ignore the name); it takes v1alpha1 until 1.39 and prefers v1 where both are named.
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1alpha1.DRAResourceHealth")
MAX_HEALTH_MESSAGE = 1024
# Kubelet's calls, its health stream and a second stream while kubelet replaces the first.
MAX_WORKERS = 8

DeviceHealthMap = Mapping[str, tuple[bool, str]]


class HealthSource(Protocol):
    """The driver's devices' health: `snapshot()` is (version, device name → (healthy,
    message)), and the version grows whenever the health may have changed."""

    def snapshot(self) -> tuple[int, DeviceHealthMap]: ...

    def wait_newer(self, version: int, timeout: float, cancel: threading.Event) -> bool:
        """True once a snapshot newer than `version` exists; False on timeout or once `cancel`
        is set (noticed when `wake` is called)."""
        ...

    def wake(self) -> None:
        """Make every `wait_newer` check its `cancel` event now."""
        ...


def socket_path(plugins_registry_dir: Path, driver: str) -> Path:
    """`<plugins_registry_dir>/<driver>.sock`: kubelet registers a plugin under the name GetInfo
    gives, whatever its socket is called."""
    return plugins_registry_dir / f"{driver}.sock"


class DraPluginServer:
    """Serves one driver's registration, DRA plugin and health services on `socket_path`."""

    def __init__(
        self,
        *,
        driver: str,
        socket_path: Path,
        preparer: Preparer,
        health: HealthSource,
        timeout_seconds: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.driver = driver
        self.path = socket_path
        self.registered = threading.Event()
        self._error: str | None = None
        self._preparer = preparer
        self._health = _HealthStreams(
            pool=preparer.pool, source=health, timeout_seconds=timeout_seconds, clock=clock
        )
        self._lock = threading.Lock()
        self._socket = UnixSocketServer(
            socket_path, workers=MAX_WORKERS, thread_prefix=f"dra-{driver}"
        )
        self._log = structlog.get_logger().bind(part="dra-plugin", driver=driver)

    @property
    def registration_error(self) -> str | None:
        """Why kubelet last refused the registration; None when it accepted or has not said."""
        with self._lock:
            return self._error

    def start(self) -> None:
        """Bind and serve; returns once the socket accepts connections."""
        self.registered.clear()
        self._health.reopen()
        self._socket.start(self._services())
        self._log.info("serving", socket=str(self.path))

    def _services(self) -> list[Service]:
        return [
            (
                registration_grpc.add_RegistrationServicer_to_server,
                _Registration(self.driver, self._registration_status),
            ),
            (dra_grpc.add_DRAPluginServicer_to_server, _DraPlugin(self._preparer)),
            (health_grpc.add_DRAResourceHealthServicer_to_server, self._health),
        ]

    def serving(self) -> bool:
        """False when our socket file is gone or replaced (kubelet then forgets the plugin)."""
        return self._socket.serving()

    def stop(self, grace: float = 0.5) -> None:
        """End the health streams, stop serving, release the threads and remove our socket."""
        self._health.close()
        self._socket.stop(grace)
        self.registered.clear()

    def _registration_status(self, registered: bool, error: str) -> None:
        with self._lock:
            self._error = None if registered else error or "refused without a reason"
        if registered:
            self._log.info("registered with kubelet")
            self.registered.set()
        else:
            self._log.error("kubelet refused the registration", error=error)
            self.registered.clear()


class _Registration(registration_grpc.RegistrationServicer):
    def __init__(self, driver: str, on_status: Callable[[bool, str], None]) -> None:
        self._driver = driver
        self._on_status = on_status

    def GetInfo(
        self, request: registration_pb2.InfoRequest, context: CallContext
    ) -> registration_pb2.PluginInfo:
        return registration_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._driver,
            endpoint="",
            supported_versions=list(SUPPORTED_SERVICES),
        )

    def NotifyRegistrationStatus(
        self, request: registration_pb2.RegistrationStatus, context: CallContext
    ) -> registration_pb2.RegistrationStatusResponse:
        self._on_status(request.plugin_registered, request.error)
        return registration_pb2.RegistrationStatusResponse()


class _DraPlugin(dra_grpc.DRAPluginServicer):
    """Kubelet's calls, answered claim by claim: a claim that fails carries its own error."""

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    def NodePrepareResources(
        self, request: dra_pb2.NodePrepareResourcesRequest, context: CallContext
    ) -> dra_pb2.NodePrepareResourcesResponse:
        results = self._preparer.prepare(_claims(request.claims))
        return dra_pb2.NodePrepareResourcesResponse(
            claims={uid: _prepare_response(result) for uid, result in results.items()}
        )

    def NodeUnprepareResources(
        self, request: dra_pb2.NodeUnprepareResourcesRequest, context: CallContext
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        results = self._preparer.unprepare(_claims(request.claims))
        return dra_pb2.NodeUnprepareResourcesResponse(
            claims={
                uid: dra_pb2.NodeUnprepareResourceResponse(error=error or "")
                for uid, error in results.items()
            }
        )


class _HealthStreams(health_grpc.DRAResourceHealthServicer):
    """NodeWatchResources: every device's health when the stream opens, on every change, and
    every third of `timeout_seconds` so that no report kubelet holds grows stale."""

    def __init__(
        self,
        *,
        pool: str,
        source: HealthSource,
        timeout_seconds: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._source = source
        self._timeout_seconds = timeout_seconds
        self._resend_seconds = timeout_seconds / 3
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._streams: set[threading.Event] = set()

    def reopen(self) -> None:
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """End every stream, now and as they open."""
        with self._lock:
            self._closed = True
            for cancel in self._streams:
                cancel.set()
        self._source.wake()

    def NodeWatchResources(
        self, request: health_pb2.NodeWatchResourcesRequest, context: CallContext
    ) -> Iterator[health_pb2.NodeWatchResourcesResponse]:
        cancel = threading.Event()

        def end() -> None:
            cancel.set()
            self._source.wake()

        with self._lock:
            if self._closed:
                return
            self._streams.add(cancel)
        if not context.add_callback(end):  # kubelet already hung up
            cancel.set()
        try:
            yield from self._watch(cancel)
        finally:
            with self._lock:
                self._streams.discard(cancel)

    def _watch(self, cancel: threading.Event) -> Iterator[health_pb2.NodeWatchResourcesResponse]:
        version, health = self._source.snapshot()
        yield self._response(health)
        sent_at = time.monotonic()
        while not cancel.is_set():
            due = sent_at + self._resend_seconds
            remaining = due - time.monotonic()
            if remaining > 0 and self._source.wait_newer(version, remaining, cancel):
                version, latest = self._source.snapshot()
                if latest == health:
                    continue
                health = latest
            elif cancel.is_set():
                break
            elif time.monotonic() < due:
                continue  # woken for another stream
            yield self._response(health)
            sent_at = time.monotonic()

    def _response(self, health: DeviceHealthMap) -> health_pb2.NodeWatchResourcesResponse:
        now = int(self._clock())
        return health_pb2.NodeWatchResourcesResponse(
            devices=[
                health_pb2.DeviceHealth(
                    device=health_pb2.DeviceIdentifier(pool_name=self._pool, device_name=name),
                    health=health_pb2.HEALTHY if healthy else health_pb2.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=self._timeout_seconds,
                    message=shorten(message, MAX_HEALTH_MESSAGE),
                )
                for name, (healthy, message) in sorted(health.items())
            ]
        )


def _claims(claims: Iterable[dra_pb2.Claim]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


def _prepare_response(result: PrepareResult) -> dra_pb2.NodePrepareResourceResponse:
    if result.error is not None:
        return dra_pb2.NodePrepareResourceResponse(error=result.error)
    return dra_pb2.NodePrepareResourceResponse(devices=[_device(d) for d in result.devices])


def _device(device: PreparedDevice) -> dra_pb2.Device:
    answer = dra_pb2.Device(
        request_names=list(device.requests),
        pool_name=device.pool,
        device_name=device.device,
        cdi_device_ids=list(device.cdi_ids),
    )
    if device.share_id is not None:
        answer.share_id = device.share_id
    return answer
