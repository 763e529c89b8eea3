"""The restarter's fault intake against the real API server's TokenReview, fed by the agent's
outbox sender holding tokens as kubelet gives them: bound to the agent's pod on its node."""

from __future__ import annotations

import functools
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from pathlib import Path
from typing import Any

import grpc
import pytest
from k8s_test_helpers import KwokCluster, bound_tokens, forge_token
from kubernetes.client.exceptions import ApiException

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.faults.convert import to_proto
from edl_agent.faults.ids import observer_scoped_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.outbox import Outbox
from edl_agent.faults.pod_faults import container_exit_faults
from edl_agent.faults.sender import Sender, SenderSettings
from edl_agent.restarter.adapters.auth import CachedReviewer, TokenReviewer
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.intake_server import IntakeServer
from edl_agent.restarter.core.callers import service_account_user
from tests import waiting
from tests.parts import running
from tests.parts import stop as stop_parts

wait_until = functools.partial(waiting.wait_until, timeout=20.0)

AGENT_SA = "edl-agent"
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def pod_bound_token(
    k8s: KwokCluster, node: str, service_account: str = AGENT_SA, audiences: list[str] | None = None
) -> str:
    """A token as kubelet gives the agent's pod: bound to a pod on `node`, so it names the node."""
    k8s.create_service_account(service_account)
    return bound_tokens(k8s.core, k8s.namespace, node, service_account, [audiences or []])[0]


def fault(n: int, node: str) -> Fault:
    """A device fault naming no pod: what it is judged on is who sends it about which node."""
    return Fault(
        id=f"fault-{n}",
        kind=FaultKind.DEVICE_UNHEALTHY,
        node=node,
        observed_at=T0 + timedelta(seconds=n),
        reason="XID79",
        device_ids=("GPU-1",),
    )


def kept(node: str, *numbers: int) -> Counter[str]:
    """The ids the restarter keeps `fault(n, node)` under: scoped by the reporting node."""
    return Counter(observer_scoped_id(node, f"fault-{n}") for n in numbers)


@dataclass
class Restarter:
    intake: FaultIntake
    server: IntakeServer
    received: list[Fault]
    lock: threading.Lock

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def ids(self) -> Counter[str]:
        with self.lock:
            return Counter(f.id for f in self.received)


def restarter_for(k8s: KwokCluster, port: int = 0, audiences: tuple[str, ...] = ()) -> Restarter:
    """The intake as the restarter runs it, reviewing tokens with the admin credential."""
    received: list[Fault] = []
    lock = threading.Lock()

    def sink(f: Fault) -> None:
        with lock:
            received.append(f)

    def find_pod(ref: PodRef) -> dict[str, Any] | None:
        """A pod cache that never lags: the API server itself."""
        try:
            pod = k8s.core.read_namespaced_pod(ref.name, ref.namespace)
        except ApiException as exc:
            if exc.status == HTTPStatus.NOT_FOUND:
                return None
            raise
        return k8s.api.sanitize_for_serialization(pod)  # type: ignore[no-untyped-call,no-any-return]

    intake = FaultIntake(
        review=CachedReviewer(TokenReviewer(k8s.api, audiences=audiences)),
        agent_user=service_account_user(k8s.namespace, AGENT_SA),
        on_fault=sink,
        find_pod=find_pod,
    )
    return Restarter(intake, IntakeServer(intake, listen=f"127.0.0.1:{port}"), received, lock)


@pytest.fixture
def nodes(k8s: KwokCluster) -> tuple[str, str]:
    a = k8s.create_gpu_node(wait_ready=False).metadata.name
    b = k8s.create_gpu_node(wait_ready=False).metadata.name
    return a, b


@pytest.fixture
def restarter(k8s: KwokCluster) -> Iterator[Restarter]:
    running = restarter_for(k8s)
    running.server.start()
    yield running
    running.server.stop(0)


