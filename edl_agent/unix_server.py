"""A gRPC server on a unix socket file of our own, for kubelet to dial: the device plugin's
servers and the DRA plugin's. It knows whether the file at its path is still the one it bound,
so that a socket removed or replaced (kubelet cleaning its directory) is noticed and served
again, and stopping never removes a successor's socket."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import grpc.aio

from edl_agent.threaded_servicer import ThreadedServicer

# A generated `add_<Service>Servicer_to_server` and the servicer it adds.
Service = tuple[Callable[[object, grpc.aio.Server], None], object]


class UnixSocketServer:
    """grpc's asyncio server on its own event-loop thread, running our blocking servicers on a
    pool of `workers` threads (see threaded_servicer for why)."""

    def __init__(self, path: Path, *, workers: int, thread_prefix: str) -> None:
        self.path = path
        self._workers = workers
        self._thread_prefix = thread_prefix
        self._executor: futures.ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._grace = 0.0
        # The socket file we bound, as (device, inode, ctime): an inode number alone is reused
        # at once by the file that replaces ours.
        self._identity: tuple[int, int, int] | None = None

    def start(self, services: Sequence[Service]) -> None:
        """Bind (replacing a stale file) and serve `services`; returns once the socket accepts
        connections, or raises what kept it from binding."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        executor = futures.ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix=self._thread_prefix
        )
        started: futures.Future[None] = futures.Future()
        thread = threading.Thread(
            target=self._run,
            args=(services, executor, started),
            name=f"{self._thread_prefix}-grpc",
            daemon=True,
        )
        thread.start()
        try:
            started.result()
        except BaseException:
            thread.join()
            executor.shutdown(wait=True, cancel_futures=True)
            raise
        self._executor, self._thread = executor, thread
        self._identity = _identity(self.path)  # None: removed at once (kubelet cleaning up)

    def _run(
        self,
        services: Sequence[Service],
        executor: futures.ThreadPoolExecutor,
        started: futures.Future[None],
    ) -> None:
        try:
            asyncio.run(self._serve(services, executor, started))
        except BaseException as exc:  # a failed bind: start() raises it
            if not started.done():
                started.set_exception(exc)

    async def _serve(
        self,
        services: Sequence[Service],
        executor: futures.ThreadPoolExecutor,
        started: futures.Future[None],
    ) -> None:
        server = grpc.aio.server()
        for add, servicer in services:
            add(ThreadedServicer(servicer, executor), server)
        server.add_insecure_port(f"unix://{self.path}")
        await server.start()
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        started.set_result(None)
        await self._stop_requested.wait()
        await server.stop(self._grace)

    def serving(self) -> bool:
        """False when our socket file is gone or replaced."""
        return self._thread is not None and _identity(self.path) == self._identity

    def stop(self, grace: float) -> None:
        """Stop serving, release the threads and remove our socket (only if it is still ours)."""
        if self._thread is not None:
            self._grace = grace
            loop, stop_requested = self._loop, self._stop_requested
            if loop is not None and stop_requested is not None:
                with contextlib.suppress(RuntimeError):  # the loop has already ended
                    loop.call_soon_threadsafe(stop_requested.set)
            self._thread.join()
            self._thread = None
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
