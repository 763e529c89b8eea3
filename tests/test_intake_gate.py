"""The intake's per-peer connection cap (restarter/peer_gate.py), on real sockets: one address
gets no more than its share, other addresses still get in, and what passes is the intake, which
no other user reaches but through the gate. The relay passes every byte and each half-close on,
and logs its refusals at most once an interval."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from edl_agent.restarter.adapters.intake_server import IntakeServer
from edl_agent.restarter.adapters.peer_gate import PeerGate
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


def test_grpc_behind_the_gate_listens_in_a_directory_of_its_own() -> None:
    running = Restarter(max_connections_per_peer=3)
    running.server.start()
    try:
        gate = gate_of(running.server)
        assert verdicts(report(running.address, [fault(1)], "agent-a"))[0][1] == "VERDICT_ACCEPTED"
        directory = gate.directory.stat()
        assert stat.S_IMODE(directory.st_mode) == 0o700
        assert directory.st_uid == os.getuid()
        assert gate.target.parent == gate.directory
        assert stat.S_ISSOCK(gate.target.stat().st_mode)
        # No abstract socket, which any process of the network namespace would reach.
        assert not abstract_sockets_held()
    finally:
        running.server.stop(0)
    assert not gate.directory.exists()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_without_a_writable_temporary_directory_the_socket_goes_to_dev_shm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As in a container whose root filesystem is read-only."""
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tmp")
    with (
        gate_before(lambda connection: connection.sendall(b"hi")) as (gate, _),
        client_of(gate) as client,
    ):
        assert gate.directory.parent == Path("/dev/shm")
        assert read_all(client) == b"hi"
    assert not gate.directory.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_another_user_cannot_reach_the_intake_behind_the_gate(capped: Restarter) -> None:
    target = gate_of(capped.server).target
    # A python the other user may run: this one may live in a home only root enters.
    for python in (sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin")):
        if python is None:
            continue
        try:
            tried = subprocess.run(
                [python, "-I", "-S", "-c", CONNECT, str(target)],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                cwd="/",
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except PermissionError:
            continue
        assert tried.stdout.strip() == "EACCES", tried.stderr
        return
    pytest.skip("no python that another user may run")


NOBODY = 65534
CONNECT = """
import errno, socket, sys
try:
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(sys.argv[1])
    print("connected")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc))
"""


def abstract_sockets_held() -> list[str]:
    """The names of the abstract unix sockets this process holds (with a leading @)."""
    held = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            held.add(fd.readlink().name)
    names = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # the 7th: the inode; the 8th, where bound: the name
        if len(fields) > 7 and fields[7].startswith("@") and f"socket:[{fields[6]}]" in held:
            names.append(fields[7])
    return names


@contextmanager
def gate_before(
    handle: Callable[[socket.socket], None], **caps: int
) -> Iterator[tuple[PeerGate, threading.Event]]:
    """A started gate, and behind it a server that serves one connection with `handle` on a
    thread of its own (the event: `handle` returned and the connection is closed)."""
    gate = PeerGate(listen=":0", **({"per_peer": 1, "total": 4} | caps))  # every address
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(gate.target))
    listener.listen()
    handled = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listener shut down: no connection came
            connection, _ = listener.accept()
            with connection:
                handle(connection)
        handled.set()

    server = threading.Thread(target=serve, name="behind-the-gate")
    server.start()
    gate.start()
    try:
        yield gate, handled
    finally:
        gate.stop()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes an accept() still waiting
        listener.close()
        server.join(10)
        assert not server.is_alive()


def client_of(gate: PeerGate) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gate.port), timeout=30)


def read_all(connection: socket.socket) -> bytes:
    received = bytearray()
    while chunk := connection.recv(1 << 20):
        received += chunk
    return bytes(received)


def test_the_gate_relays_every_byte_both_ways_through_its_bounded_buffers() -> None:
    """4 MiB each way, far more than the gate buffers: the client reads its echo only after it
    sent it all, so the gate must stop reading while the other side's backlog is full."""

    def echo(connection: socket.socket) -> None:
        while data := connection.recv(65536):
            connection.sendall(data)

    payload = os.urandom(4 << 20)
    with gate_before(echo) as (gate, handled):
        with client_of(gate) as client:
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
        assert handled.wait(10)  # the client's close reached the echo server through the gate
        wait_until(lambda: gate.open == {}, what="the pair closed")


def test_a_client_that_ends_its_writing_still_gets_the_whole_answer() -> None:
    def answer_at_the_end(connection: socket.socket) -> None:
        connection.sendall(read_all(connection)[::-1])

    payload = os.urandom(1 << 20)  # more than the gate buffers, each way
    with (
        gate_before(answer_at_the_end) as (gate, handled),
        client_of(gate) as client,
    ):
        client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        assert read_all(client) == payload[::-1]
        assert handled.wait(10)
        wait_until(lambda: gate.open == {}, what="the pair closed, both ways ended")


def test_a_server_that_ends_its_writing_still_hears_the_client() -> None:
    heard: list[bytes] = []

    def greet_then_listen(connection: socket.socket) -> None:
        connection.sendall(b"hello")
        connection.shutdown(socket.SHUT_WR)
        heard.append(read_all(connection))

    with (
        gate_before(greet_then_listen) as (gate, handled),
        client_of(gate) as client,
    ):
        assert read_all(client) == b"hello"
        client.sendall(b"bye")
        client.shutdown(socket.SHUT_WR)
        assert handled.wait(10)
        wait_until(lambda: gate.open == {}, what="the pair closed, both ways ended")
    assert heard == [b"bye"]


def test_a_connection_the_server_closed_is_closed_though_the_client_holds_it() -> None:
    """As grpc closes one that does not finish its handshake in time: the client's slot is
    free again, whether or not the client ever closes its end."""
    with (
        gate_before(lambda connection: connection.sendall(b"bye")) as (gate, handled),
        client_of(gate) as client,
    ):
        assert read_all(client) == b"bye"
        assert handled.wait(10)
        wait_until(lambda: gate.open == {}, what="the pair closed")


def test_refusals_are_logged_once_an_interval_per_cap_with_the_number_left_out() -> None:
    now = [0.0]
    refused_lines = "intake connection refused: too many connections"
    gate = PeerGate(listen="127.0.0.1:0", per_peer=1, total=2, clock=lambda: now[0])
    behind = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    behind.bind(str(gate.target))
    behind.listen(8)  # never accepts: the held connections wait in its backlog
    gate.start()
    held: list[socket.socket] = []
    try:
        with capture_logs() as logs:
            held.append(connect(gate.port))
            held.append(connect(gate.port, source="127.0.0.2"))
            wait_until(lambda: len(gate.open) == 2, what="one connection from each address")
            for _ in range(30):  # 127.0.0.1 past its share
                with connect(gate.port) as refused:
                    assert refused.recv(1) == b""
            with connect(gate.port, source="127.0.0.3") as refused:  # past the total
                assert refused.recv(1) == b""
            assert gate.refused == 31
            lines = [e for e in logs if e["event"] == refused_lines]
            assert [(e["cap"], e["peer"], e["left_out"]) for e in lines] == [
                ("per_peer", "127.0.0.1", 0),
                ("total", "127.0.0.3", 0),
            ]
            now[0] += 10.0  # the gate's interval
            with connect(gate.port) as refused:
                assert refused.recv(1) == b""
            lines = [e for e in logs if e["event"] == refused_lines]
        assert [(e["cap"], e["left_out"], e["refused"]) for e in lines[2:]] == [
            ("per_peer", 29, 32)
        ]
    finally:
        for connection in held:
            connection.close()
        gate.stop()
        behind.close()