def agent(tmp_path: Path, address: str, token: str) -> tuple[Outbox, Sender]:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    outbox = Outbox(tmp_path / "state" / "outbox")
    settings = SenderSettings(address, token_file, backoff_initial=0.05, backoff_max=0.2)
    return outbox, Sender(outbox, settings)


def report(address: str, faults: list[Fault], token: str | None) -> fault_pb2.ReportResponse:
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(address) as channel:
        stub = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
        request = fault_pb2.ReportRequest(faults=[to_proto(f) for f in faults])
        return stub.Report(request, metadata=metadata, timeout=10)  # type: ignore[no-any-return]


def test_faults_about_the_agents_node_are_accepted_once(
    k8s: KwokCluster, nodes: tuple[str, str], restarter: Restarter, tmp_path: Path
) -> None:
    node_a, _ = nodes
    token = pod_bound_token(k8s, node_a)
    outbox, sender = agent(tmp_path, restarter.address, token)
    sending = running(sender)
    try:
        for n in range(3):
            outbox.enqueue(fault(n, node_a))
        wait_until(what="the outbox to empty", done=lambda: len(outbox) == 0)
        outbox.enqueue(fault(1, node_a))  # the same fault again, as after an agent restart
        wait_until(what="the outbox to empty", done=lambda: len(outbox) == 0)
    finally:
        stop_parts(sending)
        outbox.close()
    assert restarter.ids() == kept(node_a, 0, 1, 2)
    assert {f.node for f in restarter.received} == {node_a}
    counts = sender.counts()
    assert (counts.accepted, counts.duplicates, counts.refused) == (3, 1, 0)
    assert restarter.intake.counts().refused == {}


