"""The restarter's fault intake: the `edl.fault.v1.FaultIntake` gRPC service, which judges each
report and hands on what it believes (`intake_server` serves it).

Every call is authenticated (see `auth`): a call without a token, with a token TokenReview does
not accept, or from another ServiceAccount fails as a whole (UNAUTHENTICATED or
PERMISSION_DENIED). When the API server cannot review a token the call fails UNAVAILABLE and
the agent retries.

An agent is believed only about its own node. Each fault of a call is judged first, on its own:
it is refused (Ack REFUSED with the `callers.Refusal` as reason; the agent drops it) when it is
about another node than the token's, names more pods than can share a device, is not a fault
at all, or names a pod the restarter's pod cache shows bound to another node; a ContainerExit
is believed only as the named pod's status shows it (`evidence`). Where the cache does not
show a pod or an exit, it may only be behind the agent: the fault is answered "retry later"
(Ack VERDICT_UNSPECIFIED, reason `retry_later: <refusal>`; the agent keeps it and sends it
again) until the cache has had `cache_lag` seconds since the first such answer, then refused
(`pod_unknown`, `pod_elsewhere`, `exit_not_seen`). Refusals and waits are logged (one line per
reason per `log_interval`, with the number left out) and counted by reason, never acted on.

What a believed fault carries is bounded (`faults.bounds`): a name longer than Kubernetes allows
is an invalid fault; the reason, the detail and the device ids are cut to their bounds with a
mark, and a time ahead of the restarter's clock becomes the time of receipt (counted and logged
when more than `MAX_CLOCK_AHEAD` ahead); each cut is counted by field and logged, and the fault
is accepted as cut.

Ids are scoped by observer: a believed ContainerExit keeps its canonical id
(`exit/<uid>/<container>/<n>`, as the restarter's own watcher derives it from the same status);
any other fault is kept as `agent/<node>/<id>` (`ids.observer_scoped_id`), so that an agent
cannot make the restarter take a real fault for a duplicate by sending its id first. The Ack
carries the id the agent sent.

Then the believed faults go, one by one and in order, to `on_fault`, which returns once the
fault is durably recorded and raises when it cannot be (API down, a timeout): the first
exception ends the whole call UNAVAILABLE (counted in `sink_errors`; the agent keeps every
fault of the call and sends them again, and those recorded already are then duplicates). An id
joins the seen-set (the last `remember` ids) only after `on_fault` returned, and a repeat is
answered DUPLICATE; two concurrent calls with one id may both reach `on_fault`, which dedupes.

Work per call is bounded: at most `MAX_FAULTS_PER_CALL` faults and `MAX_PODS_PER_CALL` named
pods are judged, and nothing more is handed on once the caller's deadline is near; what is left
gets no Ack, so the agent sends it again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.devices.settings import MAX_SHARES_PER_DEVICE
from edl_agent.faults.bounds import bound, too_long_name
from edl_agent.faults.convert import InvalidFault, from_proto
from edl_agent.faults.ids import observer_scoped_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.log_limit import LogLimiter
from edl_agent.restarter.core.callers import (
    Identity,
    Refusal,
    Review,
    ReviewUnavailable,
    bearer_token,
    caller_refusal,
    fault_refusal,
)
from edl_agent.restarter.core.evidence import Check, Outcome, check_exit, check_pod
from edl_agent.restarter.core.metrics import IntakeCounts
from edl_agent.runtime.bounded import BoundedMap, BoundedSet

log = structlog.get_logger(__name__)

# A fault names the pods holding one device or one container's pod: at most as many as share one
# device (time-slicing replicas). One report naming 100,000 pods would otherwise cost as many
# cache reads and hold up every other fault behind it.
MAX_PODS_PER_FAULT = MAX_SHARES_PER_DEVICE
# What one call may cost (the agent sends 100 faults a call): the rest waits for the next call.
MAX_FAULTS_PER_CALL = 1000
MAX_PODS_PER_CALL = 4 * MAX_PODS_PER_FAULT
# Hand nothing more on when less than this is left of the caller's deadline: its answer must
# still arrive.
DEADLINE_MARGIN = 0.5
# How long the pod cache may trail an agent (from the first "retry later" about a fault).
CACHE_LAG = 30.0
RETRY_LATER = "retry_later"
TRIMMED = {
    "reason": "fault reason cut to the intake's bound",
    "detail": "fault detail cut to the intake's bound",
    "device_ids": "fault device ids cut to the intake's bound",
    "observed_at": "fault dated ahead of the restarter's clock; taken as observed now",
}

CALL_STATUS = {
    Refusal.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NO_TOKEN: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.INVALID_TOKEN: grpc.StatusCode.UNAUTHENTICATED,
    Refusal.WRONG_SERVICE_ACCOUNT: grpc.StatusCode.PERMISSION_DENIED,
}

FindPod = Callable[[PodRef], Mapping[str, Any] | None]


@dataclass(frozen=True)
class _Believed:
    index: int  # in the call
    sent_id: str
    fault: Fault  # as handed on: its id canonical or scoped, source "agent"


class FaultIntake(fault_pb2_grpc.FaultIntakeServicer):
    """The servicer. `agent_user` is the agent's ServiceAccount user name
    (`callers.service_account_user(namespace, name)`); `find_pod` looks a named pod up in the
    restarter's pod cache (by uid, else by namespace and name; None: not known). Without
    `find_pod` no pod is known: a fault naming one waits out `cache_lag` and is refused."""

    def __init__(
        self,
        *,
        review: Review,
        agent_user: str,
        on_fault: Callable[[Fault], None],
        remember: int = 100_000,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        find_pod: FindPod | None = None,
        cache_lag: float = CACHE_LAG,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._find_pod: FindPod = find_pod or (lambda _ref: None)
        self._review = review
        self._agent_user = agent_user
        self._on_fault = on_fault
        self._remember = remember
        self._clock = clock
        self._now = now
        self._cache_lag = cache_lag
        self._lock = threading.Lock()
        self._seen = BoundedSet(self._remember)
        self._waiting: BoundedMap[str, float] = BoundedMap(self._remember)  # key → first wait
        self._counts = IntakeCounts()
        self._refused: Counter[str] = Counter()
        self._trimmed: Counter[str] = Counter()
        self._log_limit = LogLimiter(interval=log_interval, clock=clock)  # per reason

    def counts(self) -> IntakeCounts:
        with self._lock:
            return dataclasses.replace(
                self._counts, refused=dict(self._refused), trimmed=dict(self._trimmed)
            )

    def refuse_connection(self) -> None:
        """Count a connection the gate in front closed unread (peer_gate.py: logged there)."""
        with self._lock:
            self._refused[Refusal.TOO_MANY_CONNECTIONS.value] += 1

    def report_bytes(self, raw: bytes, context: Any) -> fault_pb2.ReportResponse:
        """`Report` for a request still encoded: one that does not decode (a string field with
        invalid UTF-8, say) is refused INVALID_ARGUMENT, where grpc's own decoding would answer
        INTERNAL without a word."""
        try:
            request = fault_pb2.ReportRequest.FromString(raw)
        except DecodeError as exc:
            self._refuse_call(context, Refusal.MALFORMED, peer=context.peer(), error=str(exc))
        return self.Report(request, context)

    def Report(self, request: Any, context: Any) -> fault_pb2.ReportResponse:
        peer = context.peer()
        identity = self._caller(request, context, peer)
        acks: dict[int, fault_pb2.Ack] = {}
        believed: list[_Believed] = []
        keys: set[str] = set()
        pods_left = MAX_PODS_PER_CALL
        for index, message in enumerate(request.faults[:MAX_FAULTS_PER_CALL]):
            pods = min(len(message.pods), MAX_PODS_PER_FAULT + 1)  # beyond: refused unread
            if pods > pods_left:
                break  # this and the rest wait for the next call
            pods_left -= pods
            verdict = self._judge(message, identity, peer)
            if isinstance(verdict, fault_pb2.Ack):
                acks[index] = verdict
            elif verdict.id in keys or self._known(verdict.id):
                acks[index] = self._duplicate(message.id)
            else:
                keys.add(verdict.id)
                believed.append(_Believed(index, message.id, verdict))
        for one in believed:
            if not _time_left(context):
                break  # unanswered: the agent sends them again
            self._hand_on(one.fault, context, peer)
            acks[one.index] = fault_pb2.Ack(
                fault_id=one.sent_id, verdict=fault_pb2.VERDICT_ACCEPTED
            )
        return fault_pb2.ReportResponse(acks=[acks[i] for i in sorted(acks)])

    def _caller(self, request: Any, context: Any, peer: str) -> Identity:
        """Who calls, when they may report at all; else the call ends here."""
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
        return identity

    def _judge(
        self, message: fault_pb2.Fault, identity: Identity, peer: str
    ) -> fault_pb2.Ack | Fault:
        """The Ack for a fault that is not to be handed on (refused, or wait); else the fault
        as it is to be handed on. Reads the pod cache, never calls `on_fault`."""
        if len(message.pods) > MAX_PODS_PER_FAULT:
            return self._refuse_fault(
                message.id, Refusal.TOO_MANY_PODS, peer=peer, pods=len(message.pods)
            )
        try:
            fault = from_proto(message)
        except InvalidFault as exc:
            return self._refuse_fault(message.id, Refusal.INVALID_FAULT, peer=peer, error=str(exc))
        too_long = too_long_name(fault)
        if too_long is not None:
            return self._refuse_fault(fault.id, Refusal.INVALID_FAULT, peer=peer, error=too_long)
        refusal = fault_refusal(fault.node, identity)
        if refusal is not None:
            return self._refuse_fault(
                fault.id, refusal, peer=peer, fault_node=fault.node, token_node=identity.node
            )
        fault = self._bounded(fault, peer)
        if fault.kind is FaultKind.CONTAINER_EXIT and (
            len(fault.pods) != 1 or fault.container is None
        ):
            return self._refuse_fault(
                fault.id, Refusal.INVALID_FAULT, peer=peer, error="an exit names one container"
            )
        return self._weigh(fault, peer)

    def _bounded(self, fault: Fault, peer: str) -> Fault:
        """`fault` within the bounds of `faults.bounds`; what was cut is counted and logged."""
        bounded = bound(fault, now=self._now())
        for name in bounded.trimmed:
            with self._lock:
                self._trimmed[name] += 1
            self._log_throttled(
                f"trimmed:{name}",
                TRIMMED[name],
                field=name,
                fault_id=fault.id,
                node=fault.node,
                peer=peer,
                **({"observed_at": fault.observed_at.isoformat()} if name == "observed_at" else {}),
            )
        return bounded.fault

    def _weigh(self, fault: Fault, peer: str) -> fault_pb2.Ack | Fault:
        """`_judge`'s second half: what the pod cache says about the pods `fault` names (and,
        for an exit, about the exit)."""
        scoped = observer_scoped_id(fault.node, fault.id)
        pods: list[PodRef] = []
        cached: Mapping[str, Any] | None = None
        for ref in fault.pods:
            cached = self._find_pod(ref)
            check = check_pod(ref, fault.node, cached)
            if check.outcome is not Outcome.BELIEVED:
                return self._answer(check, scoped, fault.id, peer=peer, pod=_name(ref))
            pods.append(ref if ref.uid else dataclasses.replace(ref, uid=_uid(cached)))
        if fault.kind is FaultKind.CONTAINER_EXIT and cached is not None:
            check, shown = check_exit(fault, cached)
            if shown is None:
                return self._answer(check, scoped, fault.id, peer=peer, pod=_name(fault.pods[0]))
            believed = shown  # the canonical id: the restarter's watcher derives the same
        else:
            believed = dataclasses.replace(fault, id=scoped, pods=tuple(pods), source="agent")
        with self._lock:
            self._waiting.pop(scoped, None)
        return believed

    def _answer(self, check: Check, key: str, fault_id: str, **details: object) -> fault_pb2.Ack:
        """A refusal; or, while the pod cache may still be behind, "retry later"."""
        refusal = check.refusal or Refusal.INVALID_FAULT
        if check.outcome is Outcome.NOT_YET:
            now = self._clock()
            with self._lock:
                first = self._waiting.get(key)
                if first is None:
                    self._waiting[key] = first = now
                waiting = now - first < self._cache_lag
                if waiting:
                    self._counts = dataclasses.replace(
                        self._counts, deferred=self._counts.deferred + 1
                    )
                else:
                    del self._waiting[key]
            if waiting:
                self._log_throttled(
                    f"{RETRY_LATER}:{refusal.value}",
                    "fault not shown by the pod cache (yet); the agent will send it again",
                    reason=refusal.value,
                    fault_id=fault_id,
                    **details,
                )
                return fault_pb2.Ack(
                    fault_id=fault_id,
                    verdict=fault_pb2.VERDICT_UNSPECIFIED,
                    reason=f"{RETRY_LATER}: {refusal.value}",
                )
        return self._refuse_fault(fault_id, refusal, **details)

    def _known(self, key: str) -> bool:
        """Whether `key` was handed on already (then it counts as the newest again)."""
        with self._lock:
            if key not in self._seen:
                return False
            self._seen.add(key, refresh=True)
            return True

    def _duplicate(self, sent_id: str) -> fault_pb2.Ack:
        with self._lock:
            self._counts = dataclasses.replace(self._counts, duplicates=self._counts.duplicates + 1)
        return fault_pb2.Ack(fault_id=sent_id, verdict=fault_pb2.VERDICT_DUPLICATE)

    def _hand_on(self, fault: Fault, context: Any, peer: str) -> None:
        """`on_fault`, and the fault's id remembered once it returned; the call ends UNAVAILABLE
        when it raised."""
        try:
            self._on_fault(fault)
        except Exception as exc:
            with self._lock:
                self._counts = dataclasses.replace(
                    self._counts, sink_errors=self._counts.sink_errors + 1
                )
            log.warning(
                "cannot record a fault; the agent will send it again",
                fault_id=fault.id,
                peer=peer,
                error=f"{type(exc).__name__}: {exc}",
            )
            _abort(context, grpc.StatusCode.UNAVAILABLE, "cannot record the faults now; retry")
        with self._lock:
            self._seen.add(fault.id, refresh=True)
            self._counts = dataclasses.replace(self._counts, accepted=self._counts.accepted + 1)

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
        left_out = self._log_limit.allow(key)
        if left_out is not None:
            log.warning(event, left_out=left_out, **details)


def _time_left(context: Any) -> bool:
    """Whether the caller still waits long enough for more work (no deadline: it does)."""
    remaining = context.time_remaining()
    return remaining is None or remaining > DEADLINE_MARGIN


def _name(ref: PodRef) -> str:
    return f"{ref.namespace}/{ref.name}"


def _uid(pod: Mapping[str, Any] | None) -> str:
    return str(((pod or {}).get("metadata") or {}).get("uid") or "")


def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)  # raises, ending the call with this status
    msg = "grpc's context.abort returned"
    raise AssertionError(msg)
