"""Agent outbox sender → restarter intake over loopback gRPC, with a stand-in token reviewer.

The real TokenReview is exercised in tests/cluster/test_intake.py; here the rules, the caches,
the verdicts, the retries and TLS are checked without a control plane.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.address import is_loopback
from edl_agent.faults.convert import to_proto
from edl_agent.faults.ids import container_exit_id
from edl_agent.faults.model import Fault, PodRef
from edl_agent.faults.outbox import Outbox
from edl_agent.faults.pod_faults import container_exit_faults
from edl_agent.faults.sender import RECONNECT_MAX_MS, Sender, SenderSettings
from edl_agent.restarter.adapters.auth import CachedReviewer
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.intake_server import IntakeError, IntakeServer
from edl_agent.restarter.core.callers import (
    NODE_NAME_EXTRA,
    Identity,
    ReviewUnavailable,
    bearer_token,
    service_account_user,
)
from edl_agent.runtime.backoff import backoff_delay
from tests.parts import running
from tests.parts import stop as stop_parts
from tests.waiting import wait_until

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
AGENT = service_account_user("edl-system", "edl-agent")


def on_node(node: str, user: str = AGENT) -> Identity:
    return Identity(authenticated=True, username=user, extra={NODE_NAME_EXTRA: (node,)})


TOKENS = {
    "agent-a": on_node("node-a"),
    "agent-b": on_node("node-b"),
    "agent-unbound": Identity(authenticated=True, username=AGENT),
    "intruder-a": on_node("node-a", service_account_user("ml", "default")),
}


@dataclass
class StandInReviewer:
    """Answers from TOKENS; `down` makes it fail as an unreachable API server does."""

    down: bool = False
    calls: Counter[str] = field(default_factory=Counter)

    def __call__(self, token: str) -> Identity:
        self.calls[token] += 1
        if self.down:
            msg = "API server unreachable"
            raise ReviewUnavailable(msg)
        return TOKENS.get(token, Identity(authenticated=False, error="invalid bearer token"))


def worker(n: int, node: str = "node-a") -> dict[str, Any]:
    """Pod `worker-<n>` as the restarter's pod cache shows it: its container exited 1."""
    finished = (T0 + timedelta(seconds=n)).strftime("%Y-%m-%dT%H:%M:%SZ")
    exited = {"exitCode": 1, "reason": "Error", "finishedAt": finished}
    return {
        "metadata": {"namespace": "ml", "name": f"worker-{n}", "uid": f"uid-{n}"},
        "spec": {"nodeName": node},
        "status": {
            "containerStatuses": [
                {"name": "worker", "restartCount": 0, "state": {"terminated": exited}}
            ]
        },
    }


def cached_pod(ref: PodRef) -> dict[str, Any] | None:
    """The stand-in pod cache: every `worker-<n>` runs on node-a."""
    prefix, _, n = ref.name.partition("-")
    return worker(int(n)) if prefix == "worker" and n.isdigit() else None


def fault(n: int, node: str = "node-a") -> Fault:
    """The exit of `worker-<n>` as the agent on `node` reports it."""
    [exited] = container_exit_faults(worker(n, node), now=T0, source="agent")
    return exited


