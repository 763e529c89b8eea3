"""Fault model ↔ `edl.fault.v1` messages. Pure.

`from_proto` is the boundary check for faults that come over the wire or out of the outbox: it
raises `InvalidFault` for a message that does not describe a fault (no id, an unknown kind, no
node, no time), so callers can refuse or set it aside instead of acting on it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.model import Fault, FaultKind, PodRef

MAX_ID_LENGTH = 256

KIND_TO_PROTO: dict[FaultKind, fault_pb2.FaultKind] = {
    FaultKind.CONTAINER_EXIT: fault_pb2.FAULT_KIND_CONTAINER_EXIT,
    FaultKind.DEVICE_UNHEALTHY: fault_pb2.FAULT_KIND_DEVICE_UNHEALTHY,
    FaultKind.NODE_NOT_READY: fault_pb2.FAULT_KIND_NODE_NOT_READY,
    FaultKind.POD_FORCE_DELETED: fault_pb2.FAULT_KIND_POD_FORCE_DELETED,
    FaultKind.POD_EVICTED: fault_pb2.FAULT_KIND_POD_EVICTED,
    FaultKind.DEVICE_DEGRADED: fault_pb2.FAULT_KIND_DEVICE_DEGRADED,
}
KIND_FROM_PROTO: dict[int, FaultKind] = {number: kind for kind, number in KIND_TO_PROTO.items()}


class InvalidFault(ValueError):
    """A message that does not describe a fault; the text says which field is wrong."""


def to_proto(fault: Fault) -> fault_pb2.Fault:
    """The wire form of `fault`. A naive `observed_at` is taken as UTC, as the model says."""
    message = fault_pb2.Fault(
        id=fault.id,
        kind=KIND_TO_PROTO[fault.kind],
        node=fault.node,
        pods=[fault_pb2.PodRef(namespace=p.namespace, name=p.name, uid=p.uid) for p in fault.pods],
        reason=fault.reason,
        device_ids=fault.device_ids,
        detail=fault.detail,
        source=fault.source,
    )
    observed = fault.observed_at
    message.observed_at.FromDatetime(
        observed if observed.tzinfo is not None else observed.replace(tzinfo=UTC)
    )
    if fault.container is not None:
        message.container = fault.container
    if fault.exit_code is not None:
        message.exit_code = fault.exit_code
    return message


def from_proto(message: fault_pb2.Fault) -> Fault:
    """The model form of a received fault; `InvalidFault` when it is not a usable fault."""
    if not message.id:
        msg = "fault without an id"
        raise InvalidFault(msg)
    if len(message.id) > MAX_ID_LENGTH:
        msg = f"fault id longer than {MAX_ID_LENGTH} characters"
        raise InvalidFault(msg)
    kind = KIND_FROM_PROTO.get(message.kind)
    if kind is None:
        msg = f"fault {message.id}: unknown kind {message.kind}"
        raise InvalidFault(msg)
    if not message.node:
        msg = f"fault {message.id}: no node"
        raise InvalidFault(msg)
    if not message.HasField("observed_at"):
        msg = f"fault {message.id}: no observed_at"
        raise InvalidFault(msg)
    return Fault(
        id=message.id,
        kind=kind,
        node=message.node,
        observed_at=_observed_at(message),
        pods=tuple(PodRef(p.namespace, p.name, p.uid) for p in message.pods),
        container=message.container if message.HasField("container") else None,
        exit_code=message.exit_code if message.HasField("exit_code") else None,
        reason=message.reason,
        device_ids=tuple(message.device_ids),
        detail=message.detail,
        source=message.source,
    )


def _observed_at(message: fault_pb2.Fault) -> datetime:
    """An aware UTC datetime (microsecond precision); `InvalidFault` when out of range."""
    stamp = message.observed_at
    try:
        observed: datetime = stamp.ToDatetime(tzinfo=UTC)
    except (OverflowError, OSError, ValueError) as exc:
        msg = f"fault {message.id}: observed_at out of range ({stamp.seconds}s {stamp.nanos}ns)"
        raise InvalidFault(msg) from exc
    return observed
