"""The restarter's fault intake: the `edl.fault.v1.FaultIntake` gRPC service and its server.

Every call is authenticated (see `auth`): a call without a token, with a token TokenReview does
not accept, or from another ServiceAccount fails as a whole (UNAUTHENTICATED or
PERMISSION_DENIED); a fault about another node than the token's is refused on its own. Refusals
are logged (one line per reason per `log_interval`, with the number left out) and counted by
reason, never acted on. When the API server cannot review a token the call fails UNAVAILABLE and
the agent retries. Accepted faults go to `on_fault` once per id (among the last `remember` ids):
a repeat is answered DUPLICATE. `on_fault` runs on the gRPC worker thread, so it should only
hand the fault on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
import structlog

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.address import is_loopback
from edl_agent.bounded import BoundedSet
from edl_agent.config import MAX_SHARES_PER_DEVICE
from edl_agent.faults.convert import InvalidFault, from_proto
from edl_agent.faults.model import Fault, PodRef
from edl_agent.restarter.auth import (
    Identity,
    Refusal,
    Review,
    ReviewUnavailable,
    bearer_token,
    caller_refusal,
    fault_refusal,
)
from edl_agent.restarter.server_tls import CertificateError, ReloadingCertificate

log = structlog.get_logger(__name__)

# A fault names the pods holding one device or one container's pod: at most as many as share one
# device (time-slicing replicas). One report naming 100,000 pods would otherwise cost as many
# API reads and hold up every other fault behind it.
MAX_PODS_PER_FAULT = MAX_SHARES_PER_DEVICE

CALL_STATUS = {
    Refusal.NO_TOKEN: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.INVALID_TOKEN: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.WRONG_SERVICE_ACCOUNT: grpc.StatusCode.PERMISSION_DENIED,
}


class IntakeError(Exception):
    """The intake cannot serve (bad address, unreadable certificate); the message says why."""


@dataclass(frozen=True)
class IntakeCounts:
    accepted: int = 0
    duplicates: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)  # by Refusal value
    review_errors: int = 0
    sink_errors: int = 0


class FaultIntake(fault_pb2_grpc.FaultIntakeServicer):
    """The servicer. `agent_user` is the agent's ServiceAccount user name
    (`auth.service_account_user(namespace, name)`)."""

    def __init__(
        self,
        *,
        review: Review,
        agent_user: str,
        on_fault: Callable[[Fault], None],
        remember: int = 100_000,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        find_pod: Callable[[PodRef], Mapping[str, Any] | None] | None = None,
    ) -> None:
        """`find_pod` looks a named pod up in the restarter's pod cache (None: not known)."""
        self._find_pod = find_pod
        self._review = review
        self._agent_user = agent_user
        self._on_fault = on_fault
        self._remember = remember
        self._log_interval = log_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._seen = BoundedSet(self._remember)
        self._counts = IntakeCounts()
        self._refused: Counter[str] = Counter()
        self._last_logged: dict[str, tuple[float, int]] = {}  # reason → (when, left out since)

    def counts(self) -> IntakeCounts:
        with self._lock:
            return dataclasses.replace(self._counts, refused=dict(self._refused))

    def Report(self, request: Any, context: Any) -> fault_pb2.ReportResponse:
        peer = context.peer()
        token = bearer_token(context.invocation_metadata())
        if token is None:
            self._refuse_call(context, Refusal.NO_TOKEN, peer=peer, faults=len(request.faults))
        try:
            identity = self._review(token)
        except ReviewUnavailable as exc:
            with self._lock:
                self._counts = dataclasses.replace(
                    self._counts, review_errors=self._counts.review_errors + 1
                )
            self._log_throttled("review_error", "cannot review a token", error=str(exc))
            _abort(context, grpc.StatusCode.UNAVAILABLE, "cannot check the token now; retry")
        refusal = caller_refusal(identity, agent_user=self._agent_user)
        if refusal is not None:
            self._refuse_call(
                context,
                refusal,
                peer=peer,
                faults=len(request.faults),
                user=identity.username,
                error=identity.error,
            )
        acks = []
        for message in request.faults:
            try:
                acks.append(self._judge(message, identity, peer))
            except Exception:
                log.exception("the fault sink failed; the agent will send it again", peer=peer)
                _abort(context, grpc.StatusCode.INTERNAL, "the restarter could not take a fault")
        return fault_pb2.ReportResponse(acks=acks)

    def _judge(self, message: fault_pb2.Fault, identity: Identity, peer: str) -> fault_pb2.Ack:
        try:
            fault = from_proto(message)
        except InvalidFault as exc:
            return self._refuse_fault(message.id, Refusal.INVALID_FAULT, peer=peer, error=str(exc))
        refusal = fault_refusal(fault.node, identity)
        if refusal is not None:
            return self._refuse_fault(
                fault.id, refusal, peer=peer, fault_node=fault.node, token_node=identity.node
            )
        if len(fault.pods) > MAX_PODS_PER_FAULT:
            return self._refuse_fault(
                fault.id, Refusal.TOO_MANY_PODS, peer=peer, pods=len(fault.pods)
            )
        elsewhere = self._pod_elsewhere(fault)
        if elsewhere is not None:
            return self._refuse_fault(
                fault.id, Refusal.POD_ELSEWHERE, peer=peer, pod=elsewhere, token_node=fault.node
            )
        with self._lock:
            if not self._seen.add(fault.id, refresh=True):
                self._counts = dataclasses.replace(
                    self._counts, duplicates=self._counts.duplicates + 1
                )
                return fault_pb2.Ack(fault_id=fault.id, verdict=fault_pb2.VERDICT_DUPLICATE)
        try:
            self._on_fault(dataclasses.replace(fault, source="agent"))
        except Exception:
            with self._lock:
                self._seen.discard(fault.id)
                self._counts = dataclasses.replace(
                    self._counts, sink_errors=self._counts.sink_errors + 1
                )
            raise
        with self._lock:
            self._counts = dataclasses.replace(self._counts, accepted=self._counts.accepted + 1)
        return fault_pb2.Ack(fault_id=fault.id, verdict=fault_pb2.VERDICT_ACCEPTED)

    def _pod_elsewhere(self, fault: Fault) -> str | None:
        """A pod the fault names that the pod cache shows on another node, or as another pod by
        that name: an agent is believed only about its own node. A pod the cache does not know
        is let through (the decision finds nothing to restart), so a cache a moment behind the
        agent loses no fault."""
        if self._find_pod is None:
            return None
        for ref in fault.pods:
            pod = self._find_pod(ref)
            if pod is None:
                continue
            node = (pod.get("spec") or {}).get("nodeName")
            uid = (pod.get("metadata") or {}).get("uid")
            if node != fault.node or (ref.uid and uid != ref.uid):
                return f"{ref.namespace}/{ref.name}"
        return None

    def _refuse_call(self, context: Any, refusal: Refusal, **details: object) -> NoReturn:
        with self._lock:
            self._refused[refusal.value] += 1
        self._log_throttled(refusal.value, "fault report refused", reason=refusal.value, **details)
        _abort(context, CALL_STATUS[refusal], f"refused: {refusal.value}")

    def _refuse_fault(self, fault_id: str, refusal: Refusal, **details: object) -> fault_pb2.Ack:
        with self._lock:
            self._refused[refusal.value] += 1
        self._log_throttled(
            refusal.value, "fault refused", reason=refusal.value, fault_id=fault_id, **details
        )
        return fault_pb2.Ack(
            fault_id=fault_id, verdict=fault_pb2.VERDICT_REFUSED, reason=refusal.value
        )

    def _log_throttled(self, key: str, event: str, **details: object) -> None:
        now = self._clock()
        with self._lock:
            last, left_out = self._last_logged.get(key, (float("-inf"), 0))
            if now - last < self._log_interval:
                self._last_logged[key] = (last, left_out + 1)
                return
            self._last_logged[key] = (now, 0)
        log.warning(event, left_out=left_out, **details)