def fid(n: int) -> str:
    return container_exit_id(f"uid-{n}", "worker", 0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Restarter:
    """An intake on loopback whose sink records what it was given."""

    def __init__(self, port: int = 0, **server: object) -> None:
        self.reviewer = StandInReviewer()
        self.received: list[Fault] = []
        self.received_at: list[float] = []  # time.monotonic() of each, in order
        self.fail_sink = False
        self.not_cached: set[str] = set()  # pods the cache does not show (yet)
        self._lock = threading.Lock()
        self.intake = FaultIntake(
            review=self.reviewer, agent_user=AGENT, on_fault=self._sink, find_pod=self._find_pod
        )
        self.server = IntakeServer(self.intake, listen=f"127.0.0.1:{port}", **server)  # type: ignore[arg-type]

    def _sink(self, f: Fault) -> None:
        if self.fail_sink:
            msg = "policy queue full"
            raise RuntimeError(msg)
        with self._lock:
            self.received.append(f)
            self.received_at.append(time.monotonic())

    def _find_pod(self, ref: PodRef) -> dict[str, Any] | None:
        return None if ref.name in self.not_cached else cached_pod(ref)

    def ids(self) -> Counter[str]:
        with self._lock:
            return Counter(f.id for f in self.received)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest.fixture
def restarter() -> Iterator[Restarter]:
    running = Restarter()
    running.server.start()
    yield running
    running.server.stop(0)


def report(
    address: str, faults: list[Fault], token: str | None = None, **kw: object
) -> fault_pb2.ReportResponse:
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(address) as channel:
        stub = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
        request = fault_pb2.ReportRequest(faults=[to_proto(f) for f in faults])
        return stub.Report(request, metadata=metadata, timeout=5, **kw)  # type: ignore[no-any-return]


def verdicts(response: fault_pb2.ReportResponse) -> list[tuple[str, str, str]]:
    return [(a.fault_id, fault_pb2.Verdict.Name(a.verdict), a.reason) for a in response.acks]


# --- the rules, pure -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ([("authorization", "Bearer abc")], "abc"),
        ([("authorization", "bearer  abc ")], "abc"),
        ([("x-other", "1"), ("authorization", "Bearer abc")], "abc"),
        ([("authorization", "Basic abc")], None),
        ([("authorization", "Bearer ")], None),
        ([("authorization-bin", b"abc")], None),
        ([], None),
    ],
)
def test_bearer_token(metadata: list[tuple[str, str | bytes]], token: str | None) -> None:
    assert bearer_token(metadata) == token


def test_token_node_needs_exactly_one_name() -> None:
    assert on_node("n").node == "n"
    assert Identity(True, AGENT, {NODE_NAME_EXTRA: ("a", "b")}).node is None
    assert Identity(True, AGENT, {NODE_NAME_EXTRA: ("",)}).node is None
    assert Identity(True, AGENT).node is None


def test_the_review_cache_remembers_answers_not_failures() -> None:
    now = [0.0]
    reviewer = StandInReviewer()
    cached = CachedReviewer(reviewer, positive_ttl=60, negative_ttl=5, clock=lambda: now[0])
    for _ in range(3):
        assert cached("agent-a").node == "node-a"
        assert not cached("forged").authenticated
    assert reviewer.calls == {"agent-a": 1, "forged": 1}
    now[0] = 5.0
    cached("agent-a")
    cached("forged")
    assert reviewer.calls == {"agent-a": 1, "forged": 2}
    now[0] = 60.0
    cached("agent-a")
    assert reviewer.calls["agent-a"] == 2
    reviewer.down = True
    with pytest.raises(ReviewUnavailable):
        cached("agent-b")
    with pytest.raises(ReviewUnavailable):
        cached("agent-b")
    assert reviewer.calls["agent-b"] == 2


def test_the_review_cache_is_bounded() -> None:
    reviewer = StandInReviewer()
    cached = CachedReviewer(reviewer, max_entries=2)
    for token in ("agent-a", "agent-b", "intruder-a", "agent-a"):
        cached(token)
    assert reviewer.calls["agent-a"] == 2