def test_refusals(k8s: KwokCluster, nodes: tuple[str, str], restarter: Restarter) -> None:
    node_a, node_b = nodes
    agent_on_b = pod_bound_token(k8s, node_b)
    intruder_on_a = pod_bound_token(k8s, node_a, service_account="intruder")
    unbound = k8s.mint_token(AGENT_SA)  # the agent's account, but bound to no pod or node
    about_a = [fault(1, node_a)]

    for token, code in [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (forge_token(agent_on_b, sub=f"system:serviceaccount:{k8s.namespace}:{AGENT_SA}"),
         grpc.StatusCode.UNAUTHENTICATED),
        ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
        (intruder_on_a, grpc.StatusCode.PERMISSION_DENIED),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            report(restarter.address, about_a, token)
        assert refused.value.code() == code

    for token in (agent_on_b, unbound):
        response = report(restarter.address, about_a, token)
        assert [(a.fault_id, a.verdict, a.reason) for a in response.acks] == [
            ("fault-1", fault_pb2.VERDICT_REFUSED, "wrong_node")
        ]
    assert restarter.intake.counts().refused == {
        "no_token": 1,
        "invalid_token": 2,
        "wrong_service_account": 1,
        "wrong_node": 2,
    }
    assert restarter.received == []
    # The same agent may report about its own node, in the same batch as a refused fault.
    mixed = report(restarter.address, [fault(2, node_b), fault(3, node_a)], agent_on_b)
    assert [a.verdict for a in mixed.acks] == [
        fault_pb2.VERDICT_ACCEPTED,
        fault_pb2.VERDICT_REFUSED,
    ]
    assert restarter.ids() == kept(node_b, 2)


def test_the_sender_drops_a_refused_fault(
    k8s: KwokCluster, nodes: tuple[str, str], restarter: Restarter, tmp_path: Path
) -> None:
    node_a, node_b = nodes
    token = pod_bound_token(k8s, node_b)
    outbox, sender = agent(tmp_path, restarter.address, token)
    sending = running(sender)
    try:
        outbox.enqueue(fault(1, node_a))
        wait_until(what="the outbox to empty", done=lambda: len(outbox) == 0)
    finally:
        stop_parts(sending)
        outbox.close()
    assert sender.counts().refused == 1
    assert restarter.received == []


def test_audiences(k8s: KwokCluster, nodes: tuple[str, str], tmp_path: Path) -> None:
    restarter = restarter_for(k8s, audiences=("edl-restarter",))
    restarter.server.start()
    try:
        meant_for_us = pod_bound_token(k8s, nodes[0], audiences=["edl-restarter"])
        for_the_api_server = pod_bound_token(k8s, nodes[0])
        with pytest.raises(grpc.RpcError) as refused:
            report(restarter.address, [fault(1, nodes[0])], for_the_api_server)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        response = report(restarter.address, [fault(1, nodes[0])], meant_for_us)
        assert [a.verdict for a in response.acks] == [fault_pb2.VERDICT_ACCEPTED]
    finally:
        restarter.server.stop(0)


def test_the_outbox_outlives_a_restarter_outage_and_an_agent_restart(
    k8s: KwokCluster, nodes: tuple[str, str], tmp_path: Path
) -> None:
    node_a, _ = nodes
    token = pod_bound_token(k8s, node_a)
    with socket.socket() as probe:  # a port where nothing listens yet
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    address = f"127.0.0.1:{port}"

    outbox, sender = agent(tmp_path, address, token)
    sending = running(sender)
    for n in range(5):
        outbox.enqueue(fault(n, node_a))
    wait_until(what="failed calls", done=lambda: sender.counts().call_failures >= 3)
    stop_parts(sending)  # the agent restarts while the restarter is still down
    outbox.close()

    outbox, sender = agent(tmp_path, address, token)
    assert [f.id for f in outbox.pending()] == [f"fault-{n}" for n in range(5)]
    sending = running(sender)
    outbox.enqueue(fault(5, node_a))
    outbox.enqueue(fault(2, node_a))  # observed again after the restart: still pending, one entry
    wait_until(what="the new agent to fail too", done=lambda: sender.counts().call_failures >= 1)
    restarter = restarter_for(k8s, port)
    restarter.server.start()
    try:
        wait_until(what="the outbox to empty", done=lambda: len(outbox) == 0)
    finally:
        stop_parts(sending)
        outbox.close()
        restarter.server.stop(0)
    assert restarter.ids() == kept(node_a, *range(6))
    assert restarter.intake.counts().duplicates == 0


def test_an_agent_is_believed_about_exits_of_its_own_node_s_pods_only(
    k8s: KwokCluster, nodes: tuple[str, str], restarter: Restarter
) -> None:
    """A real exit of a pod on node B: node A's agent is refused, B's is believed, under the
    exit's canonical id (the one the restarter's own watcher derives), once."""
    node_a, node_b = nodes
    pod = k8s.create_pod(node=node_b)
    k8s.exit_pod(pod.metadata.name, 137)
    status = k8s.api.sanitize_for_serialization(k8s.read_pod(pod.metadata.name))  # type: ignore[no-untyped-call]
    [exited] = container_exit_faults(status, now=T0, source="agent")
    as_a = Fault(**{**exited.__dict__, "node": node_a})
    refused = report(restarter.address, [as_a], pod_bound_token(k8s, node_a))
    assert [(a.verdict, a.reason) for a in refused.acks] == [
        (fault_pb2.VERDICT_REFUSED, "pod_elsewhere")
    ]
    token_b = pod_bound_token(k8s, node_b)
    invented = Fault(**{**exited.__dict__, "id": exited.id[:-1] + "5"})  # restart 5: not shown
    believed = report(restarter.address, [exited, invented], token_b)
    assert [(a.fault_id, a.verdict) for a in believed.acks] == [
        (exited.id, fault_pb2.VERDICT_ACCEPTED),
        (invented.id, fault_pb2.VERDICT_UNSPECIFIED),  # "retry later", then refused
    ]
    assert restarter.ids() == {exited.id: 1}
