"""The intake's front door: takes its TCP connections, refuses those beyond `per_peer` from one
address (closed at once, before a byte is read), and relays the rest byte for byte to the grpc
server behind it. grpc core has a total cap on connections (`intake.max_connections`) but none
per peer: without this, one misbehaving client could take the whole cap and shut every agent out.

grpc listens on a unix socket (`target`) in a directory of the gate's own, mode 0700: no other
user reaches it, past the cap or in another's name (an abstract socket would take a connection
from any process in the network namespace). TLS passes through untouched: the grpc server
still holds the certificate, the handshake and idle timeouts. Each inner connection is bound,
in that directory, to a name that carries the peer's address (`<n>-<ip>:<port>`), so what grpc
says of its peer (`context.peer()`, in the intake's logs) still names it.

A side that ends its writing (`shutdown(SHUT_WR)`, or a TCP FIN) is passed on as such: once
what it sent is delivered, the other side's writing is shut down and the reverse direction
goes on. A pair closes when both directions have ended, on an error, or once a side hung up
(closed for good, as grpc closes one past its handshake or idle timeout): nothing can go to it.

One thread, one `selectors` loop: a peer that reads slowly holds up only its own connection (at
most `BUFFER_BYTES` wait for it in each direction, after which its other side is not read).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from edl_agent.address import parse_host_port
from edl_agent.log_limit import LogLimiter

log = structlog.get_logger(__name__)

BUFFER_BYTES = 256 << 10
READ_BYTES = 64 << 10
LOG_INTERVAL = 10.0  # at most one line per kind of trouble in this many seconds
SOCKET_PATH_BYTES = 107  # what a unix socket address holds, less its closing NUL


@dataclass(eq=False)
class _Side:
    sock: socket.socket
    pending: bytearray = field(default_factory=bytearray)  # read from the other side, unsent
    eof: bool = False  # the other side ended: this one's writing shuts once `pending` is sent
    finished: bool = False  # nothing more goes to this side (shut down for writing, or gone)


@dataclass(eq=False)
class _Pair:
    peer: str
    outer: _Side
    inner: _Side

    def other(self, side: _Side) -> _Side:
        return self.inner if side is self.outer else self.outer


class PeerGate:
    """Listens on `listen` (`host:port`, `:port` for every address) and relays to the unix
    socket `target`, which the server behind it binds (a path in a directory the gate made, under
    `directory` or the temporary directory, and removes on `stop`)."""

    def __init__(
        self,
        *,
        listen: str,
        per_peer: int,
        total: int,
        on_refused: Callable[[], None] = lambda: None,
        directory: Path | None = None,
        log_interval: float = LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listener = _listen(*parse_host_port(listen.replace("[::]:", ":", 1)))
        try:
            self.directory = _private_directory(directory)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self.target = self.directory / "intake"
        self._per_peer = per_peer
        self._total = total
        self._on_refused = on_refused  # counted in the intake's refusals (its metrics)
        self._log_limit = LogLimiter(interval=log_interval, clock=clock)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._names = itertools.count()
        self._pairs: set[_Pair] = set()
        self.open: Counter[str] = Counter()  # peer address → its connections now
        self.refused = 0

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="intake-gate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listener and every connection, and remove the directory; the thread
        ends. Also for a gate never started."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for pair in list(self._pairs):
            self._close(pair)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._round()
            except Exception:  # the intake's door stays open: logged, and the next round
                log.exception("intake gate round failed")
                self._stopped.wait(1.0)

    def _round(self) -> None:
        for key, events in self._selector.select():
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            else:
                pair, side = key.data
                if pair not in self._pairs:
                    continue  # closed by an earlier event of this round
                try:
                    self._serve(pair, side, events)
                except Exception:  # a bug costs this connection, never the intake's door
                    log.exception("intake gate failed on a connection; closed", peer=pair.peer)
                    self._close(pair)

    def _accept(self) -> None:
        for _ in range(64):  # a few at a time: the connections in hand are served in between
            try:
                outer, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: what waits is taken on the next round
                self._warn("accept", "intake gate cannot accept", error=str(exc))
                return
            peer = _host(address)
            if self.open[peer] >= self._per_peer:
                self._refuse(outer, peer, "per_peer")
                continue
            if sum(self.open.values()) >= self._total:
                self._refuse(outer, peer, "total")
                continue
            inner = self._connect_inner(address)
            if inner is None:
                outer.close()
                continue
            outer.setblocking(False)
            inner.setblocking(False)
            pair = _Pair(peer, _Side(outer), _Side(inner))
            self.open[peer] += 1
            self._pairs.add(pair)
            for side in (pair.outer, pair.inner):
                self._selector.register(side.sock, selectors.EVENT_READ, (pair, side))

    def _connect_inner(
        self, address: tuple[str, int] | tuple[str, int, int, int]
    ) -> socket.socket | None:
        """A connection to `target` bound to a name for the peer, so that grpc's
        `context.peer()` names it too; None (logged) when the server cannot be reached."""
        # Cut to what an address holds: the leading number alone keeps the name unique.
        name = os.fsencode(self.directory / f"{next(self._names):x}-{_shown(address)}")
        name = name[:SOCKET_PATH_BYTES]
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        inner.settimeout(1.0)  # grpc accepts at once; a full backlog must not hang the gate
        try:
            inner.bind(name)
            inner.connect(str(self.target))
        except OSError as exc:
            self._warn("connect", "intake gate cannot reach the intake", error=str(exc))
            inner.close()
            return None
        finally:
            Path(os.fsdecode(name)).unlink(
                missing_ok=True
            )  # the bound name stays the connection's all the same
        return inner

    def _refuse(self, connection: socket.socket, peer: str, cap: str) -> None:
        self.refused += 1
        self._on_refused()
        self._warn(
            f"refused:{cap}",
            "intake connection refused: too many connections",
            cap=cap,  # per_peer: from this address; total: in all
            peer=peer,
            per_peer=self._per_peer,
            total=self._total,
            refused=self.refused,
        )
        connection.close()  # as grpc closes one past its total cap

    def _warn(self, kind: str, event: str, **details: object) -> None:
        left_out = self._log_limit.allow(kind)
        if left_out is not None:
            log.warning(event, left_out=left_out, **details)

    def _serve(self, pair: _Pair, side: _Side, events: int) -> None:
        other = pair.other(side)
        try:
            if events & selectors.EVENT_WRITE and side.pending:
                sent = side.sock.send(side.pending)
                del side.pending[:sent]
            if events & selectors.EVENT_READ and not other.eof:
                data = side.sock.recv(READ_BYTES)
                if data:
                    other.pending += data
                else:
                    other.eof = True
                    if _hung_up(side.sock):  # closed, not just shut for writing
                        side.pending.clear()
                        side.eof = side.finished = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # reset by the peer, say
            self._close(pair)
            return
        for one in (pair.outer, pair.inner):
            if one.eof and not one.pending and not one.finished:
                one.finished = True
                try:
                    one.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    self._close(pair)
                    return
        if pair.outer.finished and pair.inner.finished:
            self._close(pair)
            return
        for one in (pair.outer, pair.inner):
            self._watch(pair, one)

    def _watch(self, pair: _Pair, side: _Side) -> None:
        """Read from `side` while the other side's backlog is short; write while it has some."""
        other = pair.other(side)
        events = 0
        if len(other.pending) < BUFFER_BYTES and not other.eof:
            events |= selectors.EVENT_READ
        if side.pending:
            events |= selectors.EVENT_WRITE
        registered = side.sock in self._selector.get_map()
        if events and registered:
            self._selector.modify(side.sock, events, (pair, side))
        elif events:
            self._selector.register(side.sock, events, (pair, side))
        elif registered:  # neither: it waits for the other side to drain, or it is done
            self._selector.unregister(side.sock)

    def _close(self, pair: _Pair) -> None:
        if pair not in self._pairs:
            return
        self._pairs.discard(pair)
        for side in (pair.outer, pair.inner):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(side.sock)
            side.sock.close()
        self.open[pair.peer] -= 1
        if self.open[pair.peer] <= 0:
            del self.open[pair.peer]


