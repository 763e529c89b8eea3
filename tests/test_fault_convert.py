"""Fault model ↔ edl.fault.v1 messages: round trips, and what from_proto refuses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.convert import KIND_TO_PROTO, InvalidFault, from_proto, to_proto
from edl_agent.faults.model import Fault, FaultKind, PodRef

T0 = datetime(2026, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)


def exit_fault(**changes: object) -> Fault:
    fields: dict[str, object] = {
        "id": "exit-1",
        "kind": FaultKind.CONTAINER_EXIT,
        "node": "gpu-node-1",
        "observed_at": T0,
        "pods": (PodRef("ml", "job-worker-0", "uid-1"),),
        "container": "worker",
        "exit_code": 137,
        "reason": "OOMKilled",
    }
    fields.update(changes)
    return Fault(**fields)  # type: ignore[arg-type]


def test_every_kind_has_a_wire_value() -> None:
    assert set(KIND_TO_PROTO) == set(FaultKind)
    assert len(set(KIND_TO_PROTO.values())) == len(FaultKind)
    assert fault_pb2.FAULT_KIND_UNSPECIFIED not in KIND_TO_PROTO.values()


@pytest.mark.parametrize(
    "fault",
    [
        exit_fault(),
        exit_fault(exit_code=0, container=""),  # zero and empty are kept, not taken for unset
        exit_fault(container=None, exit_code=None),
        Fault(
            id="dev-1",
            kind=FaultKind.DEVICE_UNHEALTHY,
            node="n",
            observed_at=T0,
            pods=(PodRef("a", "p0", "u0"), PodRef("b", "p1")),
            reason="XID79",
            device_ids=("GPU-1", "GPU-2"),
            detail="fell off the bus",
            source="agent",
        ),
    ],
)
def test_round_trip(fault: Fault) -> None:
    wire = to_proto(fault).SerializeToString()
    assert from_proto(fault_pb2.Fault.FromString(wire)) == fault


def test_optional_fields_keep_presence() -> None:
    assert to_proto(exit_fault(exit_code=0)).HasField("exit_code")
    assert not to_proto(exit_fault(exit_code=None)).HasField("exit_code")
    assert not to_proto(exit_fault(container=None)).HasField("container")


def test_times_come_back_in_utc() -> None:
    naive = exit_fault(observed_at=datetime(2026, 5, 1, 12, 0))  # naive: UTC
    assert from_proto(to_proto(naive)).observed_at == datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    plus_two = timezone(timedelta(hours=2))
    local = exit_fault(observed_at=datetime(2026, 5, 1, 14, 0, tzinfo=plus_two))
    back = from_proto(to_proto(local)).observed_at
    assert back == datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert back.utcoffset() == timedelta(0)


def valid_message() -> fault_pb2.Fault:
    return to_proto(exit_fault())


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("id", "", "without an id"),
        ("id", "x" * 257, "longer than"),
        ("kind", fault_pb2.FAULT_KIND_UNSPECIFIED, "unknown kind"),
        ("kind", 99, "unknown kind"),
        ("node", "", "no node"),
    ],
)
def test_invalid_messages_are_refused(field: str, value: object, says: str) -> None:
    message = valid_message()
    setattr(message, field, value)
    with pytest.raises(InvalidFault, match=says):
        from_proto(message)


def test_a_fault_needs_a_time() -> None:
    message = valid_message()
    message.ClearField("observed_at")
    with pytest.raises(InvalidFault, match="no observed_at"):
        from_proto(message)


def test_a_time_out_of_range_is_refused_not_raised_as_something_else() -> None:
    message = valid_message()
    message.observed_at.seconds = 2**62
    with pytest.raises(InvalidFault, match="out of range"):
        from_proto(message)


FAULTS = st.builds(
    Fault,
    id=st.text(min_size=1, max_size=256),
    kind=st.sampled_from(FaultKind),
    node=st.text(min_size=1, max_size=63),
    observed_at=st.datetimes(
        min_value=datetime(1970, 1, 1),
        max_value=datetime(9999, 12, 31),
        timezones=st.just(UTC),
    ),
    pods=st.lists(st.builds(PodRef, st.text(), st.text(), st.text()), max_size=3).map(tuple),
    container=st.none() | st.text(max_size=63),
    exit_code=st.none() | st.integers(min_value=-(2**31), max_value=2**31 - 1),
    reason=st.text(max_size=20),
    device_ids=st.lists(st.text(max_size=40), max_size=4).map(tuple),
    detail=st.text(max_size=100),
    source=st.sampled_from(["agent", "restarter"]),
)


@given(FAULTS)
def test_round_trip_property(fault: Fault) -> None:
    assert from_proto(fault_pb2.Fault.FromString(to_proto(fault).SerializeToString())) == fault