class IntakeServer:
    """Serves a FaultIntake on `listen` (`host:port`, `:port` for every address), with TLS when
    a certificate and key are given."""

    def __init__(
        self,
        intake: FaultIntake,
        *,
        listen: str,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        workers: int = 8,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            msg = "the intake's TLS needs both a certificate and a key"
            raise IntakeError(msg)
        self.intake = intake
        self.listen = f"[::]{listen}" if listen.startswith(":") else listen
        self._tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        self._workers = workers
        self.certificate: ReloadingCertificate | None = None
        self._server: Any = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.port = 0

    def start(self) -> None:
        """Bind and serve; `port` is then the bound port (useful with port 0)."""
        executor = futures.ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix="intake"
        )
        # gRPC sets SO_REUSEPORT by default: a second server on our port would share the calls.
        server = grpc.server(executor, options=[("grpc.so_reuseport", 0)])
        fault_pb2_grpc.add_FaultIntakeServicer_to_server(self.intake, server)  # type: ignore[no-untyped-call]
        try:
            if self._tls is None:
                if not is_loopback(self.listen):
                    log.warning("fault intake without TLS: tokens cross the network in clear")
                port = server.add_insecure_port(self.listen)
            else:
                self.certificate = ReloadingCertificate(*self._tls)
                port = server.add_secure_port(self.listen, self.certificate.credentials())
        except (OSError, RuntimeError, CertificateError) as exc:
            executor.shutdown(wait=False)
            msg = f"cannot serve the fault intake on {self.listen}: {exc}"
            raise IntakeError(msg) from None
        if not port:
            executor.shutdown(wait=False)
            msg = f"cannot serve the fault intake on {self.listen}"
            raise IntakeError(msg)
        server.start()
        self._server, self._executor, self.port = server, executor, port
        log.info("fault intake serving", listen=self.listen, port=port, tls=self._tls is not None)

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)  # raises, ending the call with this status
    msg = "grpc's context.abort returned"
    raise AssertionError(msg)
