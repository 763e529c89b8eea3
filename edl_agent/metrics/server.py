"""The metrics HTTP server: /metrics from a registry of our own, /healthz and /readyz.

`bind()` takes the address (OSError when it cannot: the caller says so at start); `run(stop,
ready)` is the supervised part that serves it, blocking in a `select` on the listening socket and
a wake-up socket the stop writes to, so an idle server never wakes. Each connection is answered on
a thread of its own, so a slow scrape never holds up a probe. /healthz answers 200 for as long as
the process serves; /readyz asks the `ready` callable and answers 200 or 503 with its reason as
the body.

Its bounds: a listen backlog that holds a burst of new connections (kubelet's probes open one
per probe and give up after a second, shorter than a dropped SYN's retransmit); a connection
that sends nothing for `idle_timeout` seconds is closed, keep-alive or not; beyond
`max_connections` open at once a new one is answered 503 and closed, without a thread.
"""

from __future__ import annotations

import contextlib
import gzip
import selectors
import socket
import socketserver
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from edl_agent.address import parse_host_port
from edl_agent.runtime.supervisor import StopSignal, on_stop

# Connections waiting to be accepted; the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 128
# Each open connection holds a thread: one silent (idle keep-alive, or never a request) for this
# long is closed. Prometheus reconnects on its next scrape; probes open a new one each time.
IDLE_TIMEOUT_SECONDS = 5.0
# Connections served at once; more are turned away (503) rather than each given a thread.
MAX_CONNECTIONS = 128

Readiness = Callable[[], tuple[bool, str]]


def _always_ready() -> tuple[bool, str]:
    return True, "ready"


def parse_address(address: str) -> tuple[str, int]:
    """`:9400` (every interface), `127.0.0.1:9400`, `localhost:9400`, `[::1]:9400` →
    (host, port); host is "" for every interface. Raises ValueError naming the problem."""
    return parse_host_port(address)


def _wake_up(wake: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed: the serving loop has ended already
        wake.send(b"\0")


def _accept(server: _HTTPServer) -> None:
    """Take one waiting connection and hand it on (what `serve_forever` does for each)."""
    try:
        request, client_address = server.get_request()
    except OSError:  # gone again before it was taken (BlockingIOError among them)
        return
    try:
        server.process_request(request, client_address)
    except Exception:
        server.handle_error(request, client_address)
        server.shutdown_request(request)


_TOO_MANY = b"too many connections; try again\n"
_TURNED_AWAY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
    % (len(_TOO_MANY), _TOO_MANY)
)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[BaseHTTPRequestHandler],
        app: MetricsServer,
        *,
        idle_timeout: float,
        max_connections: int,
    ) -> None:
        self.app = app
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.connections = 0
        self._counting = threading.Lock()
        self.dual_stack = False
        if host:
            family, *_, sockaddr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            self.address_family = family
            bind: tuple[Any, ...] = (sockaddr[0], port)
        elif socket.has_dualstack_ipv6():
            self.address_family = socket.AF_INET6
            self.dual_stack = True
            bind = ("::", port)
        else:
            self.address_family = socket.AF_INET
            bind = ("0.0.0.0", port)  # noqa: S104 - an empty host asks for every interface
        super().__init__(bind, handler)

    def server_bind(self) -> None:
        if self.dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind would look up our own FQDN (a DNS query) for nothing.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection, or a 503 and close when `max_connections` are open."""
        with self._counting:
            admitted = self.connections < self.max_connections
            if admitted:
                self.connections += 1
        if not admitted:
            with contextlib.suppress(OSError):
                request.setblocking(False)  # a new connection's send buffer takes it at once
                request.send(_TURNED_AWAY)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name="metrics-connection",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            self._left()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._left()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke or went silent is the client's doing: closed without a word
        (the default prints a traceback to stderr)."""
        if not isinstance(sys.exc_info()[1], OSError):
            structlog.get_logger().exception("metrics request failed")

    def _left(self) -> None:
        with self._counting:
            self.connections -= 1


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle's algorithm on, a keep-alive client's
    # delayed ACK holds the body back ~40 ms on every scrape.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged: a scrape every few seconds would drown everything else."""

    def _answer(self, *, send_body: bool) -> None:
        app = self.server.app
        path = urlsplit(self.path).path
        headers: dict[str, str] = {}
        if path == "/metrics":
            status, body, content_type = app.metrics(self.headers.get("Accept", ""))
            if "gzip" in self.headers.get("Accept-Encoding", "") and status == 200:
                body = gzip.compress(body, compresslevel=1)
                headers["Content-Encoding"] = "gzip"
        elif path == "/healthz":
            status, body, content_type = 200, b"ok\n", "text/plain; charset=utf-8"
        elif path == "/readyz":
            status, body = app.readiness()
            content_type = "text/plain; charset=utf-8"
        else:
            status, body = 404, f"not found: {path}; try /metrics, /healthz or /readyz\n".encode()
            content_type = "text/plain; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)


