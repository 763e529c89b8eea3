"""The outbox sender: a supervised part that delivers pending faults to the restarter's FaultIntake.

Every call carries the agent's ServiceAccount token as `authorization: Bearer <token>`, read from
the token file each time since kubelet rotates projected tokens. Accepted and duplicate faults
leave the outbox; refused ones are logged, counted and dropped too, since a refusal does not
change on retry. A call that fails as a whole (restarter down or unable to record the faults:
UNAVAILABLE; TLS, auth, a missing token file) leaves the batch in the outbox and is retried with
exponential backoff and jitter; so is a call that answered none of its faults.

A fault the restarter answers without a verdict (VERDICT_UNSPECIFIED, its reason
`retry_later: ...`: its pod cache does not show the pod or the exit yet) or leaves unanswered
(it answers at most so many a call) stays in the outbox and goes again: at once when the call
settled other faults, else after `retry_later` seconds or the next enqueue, whichever comes
first; it is no call failure. An enqueue wakes the sender at once; the stop cancels a call in
flight, sends nothing more and leaves the outbox on disk. Anything else that goes wrong (a bug)
ends the part, and the supervisor runs it again.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import structlog

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.address import is_loopback
from edl_agent.config import FaultSettings
from edl_agent.faults.convert import to_proto
from edl_agent.faults.model import Fault
from edl_agent.faults.outbox import Outbox
from edl_agent.runtime.backoff import backoff_delay
from edl_agent.runtime.supervisor import on_stop

log = structlog.get_logger(__name__)

LOG_EVERY_FAILURES = 10  # a long outage logs its first failure and then every tenth

RECONNECT_MAX_MS = 1000


@dataclass(frozen=True)
class SenderSettings:
    address: str
    """The restarter's intake: `host:port`, or `unix:PATH`."""
    token_file: Path
    """The agent's ServiceAccount token (a projected volume), re-read for every call."""
    ca_file: Path | None = None
    """PEM CA bundle: speak TLS and check the restarter's certificate against it. Without one,
    plaintext, which is allowed only to a loopback address or with `insecure`."""
    server_name: str = ""
    """The name the restarter's certificate must carry, when it is not the address's host."""
    insecure: bool = False
    """Allow plaintext to a non-loopback address (the token then crosses the network in clear)."""
    batch_size: int = 100
    call_timeout: float = 10.0
    backoff_initial: float = 0.5
    backoff_max: float = 5.0
    retry_later: float = 1.0
    """Seconds before faults the restarter asked to be sent again later go again."""

    @classmethod
    def from_settings(cls, settings: FaultSettings) -> SenderSettings:
        """The sender's settings from the agent's `faults` section."""
        return cls(
            address=settings.restarter_address,
            token_file=Path(settings.token_file),
            ca_file=Path(settings.ca_file) if settings.ca_file else None,
            server_name=settings.server_name,
            insecure=settings.insecure,
            batch_size=settings.batch_size,
            call_timeout=settings.call_timeout_seconds,
            backoff_initial=settings.backoff_initial_seconds,
            backoff_max=settings.backoff_max_seconds,
            retry_later=settings.retry_later_seconds,
        )


@dataclass(frozen=True)
class SenderCounts:
    accepted: int = 0
    duplicates: int = 0
    refused: int = 0
    call_failures: int = 0
    deferred: int = 0  # faults the restarter asked to be sent again later (each time)


class CallFailed(Exception):
    """A call that brought no verdict; its batch stays in the outbox."""


class SendLater(Exception):
    """A call that settled none of its faults but was answered: the restarter asked for them
    again later (or left them unanswered); they stay in the outbox."""


