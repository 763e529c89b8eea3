"""A kubelet stand-in: the Registration server on kubelet.sock, kubelet's restart behaviour
(delete every socket in the directory, then a new kubelet.sock), and a client for the plugins
that registered — all over real unix sockets.

The kubelet contract itself is proven against a real kubelet v1.37 (tests/cluster, marker
`kubelet`). This stand-in stays for the tests that must run without root or a control plane
(`-m "not cluster"`) and for the ones that need a kubelet that misbehaves on purpose: one that
sends ids it never got (Allocate of unknown or unhealthy ids, GetPreferredAllocation with
unreadable topology), that reads ListAndWatch on a second stream, or that vanishes mid-call.
The benchmarks use it to time the plugin alone, without kubelet's own latency."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.unix_grpc import UnixGrpcServer


@dataclass
class _Registrar(api_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    requests: list[api_pb2.RegisterRequest] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        with self.changed:
            self.requests.append(request)
            self.changed.notify_all()
        return api_pb2.Empty()


class KubeletStandIn:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "kubelet.sock"
        self.registrar = _Registrar()
        self._server = UnixGrpcServer(self.socket, self._add_services)

    def _add_services(self, server: grpc.Server) -> None:
        api_pb2_grpc.add_RegistrationServicer_to_server(self.registrar, server)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def restart(self) -> None:
        """What kubelet does when it restarts: every socket in its directory goes, then a new
        kubelet.sock appears."""
        self.stop()
        for path in list(self.directory.glob("*.sock")):  # names read first, as kubelet does
            path.unlink(missing_ok=True)
        self.start()

    @property
    def registrations(self) -> list[api_pb2.RegisterRequest]:
        with self.registrar.changed:
            return list(self.registrar.requests)

    def wait_registered(self, resources: set[str], *, after: int = 0, timeout: float = 10) -> float:
        """Seconds until every resource registered (counting requests after index `after`)."""
        started = time.monotonic()
        with self.registrar.changed:
            ok = self.registrar.changed.wait_for(
                lambda: resources <= {r.resource_name for r in self.registrar.requests[after:]},
                timeout=timeout,
            )
        if not ok:
            got = {r.resource_name for r in self.registrations[after:]}
            msg = f"not registered within {timeout}s: {sorted(resources - got)}"
            raise AssertionError(msg)
        return time.monotonic() - started

    def endpoint(self, resource: str) -> Path:
        request = next(r for r in reversed(self.registrations) if r.resource_name == resource)
        return self.directory / request.endpoint

    def watch(self, resource: str) -> Watch:
        """A ListAndWatch stream on its own channel, closed by Watch.cancel()."""
        channel = grpc.insecure_channel(f"unix://{self.endpoint(resource)}")
        return Watch(api_pb2_grpc.DevicePluginStub(channel), channel)

    @contextlib.contextmanager
    def plugin(self, resource: str) -> Iterator[api_pb2_grpc.DevicePluginStub]:
        with grpc.insecure_channel(f"unix://{self.endpoint(resource)}") as channel:
            yield api_pb2_grpc.DevicePluginStub(channel)


class Watch:
    """A ListAndWatch stream read on its own thread into a queue."""

    def __init__(
        self, stub: api_pb2_grpc.DevicePluginStub, channel: grpc.Channel | None = None
    ) -> None:
        self._channel = channel
        self.updates: queue.Queue[api_pb2.ListAndWatchResponse] = queue.Queue()
        self._call = stub.ListAndWatch(api_pb2.Empty())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for update in self._call:
                self.updates.put(update)

    def next(self, timeout: float = 5) -> api_pb2.ListAndWatchResponse:
        return self.updates.get(timeout=timeout)

    def until(self, predicate: object, timeout: float = 5) -> api_pb2.ListAndWatchResponse:
        deadline = time.monotonic() + timeout
        while True:
            update = self.next(max(deadline - time.monotonic(), 0.01))
            if callable(predicate) and predicate(update):
                return update

    def cancel(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)
        if self._channel is not None:
            self._channel.close()