class MetricsServer:
    """Serves `registry` at /metrics on `address` (see `parse_address`); port 0 picks a free
    port, readable from `port` once bound. `idle_timeout` and `max_connections`: see above."""

    name = "metrics"

    def __init__(
        self,
        address: str,
        registry: CollectorRegistry,
        *,
        ready: Readiness = _always_ready,
        idle_timeout: float = IDLE_TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host, self._requested_port = parse_address(address)
        self.registry = registry
        self._ready = ready
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._server: _HTTPServer | None = None
        self._serving: tuple[StopSignal, threading.Thread] | None = None
        self._log = structlog.get_logger().bind(address=address)

    @property
    def port(self) -> int:
        """The bound port (the requested one until bound)."""
        server = self._server
        if server is None:
            return self._requested_port
        return int(server.server_address[1])

    @property
    def connections(self) -> int:
        """The connections open now, each held by a thread."""
        server = self._server
        return 0 if server is None else server.connections

    @property
    def url(self) -> str:
        host = self.host or "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def bind(self) -> None:
        """Take the address (OSError when it is taken or cannot be had); served by `run`."""
        self._bound()

    def _bound(self) -> _HTTPServer:
        if self._server is None:
            self._server = _HTTPServer(
                self.host,
                self._requested_port,
                _Handler,
                self,
                idle_timeout=self._idle_timeout,
                max_connections=self._max_connections,
            )
            self._server.socket.setblocking(False)  # accepted once `select` says one waits
            self._log.info("serving metrics", port=self.port)
        return self._server

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Serve until `stop` (a `StopSignal`), binding first unless `bind()` did; the address
        is released when stopped. Ready once it listens."""
        server = self._bound()
        wake, woken = socket.socketpair()
        forget = on_stop(stop, lambda: _wake_up(wake))
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(server.socket, selectors.EVENT_READ)
                selector.register(woken, selectors.EVENT_READ)
                ready()
                while not stop.is_set():
                    for key, _ in selector.select():
                        if key.fileobj is server.socket:
                            _accept(server)
        finally:
            forget()
            wake.close()
            woken.close()
            if stop.is_set():
                self.close()

    def close(self) -> None:
        """Release the address (after `run` ended, or when it never ran)."""
        server, self._server = self._server, None
        if server is not None:
            server.server_close()

    def start(self) -> None:
        """Bind, then serve on a thread of this object's own until `stop()`: for a process
        that runs no supervisor over it."""
        if self._serving is not None:
            return
        self.bind()
        stop = StopSignal()
        thread = threading.Thread(
            target=self.run, args=(stop, lambda: None), name="metrics-http", daemon=True
        )
        self._serving = stop, thread
        thread.start()

    def stop(self) -> None:
        """End what `start()` began: stop accepting, release the address, wait for the thread."""
        serving, self._serving = self._serving, None
        if serving is None:
            self.close()
            return
        stop, thread = serving
        stop.set()
        thread.join()

    def metrics(self, accept: str) -> tuple[int, bytes, str]:
        encoder, content_type = choose_encoder(accept)
        try:
            return 200, encoder(self.registry), content_type
        except Exception as exc:  # a broken collector answers 500, never kills the server
            self._log.exception("metrics exposition failed")
            return 500, f"metrics exposition failed: {exc}\n".encode(), "text/plain; charset=utf-8"

    def readiness(self) -> tuple[int, bytes]:
        try:
            ok, reason = self._ready()
        except Exception as exc:
            self._log.exception("readiness check failed")
            ok, reason = False, f"readiness check failed: {exc}"
        return (200 if ok else 503), f"{reason}\n".encode()

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