def test_backoff_doubles_to_its_cap_with_jitter_in_the_upper_half() -> None:
    delays = [backoff_delay(n, initial=0.5, maximum=30, jitter=0.999999) for n in range(1, 10)]
    assert [round(d, 3) for d in delays] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff_delay(3, initial=0.5, maximum=30, jitter=0.0) == 1.0
    assert backoff_delay(10_000, initial=0.5, maximum=30, jitter=0.0) == 15.0


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:8443", True),
        ("[::1]:8443", True),
        ("localhost:8443", True),
        ("unix:/run/edl/intake.sock", True),
        ("10.0.0.7:8443", False),
        ("edl-restarter.edl-system.svc:8443", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_no_plaintext_tokens_over_the_network(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox")
    try:
        with pytest.raises(ValueError, match="plaintext"):
            Sender(outbox, SenderSettings("edl-restarter:8443", tmp_path / "token"))
        Sender(outbox, SenderSettings("edl-restarter:8443", tmp_path / "token", insecure=True))
    finally:
        outbox.close()


# --- the intake over gRPC --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "code", "reason"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED, "no_token"),
        ("forged", grpc.StatusCode.UNAUTHENTICATED, "invalid_token"),
        ("intruder-a", grpc.StatusCode.PERMISSION_DENIED, "wrong_service_account"),
    ],
)
def test_calls_are_refused_as_a_whole(
    restarter: Restarter, token: str | None, code: grpc.StatusCode, reason: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        report(restarter.address, [fault(1)], token)
    assert refused.value.code() == code
    assert reason in refused.value.details()
    assert restarter.intake.counts().refused == {reason: 1}
    assert restarter.received == []


def test_each_fault_is_judged_on_its_node(restarter: Restarter) -> None:
    bad = fault_pb2.ReportRequest(faults=[to_proto(fault(3))])
    bad.faults[0].ClearField("observed_at")
    response = report(restarter.address, [fault(1), fault(2, node="node-b")], "agent-a")
    assert verdicts(response) == [
        (fid(1), "VERDICT_ACCEPTED", ""),
        (fid(2), "VERDICT_REFUSED", "wrong_node"),
    ]
    unbound = report(restarter.address, [fault(4)], "agent-unbound")
    assert verdicts(unbound) == [(fid(4), "VERDICT_REFUSED", "wrong_node")]
    with grpc.insecure_channel(restarter.address) as channel:
        stub = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
        invalid = stub.Report(bad, metadata=[("authorization", "Bearer agent-a")], timeout=5)
    assert verdicts(invalid) == [(fid(3), "VERDICT_REFUSED", "invalid_fault")]
    assert restarter.intake.counts().refused == {"wrong_node": 2, "invalid_fault": 1}
    assert [f.id for f in restarter.received] == [fid(1)]


def test_a_report_that_does_not_decode_is_an_invalid_argument(restarter: Restarter) -> None:
    good = fault_pb2.ReportRequest(faults=[to_proto(fault(1))]).SerializeToString()
    node = fault(1).node.encode()
    broken = good.replace(node, node[:-1] + b"\xff")  # invalid UTF-8 in a string field
    assert broken != good
    with grpc.insecure_channel(restarter.address) as channel:
        raw = channel.unary_unary("/edl.fault.v1.FaultIntake/Report")
        metadata = [("authorization", "Bearer agent-a")]
        with pytest.raises(grpc.RpcError) as refused:
            raw(broken, metadata=metadata, timeout=5)
        assert raw(good, metadata=metadata, timeout=5)  # the same call, well formed, is taken
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in refused.value.details()
    assert restarter.intake.counts().refused == {"malformed": 1}
    assert [f.id for f in restarter.received] == [fid(1)]


def test_a_fault_is_taken_once(restarter: Restarter) -> None:
    first = report(restarter.address, [fault(1), fault(1)], "agent-a")
    again = report(restarter.address, [fault(1)], "agent-a")
    assert [v for _, v, _ in verdicts(first)] == ["VERDICT_ACCEPTED", "VERDICT_DUPLICATE"]
    assert [v for _, v, _ in verdicts(again)] == ["VERDICT_DUPLICATE"]
    assert restarter.ids() == {fid(1): 1}
    counts = restarter.intake.counts()
    assert (counts.accepted, counts.duplicates) == (1, 2)


def test_what_the_sink_gets_comes_from_an_agent(restarter: Restarter) -> None:
    claimed = Fault(**{**fault(1).__dict__, "source": "restarter"})
    report(restarter.address, [claimed], "agent-a")
    assert restarter.received == [fault(1)]  # source "agent", every other field as sent


def test_review_failures_are_unavailable_not_refusals(restarter: Restarter) -> None:
    restarter.reviewer.down = True
    with pytest.raises(grpc.RpcError) as failed:
        report(restarter.address, [fault(1)], "agent-a")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    counts = restarter.intake.counts()
    assert (counts.review_errors, counts.refused) == (1, {})


def test_a_failing_sink_makes_the_agent_retry(restarter: Restarter) -> None:
    restarter.fail_sink = True
    with pytest.raises(grpc.RpcError) as failed:
        report(restarter.address, [fault(1)], "agent-a")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # the agent keeps it and retries
    restarter.fail_sink = False
    assert [v for _, v, _ in verdicts(report(restarter.address, [fault(1)], "agent-a"))] == [
        "VERDICT_ACCEPTED"
    ]
    assert restarter.intake.counts().sink_errors == 1


def test_refusals_are_logged_at_most_once_per_reason_per_interval() -> None:
    now = [0.0]
    intake = FaultIntake(
        review=StandInReviewer(), agent_user=AGENT, on_fault=lambda f: None, clock=lambda: now[0]
    )
    server = IntakeServer(intake, listen="127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        with capture_logs() as logs:
            for _ in range(3):
                report(address, [fault(1, node="node-b")], "agent-a")
            now[0] = 10.0
            report(address, [fault(1, node="node-b")], "agent-a")
    finally:
        server.stop(0)
    refused = [e for e in logs if e["event"] == "fault refused"]
    assert [(e["reason"], e["left_out"]) for e in refused] == [("wrong_node", 0), ("wrong_node", 2)]
    assert intake.counts().refused == {"wrong_node": 4}


def test_the_intake_gives_freed_heap_back_while_it_serves() -> None:
    """What grpc core freed after a connection storm (runtime/heap.py); the trim's thread
    ends with the server."""
    restarter = Restarter(heap_trim_seconds=0.01)
    if not restarter.server.trimmer.available:
        pytest.skip("a C library without malloc_trim")
    restarter.server.start()
    try:
        wait_until(lambda: restarter.server.trimmer.trims >= 2, what="heap trims")
    finally:
        restarter.server.stop(0)
    assert not [t for t in threading.enumerate() if t.name == "heap-trim"]


def test_a_busy_port_is_an_intake_error(restarter: Restarter) -> None:
    other = IntakeServer(restarter.intake, listen=restarter.address)
    with pytest.raises(IntakeError, match="cannot serve"):
        other.start()


# --- the sender ----------------------------------------------------------------------------


def sender_for(
    tmp_path: Path,
    address: str,
    token: str = "agent-a",  # noqa: S107 - a stand-in token name
    **settings: object,
) -> tuple[Outbox, Sender]:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    outbox = Outbox(tmp_path / "outbox")
    defaults: dict[str, object] = {"backoff_initial": 0.02, "backoff_max": 0.1}
    sender = Sender(outbox, SenderSettings(address, token_file, **{**defaults, **settings}))  # type: ignore[arg-type]
    return outbox, sender


def test_the_sender_delivers_and_forgets(restarter: Restarter, tmp_path: Path) -> None:
    outbox, sender = sender_for(tmp_path, restarter.address, batch_size=2)
    sending = running(sender)
    try:
        for n in range(5):
            outbox.enqueue(fault(n))
        outbox.enqueue(fault(9, node="node-b"))  # refused: dropped, never retried
        wait_until(lambda: len(outbox) == 0, what="the outbox to empty")
    finally:
        stop_parts(sending)
        outbox.close()
    assert restarter.ids() == {fid(n): 1 for n in range(5)}
    counts = sender.counts()
    assert (counts.accepted, counts.refused, counts.call_failures) == (5, 1, 0)


def test_a_fault_the_restarter_cannot_record_stays_in_the_outbox(
    restarter: Restarter, tmp_path: Path
) -> None:
    """The sink raises (the record cannot be written): the call ends UNAVAILABLE, the agent
    keeps the whole batch and sends it again until it is recorded."""
    restarter.fail_sink = True
    outbox, sender = sender_for(tmp_path, restarter.address)
    sending = running(sender)
    try:
        outbox.enqueue(fault(1))
        outbox.enqueue(fault(2))
        wait_until(lambda: sender.counts().call_failures >= 2, what="failed calls")
        assert [f.id for f in outbox.pending()] == [fid(1), fid(2)]
        restarter.fail_sink = False
        wait_until(lambda: len(outbox) == 0, what="the outbox to empty")
    finally:
        stop_parts(sending)
        outbox.close()
    assert restarter.ids() == {fid(1): 1, fid(2): 1}


def test_a_fault_the_cache_does_not_show_yet_is_sent_again_not_dropped(
    restarter: Restarter, tmp_path: Path
) -> None:
    """A "retry later" answer (the pod cache trails the agent) keeps the fault in the outbox
    without holding up the others or counting as a failed call."""
    restarter.not_cached.add("worker-7")
    outbox, sender = sender_for(tmp_path, restarter.address, retry_later=0.05)
    sending = running(sender)
    try:
        outbox.enqueue(fault(7))
        outbox.enqueue(fault(1))
        wait_until(lambda: restarter.ids() == {fid(1): 1}, what="the other fault delivered")
        wait_until(lambda: sender.counts().deferred >= 3, what="asked again")
        assert [f.id for f in outbox.pending()] == [fid(7)]
        restarter.not_cached.clear()  # the cache caught up
        wait_until(lambda: len(outbox) == 0, what="the outbox to empty")
    finally:
        stop_parts(sending)
        outbox.close()
    assert restarter.ids() == {fid(1): 1, fid(7): 1}
    assert (sender.counts().call_failures, sender.counts().refused) == (0, 0)


def test_the_sender_waits_out_an_outage(tmp_path: Path) -> None:
    port = free_port()
    outbox, sender = sender_for(tmp_path, f"127.0.0.1:{port}")
    sending = running(sender)
    later = Restarter(port)
    try:
        outbox.enqueue(fault(1))
        wait_until(lambda: sender.counts().call_failures >= 3, what="a few failed calls")
        later.server.start()
        outbox.enqueue(fault(2))
        wait_until(lambda: len(outbox) == 0, what="the outbox to empty")
    finally:
        stop_parts(sending)
        outbox.close()
        later.server.stop(0)
    assert later.ids() == {fid(1): 1, fid(2): 1}


def test_a_fault_queued_in_an_outage_goes_within_the_backoff_cap_once_the_intake_is_back(
    tmp_path: Path,
) -> None:
    """However long the outage, the fault waiting in the outbox reaches the intake at most
    `backoff_max` (the sender's next call) plus the channel's reconnect backoff (at most
    RECONNECT_MAX_MS, where gRPC's own would grow to 120 s) after it is back, and a second's
    slack for a loaded machine; not before (nothing listened)."""
    port = free_port()
    cap = 1.0
    outbox, sender = sender_for(tmp_path, f"127.0.0.1:{port}", backoff_initial=0.1, backoff_max=cap)
    later = Restarter(port)
    sending = running(sender)
    try:
        outbox.enqueue(fault(1))
        # Eight failures in a row: the backoff has been at its cap for four (0.1, 0.2, 0.4, 0.8,
        # 1.0, ...); doubling on, the next wait would be 6.4 to 12.8 s.
        wait_until(lambda: sender.counts().call_failures >= 8, 30, what="an outage")
        back = time.monotonic()
        later.server.start()
        wait_until(lambda: len(outbox) == 0, 30, what="the fault delivered")
    finally:
        stop_parts(sending)
        outbox.close()
        later.server.stop(0)
    assert later.ids() == {fid(1): 1}
    [delivered] = later.received_at
    assert 0 < delivered - back <= cap + RECONNECT_MAX_MS / 1000 + 1.0


def test_a_token_is_read_for_every_call(restarter: Restarter, tmp_path: Path) -> None:
    outbox, sender = sender_for(tmp_path, restarter.address, token="")
    sending = running(sender)
    try:
        outbox.enqueue(fault(1))
        wait_until(lambda: sender.counts().call_failures >= 1, what="a failed call")
        assert restarter.reviewer.calls == {}  # nothing sent without a token
        (tmp_path / "token").write_text("intruder-a")
        wait_until(lambda: restarter.intake.counts().refused != {}, what="a refused call")
        assert len(outbox) == 1  # a refused caller keeps its faults: the refusal is not theirs
        (tmp_path / "token").write_text("agent-a")
        wait_until(lambda: len(outbox) == 0, what="the outbox to empty")
    finally:
        stop_parts(sending)
        outbox.close()
    assert restarter.ids() == {fid(1): 1}


def test_stop_leaves_the_outbox_on_disk(tmp_path: Path) -> None:
    outbox, sender = sender_for(tmp_path, f"127.0.0.1:{free_port()}")
    sending = running(sender)
    outbox.enqueue(fault(1))
    wait_until(lambda: sender.counts().call_failures >= 1, what="a failed call")
    stop_parts(sending)
    outbox.close()
    again = Outbox(tmp_path / "outbox")
    try:
        assert [f.id for f in again.pending()] == [fid(1)]
    finally:
        again.close()


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for edl-restarter.test and its key, in `directory`."""
    openssl = shutil.which("openssl")
    assert openssl, "the openssl CLI makes the test certificate"
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", "key.pem", "-out", "cert.pem", "-days", "1",
         "-subj", "/CN=edl-restarter", "-addext", "subjectAltName=DNS:edl-restarter.test"],
        cwd=directory, check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return directory / "cert.pem", directory / "key.pem"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


def test_tls(certificate: tuple[Path, Path], tmp_path: Path) -> None:
    cert, key = certificate
    restarter = Restarter(tls_cert=cert, tls_key=key)
    restarter.server.start()
    outbox, sender = sender_for(
        tmp_path, restarter.address, ca_file=cert, server_name="edl-restarter.test"
    )
    sending = running(sender)
    try:
        outbox.enqueue(fault(1))
        wait_until(lambda: len(outbox) == 0, what="the outbox to empty")
        with pytest.raises(grpc.RpcError) as plaintext:
            report(restarter.address, [fault(2)], "agent-a")
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_parts(sending)
        outbox.close()
        restarter.server.stop(0)
    assert restarter.ids() == {fid(1): 1}


def tls_report(address: str, ca: Path, fault_: Fault) -> fault_pb2.ReportResponse:
    """One Report over a new TLS connection that trusts only `ca`."""
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    options = [("grpc.ssl_target_name_override", "edl-restarter.test")]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        stub = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
        request = fault_pb2.ReportRequest(faults=[to_proto(fault_)])
        metadata = [("authorization", "Bearer agent-a")]
        return stub.Report(request, metadata=metadata, timeout=5)  # type: ignore[no-any-return]


def test_a_renewed_certificate_serves_new_connections_without_a_restart(tmp_path: Path) -> None:
    """The files are swapped as a Secret volume swaps them (a rename): the next connection gets
    the new certificate; a pair that does not belong together is refused and the previous
    certificate goes on serving."""
    old_cert, old_key = make_certificate(tmp_path / "old")
    new_cert, new_key = make_certificate(tmp_path / "new")
    served = tmp_path / "served"
    served.mkdir()
    cert, key = served / "tls.crt", served / "tls.key"

    def install(certificate: Path, private_key: Path) -> None:
        for source, target in ((certificate, cert), (private_key, key)):
            staged = target.with_suffix(".staged")
            staged.write_bytes(source.read_bytes())
            staged.rename(target)

    install(old_cert, old_key)
    restarter = Restarter(tls_cert=cert, tls_key=key)
    restarter.server.start()
    try:
        tls_report(restarter.address, old_cert, fault(1))

        install(new_cert, old_key)  # halfway: the new certificate with the old key
        tls_report(restarter.address, old_cert, fault(2))
        assert restarter.server.certificate is not None
        assert restarter.server.certificate.reloads == 0

        install(new_cert, new_key)
        tls_report(restarter.address, new_cert, fault(3))
        assert restarter.server.certificate.reloads == 1
        with pytest.raises(grpc.RpcError) as old_trust:
            tls_report(restarter.address, old_cert, fault(4))
        assert old_trust.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        restarter.server.stop(0)
    assert restarter.ids() == {fid(1): 1, fid(2): 1, fid(3): 1}


def test_tls_needs_both_halves(certificate: tuple[Path, Path]) -> None:
    intake = FaultIntake(review=StandInReviewer(), agent_user=AGENT, on_fault=lambda f: None)
    with pytest.raises(IntakeError, match="both"):
        IntakeServer(intake, listen="127.0.0.1:0", tls_cert=certificate[0])


def test_connections_that_never_handshake_are_closed_and_the_surplus_refused(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    restarter = Restarter(
        tls_cert=cert, tls_key=key, max_connections=20, handshake_timeout=0.5, idle_timeout=60
    )
    restarter.server.start()
    port = restarter.server.port
    silent: list[socket.socket] = []
    try:
        for _ in range(30):  # TCP connections that never start TLS
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        # Each is closed by the server: past the cap at once, the rest at the handshake timeout.
        for connection in silent:
            assert connection.recv(1) == b""
        # And the intake serves again: a real agent's report goes through.
        response = tls_report(restarter.address, cert, fault(1))
        assert verdicts(response) == [(fid(1), "VERDICT_ACCEPTED", "")]
    finally:
        for connection in silent:
            connection.close()
        restarter.server.stop(0)
