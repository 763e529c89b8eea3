"""Serves the fault intake (`intake.FaultIntake`) over gRPC: the listening address, TLS with a
certificate reloaded when its files change (`server_tls`), grpc core's own limits on connections
(how many, how long a handshake may take, how long one may idle, how many calls one may hold),
and, where asked for, a gate in front of it all that caps the connections from one address
(`peer_gate`). What grpc core frees after a storm of connections goes back to the system
(`runtime.heap`)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import structlog

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.address import is_loopback
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.peer_gate import PeerGate
from edl_agent.restarter.adapters.server_tls import CertificateError, ReloadingCertificate
from edl_agent.runtime import heap

log = structlog.get_logger(__name__)

SERVICE = "edl.fault.v1.FaultIntake"


class IntakeError(Exception):
    """The intake cannot serve (bad address, unreadable certificate); the message says why."""


class IntakeServer:
    """Serves a FaultIntake on `listen` (`host:port`, `:port` for every address), with TLS when
    a certificate and key are given, behind a gate that caps the connections from one address
    (peer_gate.py; none when `max_connections_per_peer` is 0)."""

    def __init__(
        self,
        intake: FaultIntake,
        *,
        listen: str,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        workers: int = 64,
        max_calls_per_connection: int = 16,
        max_connections: int = 8192,
        max_connections_per_peer: int = 0,
        handshake_timeout: float = 10.0,
        idle_timeout: float = 300.0,
        heap_trim_seconds: float = heap.DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            msg = "the intake's TLS needs both a certificate and a key"
            raise IntakeError(msg)
        self.intake = intake
        self.listen = f"[::]{listen}" if listen.startswith(":") else listen
        self._tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        self._workers = workers
        self._per_peer = max_connections_per_peer  # 0: no cap, no gate (peer_gate.py)
        self._max_connections = max_connections
        self.gate: PeerGate | None = None
        # grpc core closes a connection that has not finished its handshake in time (one that
        # never starts TLS held its memory for good), refuses those beyond the cap at accept,
        # sends an idle one GOAWAY, and caps the calls open on one connection. Keepalive pings
        # are policed by grpc's defaults (a client pinging more often than every 5 minutes
        # without calls is sent GOAWAY); agents send none.
        self._options: list[tuple[str, int]] = [
            ("grpc.so_reuseport", 0),  # gRPC's default 1 would let a second server share calls
            ("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.server_handshake_timeout_ms", int(handshake_timeout * 1000)),
            ("grpc.max_connection_idle_ms", int(idle_timeout * 1000)),
            ("grpc.max_concurrent_streams", max_calls_per_connection),
        ]
        # What grpc core freed after a storm of connections goes back to the system (heap.py).
        self.trimmer = heap.HeapTrimmer(heap_trim_seconds)
        self.certificate: ReloadingCertificate | None = None
        self._server: Any = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.port = 0

    def start(self) -> None:
        """Bind and serve; `port` is then the bound port (useful with port 0)."""
        executor = futures.ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix="intake"
        )
        server = grpc.server(executor, options=self._options)
        report = grpc.unary_unary_rpc_method_handler(
            self.intake.report_bytes,  # decoded there, to refuse what does not decode
            response_serializer=fault_pb2.ReportResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Report": report}),)
        )
        gate = None
        try:
            if self._per_peer:
                gate = PeerGate(
                    listen=self.listen,
                    per_peer=self._per_peer,
                    total=self._max_connections,
                    on_refused=self.intake.refuse_connection,
                )
            # Behind the gate, grpc listens where only the gate reaches.
            address = f"unix:{gate.target}" if gate is not None else self.listen
            if self._tls is None:
                if not is_loopback(self.listen):
                    log.warning("fault intake without TLS: tokens cross the network in clear")
                port = server.add_insecure_port(address)
            else:
                self.certificate = ReloadingCertificate(*self._tls)
                port = server.add_secure_port(address, self.certificate.credentials())
            if gate is not None and port:
                port = gate.port
        except (OSError, RuntimeError, CertificateError, ValueError) as exc:
            if gate is not None:
                gate.stop()
            executor.shutdown(wait=False)
            msg = f"cannot serve the fault intake on {self.listen}: {exc}"
            raise IntakeError(msg) from None
        if not port:
            if gate is not None:
                gate.stop()
            executor.shutdown(wait=False)
            msg = f"cannot serve the fault intake on {self.listen}"
            raise IntakeError(msg)
        server.start()
        if gate is not None:
            gate.start()
        self.trimmer.start()
        self._server, self._executor, self.port, self.gate = server, executor, port, gate
        log.info("fault intake serving", listen=self.listen, port=port, tls=self._tls is not None)

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (at most `grace` seconds for the calls in hand); called twice, from two
        threads even, it stops once."""
        server, self._server = self._server, None
        executor, self._executor = self._executor, None
        gate, self.gate = self.gate, None
        if server is not None:
            server.stop(grace).wait()
        if gate is not None:
            gate.stop()  # after grpc's grace: the calls in hand go on through it
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self.trimmer.stop()
