"""The metrics server under many connections, over real sockets: a burst of new connections is
queued, not dropped (kubelet's probes give up after 1 s, a dropped SYN is retried after 1 s);
connections that say nothing are closed; beyond the cap one is told 503, not given a thread; an
idle server sleeps until a connection or the stop comes."""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry

from edl_agent.metrics.server import MetricsServer
from tests.parts import supervised
from tests.waiting import wait_for, wait_until

BURST = 64
GET = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"
GET_AND_CLOSE = b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"


def listen_backlog(port: int) -> int:
    """The backlog the kernel gave our listening socket on `port`: for a socket in LISTEN,
    TCP_INFO's `tcpi_sacked` holds it (what `ss -lt` shows as Send-Q)."""
    (fd,) = (
        c.fd
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    )
    with socket.socket(fileno=os.dup(fd)) as listening:
        info = listening.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    state, *_, sacked = struct.unpack_from("8B6I", info)
    assert state == 10  # TCP_LISTEN
    return int(sacked)


def retransmits(connection: socket.socket) -> int:
    """TCP_INFO's `tcpi_total_retrans`: a SYN dropped by a full accept queue and sent again
    counts."""
    info = connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    *_, total_retrans = struct.unpack_from("8B24I", info)
    return int(total_retrans)


def connection_threads() -> int:
    return sum(t.name == "metrics-connection" for t in threading.enumerate())


def read_to_end(connection: socket.socket) -> bytes:
    chunks = []
    while chunk := connection.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def clients() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for connection in opened:
        connection.close()


def connect(server: MetricsServer, clients: list[socket.socket]) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    clients.append(connection)
    return connection


def test_the_listen_backlog_holds_a_burst() -> None:
    with MetricsServer("127.0.0.1:0", CollectorRegistry()) as metrics:
        assert listen_backlog(metrics.port) >= BURST


def test_a_burst_of_new_connections_is_answered_in_full(clients: list[socket.socket]) -> None:
    with MetricsServer("127.0.0.1:0", CollectorRegistry()) as metrics:
        answers, resent = burst(metrics.port, clients)
    assert len(answers) == BURST
    assert all(a.startswith(b"HTTP/1.1 200 OK\r\n") for a in answers)
    assert all(a.endswith(b"ok\n") for a in answers)
    assert sum(resent) == 0, "a connection had to send its SYN again"


def burst(port: int, clients: list[socket.socket]) -> tuple[list[bytes], list[int]]:
    """BURST connections opened before any is read, as a storm of probes does; each sends one
    request. Their answers, and the retransmits each saw until connected."""
    answers: dict[socket.socket, bytes] = {}
    resent: list[int] = []
    with selectors.DefaultSelector() as selector:
        for _ in range(BURST):
            connection = socket.socket()
            clients.append(connection)
            connection.setblocking(False)
            connection.connect_ex(("127.0.0.1", port))
            selector.register(connection, selectors.EVENT_WRITE)

        def step() -> int:
            for key, events in selector.select(timeout=0.1):
                connection = key.fileobj
                assert isinstance(connection, socket.socket)
                if events & selectors.EVENT_WRITE:
                    resent.append(retransmits(connection))
                    connection.sendall(GET_AND_CLOSE)
                    selector.modify(connection, selectors.EVENT_READ)
                    answers[connection] = b""
                elif chunk := connection.recv(65536):
                    answers[connection] += chunk
                else:
                    selector.unregister(connection)
            return len(selector.get_map())

        wait_for("every connection answered and closed", step, lambda left: left == 0)
    return list(answers.values()), resent


def test_connections_that_say_nothing_are_closed(clients: list[socket.socket]) -> None:
    silent, kept_alive = 20, 5
    with MetricsServer("127.0.0.1:0", CollectorRegistry(), idle_timeout=2.0) as metrics:
        for _ in range(silent):
            connect(metrics, clients)
        for _ in range(kept_alive):  # one request, then nothing: an idle keep-alive connection
            connect(metrics, clients).sendall(GET)
        wait_until(lambda: metrics.connections == silent + kept_alive, what="all accepted")
        assert connection_threads() == silent + kept_alive

        wait_until(lambda: metrics.connections == 0, what="every connection closed")
        wait_until(lambda: connection_threads() == 0, what="their threads ended")
        answers = [read_to_end(c) for c in clients]
    assert answers[:silent] == [b""] * silent
    assert all(a.startswith(b"HTTP/1.1 200 OK\r\n") for a in answers[silent:])


def test_beyond_the_cap_a_connection_is_told_503_and_the_rest_go_on(
    clients: list[socket.socket],
) -> None:
    cap = 3
    with MetricsServer("127.0.0.1:0", CollectorRegistry(), max_connections=cap) as metrics:
        held = [connect(metrics, clients) for _ in range(cap)]
        wait_until(lambda: metrics.connections == cap, what="the cap reached")

        turned_away = read_to_end(connect(metrics, clients))
        assert turned_away.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert turned_away.endswith(b"too many connections; try again\n")
        assert metrics.connections == cap
        assert connection_threads() == cap

        held[0].sendall(GET)  # the connections held are served as before
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        held[0].close()
        wait_until(lambda: metrics.connections == cap - 1, what="one slot free again")
        another = connect(metrics, clients)
        another.sendall(GET_AND_CLOSE)
        assert read_to_end(another).startswith(b"HTTP/1.1 200 OK\r\n")
        for connection in held[1:]:
            connection.close()
        wait_until(lambda: metrics.connections == 0, what="every connection closed")


def blocked_without_timeout(thread: threading.Thread) -> bool:
    """Whether `thread` waits in a system call with no timeout: epoll_wait's (or poll's, or
    epoll_pwait's) fourth argument, the timeout, is -1 (Linux's /proc/<pid>/task/<tid>/syscall)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().split()
    return len(fields) > 4 and int(fields[4], 16) in (2**32 - 1, 2**64 - 1)


def test_the_server_part_sleeps_until_a_connection_or_the_stop() -> None:
    """Run by a supervisor, the idle serving loop blocks with no timeout (an idle agent never
    wakes for it); the stop ends it at once and releases the address."""
    if not Path(f"/proc/self/task/{threading.get_native_id()}/syscall").exists():
        pytest.skip("no /proc/<pid>/task/<tid>/syscall here")
    metrics = MetricsServer("127.0.0.1:0", CollectorRegistry())
    metrics.bind()  # the address is taken before the part runs: a bind error comes here
    port = metrics.port
    with pytest.raises(OSError, match="in use"):
        MetricsServer(f"127.0.0.1:{port}", CollectorRegistry()).bind()
    with supervised(metrics) as supervisor:
        wait_until(lambda: supervisor.ready() == (True, "ok"), what="serving")
        (serving,) = (t for t in threading.enumerate() if t.name == "part-metrics")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(GET_AND_CLOSE)
            assert read_to_end(connection).endswith(b"ok\n")
        wait_until(lambda: blocked_without_timeout(serving), what="the loop blocked, no timeout")
        began = time.monotonic()
    assert time.monotonic() - began < 2.0
    assert not serving.is_alive()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
