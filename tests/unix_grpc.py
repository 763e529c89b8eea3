"""A gRPC server on a unix socket for the test stand-ins (kubelet's registration and
pod-resources servers): start, stop, and the socket file removed on stop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc


class UnixGrpcServer:
    def __init__(
        self, socket: Path, add_services: Callable[[grpc.Server], None], *, workers: int = 2
    ) -> None:
        self.socket = socket
        self._add_services = add_services
        self._workers = workers
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self._executor = futures.ThreadPoolExecutor(max_workers=self._workers)
        self._server = grpc.server(self._executor)
        self._add_services(self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
