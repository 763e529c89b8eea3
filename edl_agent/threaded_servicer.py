"""Serve a servicer written in plain blocking Python (its methods wait on locks and events) from
grpc's asyncio server.

Why not grpc's threaded server: it polls its completion queue in 200 ms slices to let Python see
signals, so an idle process wakes five times a second for every server it runs. The asyncio
server's poller blocks until something happens. Each call's method still runs on a worker thread
of our pool, exactly as before; a streaming method is a generator whose items are fetched there
one at a time.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from concurrent import futures
from typing import Any, Protocol

import grpc
import grpc.aio


class CallContext(Protocol):
    """What our servicers use of a call's context (a subset of grpc.ServicerContext's)."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with this status; raises, never returns."""
        ...

    def is_active(self) -> bool:
        """False once the peer has gone or the call has ended."""
        ...

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Call `callback` when the call ends; False (and never called) if it already has."""
        ...


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _ThreadContext:
    """A call's context as seen from the worker thread running its method."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = False
        self._callbacks: list[Callable[[], None]] = []

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def is_active(self) -> bool:
        with self._lock:
            return not self._ended

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


_END = object()


class ThreadedServicer:
    """Stands in for `servicer` when handing it to a generated `add_*Servicer_to_server`: each
    method it looks up is an async wrapper that runs the blocking one on `pool`."""

    def __init__(self, servicer: object, pool: futures.ThreadPoolExecutor) -> None:
        self._servicer = servicer
        self._pool = pool

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._servicer, name)
        if _is_generator_method(method):
            return self._streaming(method)
        return self._unary(method)

    def _unary(self, method: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        pool = self._pool

        async def call(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            thread_context = _ThreadContext()
            work = pool.submit(method, request, thread_context)
            try:
                return await asyncio.wrap_future(work)
            except _Aborted as aborted:
                await context.abort(aborted.code, aborted.details)
            finally:
                thread_context.end()

        return call

    def _streaming(
        self, method: Callable[..., Generator[Any, None, None]]
    ) -> Callable[..., AsyncIterator[Any]]:
        pool = self._pool

        async def call(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            thread_context = _ThreadContext()
            items = method(request, thread_context)
            pending: futures.Future[Any] | None = None
            try:
                while True:
                    pending = pool.submit(next, items, _END)
                    item = await asyncio.wrap_future(pending)
                    pending = None
                    if item is _END:
                        return
                    yield item
            except _Aborted as aborted:
                pending = None
                await context.abort(aborted.code, aborted.details)
            finally:
                # The peer went or the server is stopping: wake the method (its callbacks), and
                # close the generator once the worker still inside it comes out.
                thread_context.end()
                if pending is not None and not pending.done():
                    pool.submit(_close_after, pending, items)
                else:
                    items.close()

        return call


def _close_after(pending: futures.Future[Any], items: Generator[Any, None, None]) -> None:
    futures.wait([pending])
    items.close()


def _is_generator_method(method: Callable[..., Any]) -> bool:
    return inspect.isgeneratorfunction(method)
