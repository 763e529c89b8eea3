"""Blocking servicers served by grpc's asyncio server (edl_agent.unix_server): status codes from
`abort`, a stream's method woken and closed when the peer hangs up or the server stops, and
errors reported, over a real unix socket."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from edl_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from edl_agent.threaded_servicer import CallContext
from edl_agent.unix_server import UnixSocketServer
from tests.waiting import wait_until

TIMEOUT = 10.0


class _Blocking(api_pb2_grpc.DevicePluginServicer):
    """ListAndWatch sends one list and then blocks until its call ends; Allocate refuses an
    unknown id and raises on an empty request."""

    def __init__(self) -> None:
        self.streams_open = 0
        self.streams_closed = 0
        self.callbacks_run = 0
        self.lock = threading.Lock()

    def ListAndWatch(
        self, request: api_pb2.Empty, context: CallContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        ended = threading.Event()

        def end() -> None:
            with self.lock:
                self.callbacks_run += 1
            ended.set()

        assert context.add_callback(end)
        with self.lock:
            self.streams_open += 1
        try:
            yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID="a", health="Healthy")])
            ended.wait()  # what a blocking watch does: only the call's end wakes it
            assert not context.is_active()
        finally:
            with self.lock:
                self.streams_closed += 1

    def Allocate(self, request: api_pb2.AllocateRequest, context: CallContext) -> object:
        if not request.container_requests:
            raise RuntimeError("nothing asked")
        ids = list(request.container_requests[0].devices_ids)
        if ids != ["a"]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown: {ids}")
        return api_pb2.AllocateResponse()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[_Blocking, UnixSocketServer, grpc.Channel]]:
    servicer = _Blocking()
    server = UnixSocketServer(tmp_path / "s.sock", workers=4, thread_prefix="test")
    server.start([(api_pb2_grpc.add_DevicePluginServicer_to_server, servicer)])
    channel = grpc.insecure_channel(f"unix://{server.path}")
    try:
        yield servicer, server, channel
    finally:
        channel.close()
        server.stop(0)


def test_abort_and_errors_become_statuses(
    served: tuple[_Blocking, UnixSocketServer, grpc.Channel],
) -> None:
    _, _, channel = served
    stub = api_pb2_grpc.DevicePluginStub(channel)

    stub.Allocate(api_pb2.AllocateRequest(container_requests=[{"devices_ids": ["a"]}]))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(api_pb2.AllocateRequest(container_requests=[{"devices_ids": ["b"]}]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "unknown: ['b']"
    with pytest.raises(grpc.RpcError) as failed:
        stub.Allocate(api_pb2.AllocateRequest())
    assert failed.value.code() == grpc.StatusCode.UNKNOWN


def test_a_peer_hanging_up_wakes_and_closes_the_stream(
    served: tuple[_Blocking, UnixSocketServer, grpc.Channel],
) -> None:
    servicer, _, channel = served
    stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
    assert [d.ID for d in next(stream).devices] == ["a"]

    stream.cancel()

    wait_until(lambda: servicer.streams_closed == 1, TIMEOUT, what="the stream's method closed")
    assert servicer.callbacks_run == 1


def test_stopping_the_server_ends_open_streams(tmp_path: Path) -> None:
    servicer = _Blocking()
    server = UnixSocketServer(tmp_path / "s.sock", workers=4, thread_prefix="test")
    server.start([(api_pb2_grpc.add_DevicePluginServicer_to_server, servicer)])
    with grpc.insecure_channel(f"unix://{server.path}") as channel:
        stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
        next(stream)

        server.stop(0)  # returns only once its threads are done

        assert (servicer.streams_open, servicer.streams_closed) == (1, 1)
        assert not server.path.exists()
        with pytest.raises(grpc.RpcError):
            next(stream)


def test_a_socket_that_cannot_be_bound_raises_from_start(tmp_path: Path) -> None:
    server = UnixSocketServer(tmp_path / "missing" / "s.sock", workers=1, thread_prefix="test")
    with pytest.raises(RuntimeError):
        server.start([(api_pb2_grpc.add_DevicePluginServicer_to_server, _Blocking())])
    assert not server.serving()