def _private_directory(parent: Path | None) -> Path:
    """A new directory that only this user (and root) may enter: under `parent`, else the
    temporary directory, else /dev/shm (writable where the root filesystem is read-only)."""
    try:
        return Path(tempfile.mkdtemp(prefix="edl-", dir=parent))  # mode 0700
    except OSError:
        if parent is not None:
            raise
    return Path(tempfile.mkdtemp(prefix="edl-", dir="/dev/shm"))


def _hung_up(sock: socket.socket) -> bool:
    """Whether both directions of `sock` ended: its peer closed it, not just its writing."""
    poller = select.poll()
    poller.register(sock, 0)  # POLLHUP is reported unasked
    return any(events & select.POLLHUP for _, events in poller.poll(0))


def _listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket: every address (IPv6 and IPv4, or IPv4 alone where the
    host has no IPv6) for an empty `host`."""
    families = [socket.AF_INET6, socket.AF_INET] if not host else [_family(host)]
    for family in families:
        try:
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            if family is families[-1]:
                raise
            continue
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and not host:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            everywhere = "::" if family == socket.AF_INET6 else "0.0.0.0"  # noqa: S104 - `:port`
            listener.bind((host or everywhere, port))
            listener.listen(1024)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        return listener
    msg = "no address family to listen with"
    raise OSError(msg)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _host(address: tuple[str, int] | tuple[str, int, int, int]) -> str:
    host = address[0]
    return host.removeprefix("::ffff:")  # an IPv4 peer on a dual-stack socket


def _shown(address: tuple[str, int] | tuple[str, int, int, int]) -> str:
    host = _host(address)
    return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
