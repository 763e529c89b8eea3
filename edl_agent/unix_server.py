"""A gRPC server on a unix socket file of our own, for kubelet to dial: the device plugin's
servers and the DRA plugin's. It knows whether the file at its path is still the one it bound,
so that a socket removed or replaced (kubelet cleaning its directory) is noticed and served
again, and stopping never removes a successor's socket."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc


class UnixSocketServer:
    def __init__(self, path: Path, *, workers: int, thread_prefix: str) -> None:
        self.path = path
        self._workers = workers
        self._thread_prefix = thread_prefix
        self._executor: futures.ThreadPoolExecutor | None = None
        self._server: grpc.Server | None = None
        # The socket file we bound, as (device, inode, ctime): an inode number alone is reused
        # at once by the file that replaces ours.
        self._identity: tuple[int, int, int] | None = None

    def start(self, add_services: Callable[[grpc.Server], None]) -> None:
        """Bind (replacing a stale file) and serve what `add_services` adds; returns once the
        socket accepts connections."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._executor = futures.ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix=self._thread_prefix
        )
        self._server = grpc.server(self._executor)
        add_services(self._server)
        self._server.add_insecure_port(f"unix://{self.path}")
        self._server.start()
        self._identity = _identity(self.path)  # None: removed at once (kubelet cleaning up)

    def serving(self) -> bool:
        """False when our socket file is gone or replaced."""
        return self._server is not None and _identity(self.path) == self._identity

    def stop(self, grace: float) -> None:
        """Stop serving, release the threads and remove our socket (only if it is still ours)."""
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
