"""The intake's limit on calls per connection, which grpc enforces (intake_server.py), on real
sockets: one connection gets no more than `max_calls_per_connection` calls at a time while
another connection still gets in."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc
from edl_agent.faults.convert import to_proto
from edl_agent.faults.model import Fault
from tests.test_fault_delivery import Restarter, fault, fid, verdicts
from tests.waiting import wait_until


class HeldRestarter(Restarter):
    """An intake whose sink holds every fault until `release` is set: its calls stay open."""

    def __init__(self, **server: object) -> None:
        self.release = threading.Event()
        self.entered: list[str] = []
        self._entered_lock = threading.Lock()
        super().__init__(**server)

    def _sink(self, f: Fault) -> None:
        with self._entered_lock:
            self.entered.append(f.id)
        self.release.wait(30)
        super()._sink(f)

    def held(self) -> list[str]:
        with self._entered_lock:
            return list(self.entered)


@contextmanager
def serving(**server: object) -> Iterator[HeldRestarter]:
    running = HeldRestarter(**server)
    running.server.start()
    try:
        yield running
    finally:
        running.release.set()
        running.server.stop(0)


@contextmanager
def channel(address: str) -> Iterator[Any]:
    # A connection of its own: grpc shares one between channels to the same address otherwise.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        yield fault_pb2_grpc.FaultIntakeStub(ch)  # type: ignore[no-untyped-call]


def send(stub: Any, n: int) -> Any:
    request = fault_pb2.ReportRequest(faults=[to_proto(fault(n))])
    return stub.Report.future(request, metadata=[("authorization", "Bearer agent-a")], timeout=20)


def test_one_connection_gets_its_share_of_calls_and_another_still_gets_in() -> None:
    with (
        serving(workers=4, max_calls_per_connection=1) as running,
        channel(running.address) as one,
        channel(running.address) as other,
    ):
        first = send(one, 1)
        wait_until(lambda: running.held() == [fid(1)], what="the first call held")
        waiting = send(one, 2)  # the connection's one stream is taken: it waits its turn
        third = send(other, 3)
        wait_until(lambda: fid(3) in running.held(), what="the other connection's call")
        assert fid(2) not in running.held()
        running.release.set()
        for call in (first, waiting, third):
            assert verdicts(call.result(timeout=10))[0][1] == "VERDICT_ACCEPTED"
    assert running.ids() == {fid(1): 1, fid(2): 1, fid(3): 1}