class Sender:
    """Delivers `outbox` to the restarter: a supervised part, ready at once."""

    name = "fault-sender"

    def __init__(
        self,
        outbox: Outbox,
        settings: SenderSettings,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        jitter: Callable[[], float] = random.random,
    ) -> None:
        if settings.ca_file is None and not settings.insecure and not is_loopback(settings.address):
            msg = (
                f"refusing to send the agent's token in plaintext to {settings.address}: "
                "configure the restarter's CA file, or allow plaintext explicitly"
            )
            raise ValueError(msg)
        self._outbox = outbox
        self._settings = settings
        self._now = now
        self._jitter = jitter
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._channel_lock = threading.Lock()
        self._channel: Any = None
        self._counts = SenderCounts()
        outbox.add_listener(self._wake.set)

    def counts(self) -> SenderCounts:
        return self._counts

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Send until `stop` (a `StopSignal`: it cancels the call in flight)."""
        with self._channel_lock:
            self._stopping = stopping = threading.Event()
        forget = on_stop(stop, lambda: self._interrupt(stopping))
        try:
            ready()
            self._send(stopping)
        finally:
            forget()
            self._interrupt(stopping)

    def _interrupt(self, stopping: threading.Event) -> None:
        """Send nothing more: a wait ends, and closing the channel cancels a call in flight."""
        with self._channel_lock:
            stopping.set()
            channel, self._channel = self._channel, None
        self._wake.set()
        if channel is not None:
            channel.close()

    def _send(self, stopping: threading.Event) -> None:
        failures = 0
        while not stopping.is_set():
            self._wake.clear()
            batch = self._outbox.pending(self._settings.batch_size)
            if not batch:
                self._wake.wait()
                continue
            try:
                self._deliver(batch)
            except SendLater:
                self._wake.wait(self._settings.retry_later)  # an enqueue or stop wakes it
                continue
            except CallFailed as exc:
                if stopping.is_set():
                    return
                failures += 1
                self._count(call_failures=1)
                if failures == 1 or failures % LOG_EVERY_FAILURES == 0:
                    log.warning(
                        "cannot report faults to the restarter; will retry",
                        error=str(exc),
                        failures=failures,
                        pending=len(self._outbox),
                    )
            else:
                if failures:
                    log.info("reporting faults to the restarter again", after_failures=failures)
                failures = 0
                continue
            stopping.wait(
                backoff_delay(
                    failures,
                    initial=self._settings.backoff_initial,
                    maximum=self._settings.backoff_max,
                    jitter=self._jitter(),
                )
            )

    def _deliver(self, batch: Sequence[Fault]) -> None:
        request = fault_pb2.ReportRequest(faults=[to_proto(f) for f in batch])
        request.sent_at.FromDatetime(self._now())
        metadata = (("authorization", f"Bearer {self._token()}"),)
        try:
            response = self._stub().Report(
                request, metadata=metadata, timeout=self._settings.call_timeout
            )
        except grpc.RpcError as exc:
            raise CallFailed(f"{exc.code().name}: {exc.details()}") from None
        acks = {ack.fault_id: ack for ack in response.acks}
        done: list[str] = []
        refused: list[tuple[str, str]] = []
        later = unanswered = 0
        for fault in batch:
            ack = acks.get(fault.id)
            if ack is None:
                unanswered += 1
            elif ack.verdict == fault_pb2.VERDICT_UNSPECIFIED:
                later += 1  # the restarter's cache may be behind us: again later
            elif ack.verdict == fault_pb2.VERDICT_REFUSED:
                refused.append((fault.id, ack.reason))
            else:
                done.append(fault.id)
        self._outbox.ack([*done, *(fault_id for fault_id, _ in refused)])
        duplicates = sum(acks[i].verdict == fault_pb2.VERDICT_DUPLICATE for i in done)
        self._count(
            accepted=len(done) - duplicates,
            duplicates=duplicates,
            refused=len(refused),
            deferred=later,
        )
        for fault_id, reason in refused:
            log.warning("the restarter refused a fault; dropped", fault_id=fault_id, reason=reason)
        if done or refused:
            return  # progress: the rest goes with the next batch at once
        if later:
            raise SendLater
        msg = f"the restarter answered none of {len(batch)} faults"
        raise CallFailed(msg)

    def _token(self) -> str:
        try:
            token = self._settings.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            msg = f"cannot read the token file {self._settings.token_file}: {exc}"
            raise CallFailed(msg) from None
        if not token:
            msg = f"the token file {self._settings.token_file} is empty"
            raise CallFailed(msg)
        return token

    def _stub(self) -> Any:
        with self._channel_lock:
            if self._stopping.is_set():
                msg = "stopping"
                raise CallFailed(msg)
            if self._channel is None:
                self._channel = self._open_channel()
            return fault_pb2_grpc.FaultIntakeStub(self._channel)  # type: ignore[no-untyped-call]

    def _open_channel(self) -> Any:
        settings = self._settings
        backoff_ms = int(settings.backoff_initial * 1000)
        # gRPC's own reconnect backoff (up to 120 s) would outlast ours after an outage, and
        # adds to it: a call made while the channel waits to reconnect fails at once. A connect
        # attempt is cheap, so the channel tries again within a second; our backoff paces calls.
        most_ms = max(backoff_ms, min(int(settings.backoff_max * 1000), RECONNECT_MAX_MS))
        options: list[tuple[str, str | int]] = [
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", most_ms),
        ]
        if settings.ca_file is None:
            return grpc.insecure_channel(settings.address, options=options)
        try:
            ca = settings.ca_file.read_bytes()
        except OSError as exc:
            msg = f"cannot read the CA file {settings.ca_file}: {exc}"
            raise CallFailed(msg) from None
        if settings.server_name:
            options.append(("grpc.ssl_target_name_override", settings.server_name))
        credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        return grpc.secure_channel(settings.address, credentials, options=options)

    def _count(self, **increments: int) -> None:
        current = self._counts
        self._counts = dataclasses.replace(
            current, **{name: getattr(current, name) + n for name, n in increments.items()}
        )
