"""The intake's per-peer connection cap (restarter/peer_gate.py), on real sockets: one address
gets no more than its share, other addresses still get in, and what passes is the intake."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from edl_agent.restarter.intake import IntakeServer
from edl_agent.restarter.peer_gate import PeerGate, abstract_name
from tests.test_fault_delivery import Restarter, fault, fid, report, verdicts
from tests.waiting import wait_until


@pytest.fixture
def capped() -> Iterator[Restarter]:
    # A long handshake timeout: the silent connections stay until the test closes them.
    running = Restarter(max_connections_per_peer=3, handshake_timeout=120)
    running.server.start()
    yield running
    running.server.stop(0)


def gate_of(server: IntakeServer) -> PeerGate:
    assert server.gate is not None
    return server.gate


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def test_one_address_gets_its_share_and_no_more_while_others_get_in(capped: Restarter) -> None:
    port, gate = capped.server.port, gate_of(capped.server)
    held = [connect(port) for _ in range(3)]
    try:
        wait_until(lambda: gate.open == {"127.0.0.1": 3}, what="three connections held")
        with connect(port) as fourth:
            assert fourth.recv(1) == b""  # closed at once, long before the handshake timeout
        assert gate.refused == 1
        assert capped.intake.counts().refused == {"too_many_connections": 1}  # in its metrics
        with connect(port, source="127.0.0.2"):
            wait_until(lambda: gate.open["127.0.0.2"] == 1, what="another address let in")
            with pytest.raises(grpc.RpcError) as full:  # 127.0.0.1 is still at its cap
                report(capped.address, [fault(1)], "agent-a")
            assert full.value.code() == grpc.StatusCode.UNAVAILABLE
            held.pop().close()
            wait_until(lambda: gate.open["127.0.0.1"] == 2, what="a connection given back")
            response = report(capped.address, [fault(1)], "agent-a")  # through the gate
        assert verdicts(response) == [(fid(1), "VERDICT_ACCEPTED", "")]
    finally:
        for connection in held:
            connection.close()
    wait_until(lambda: gate.open == {}, what="every connection gone")
    assert capped.ids() == {fid(1): 1}


def test_the_intake_still_names_the_peer_behind_the_gate(capped: Restarter) -> None:
    with capture_logs() as logs, pytest.raises(grpc.RpcError):
        report(capped.address, [fault(1)])  # no token: refused, and logged with its peer
    [refused] = [e for e in logs if e["event"] == "fault report refused"]
    assert "127.0.0.1:" in refused["peer"]


def test_no_cap_serves_without_a_gate() -> None:
    running = Restarter(max_connections_per_peer=0)
    running.server.start()
    try:
        assert running.server.gate is None
        assert verdicts(report(running.address, [fault(1)], "agent-a"))[0][1] == "VERDICT_ACCEPTED"
    finally:
        running.server.stop(0)


def test_the_gate_relays_every_byte_both_ways_through_its_bounded_buffers() -> None:
    """4 MiB each way, far more than the gate buffers: the client reads its echo only after it
    sent it all, so the gate must stop reading while the other side's backlog is full."""
    name = abstract_name()
    echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    echo.bind("\0" + name)
    echo.listen()

    def serve() -> None:
        connection, _ = echo.accept()
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)

    server = threading.Thread(target=serve, name="echo")
    server.start()
    gate = PeerGate(listen=":0", target=name, per_peer=1, total=4)  # every address
    gate.start()
    payload = os.urandom(4 << 20)
    try:
        with socket.create_connection(("127.0.0.1", gate.port), timeout=30) as client:
            sending = threading.Thread(target=client.sendall, args=(payload,), name="send")
            sending.start()
            wait_until(lambda: gate.open == {"127.0.0.1": 1}, what="IPv4 on a dual-stack door")
            received = bytearray()
            while len(received) < len(payload):
                chunk = client.recv(1 << 20)
                assert chunk, "closed before the echo came back"
                received += chunk
            sending.join()
        assert received == payload
        server.join(10)  # the client's close reached the echo server through the gate
        assert not server.is_alive()
        wait_until(lambda: gate.open == {}, what="the pair closed")
    finally:
        gate.stop()
        echo.close()
        server.join(10)
