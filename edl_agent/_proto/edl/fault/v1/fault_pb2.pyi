import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_KIND_UNSPECIFIED: _ClassVar[FaultKind]
    FAULT_KIND_CONTAINER_EXIT: _ClassVar[FaultKind]
    FAULT_KIND_DEVICE_UNHEALTHY: _ClassVar[FaultKind]
    FAULT_KIND_NODE_NOT_READY: _ClassVar[FaultKind]
    FAULT_KIND_POD_FORCE_DELETED: _ClassVar[FaultKind]
    FAULT_KIND_POD_EVICTED: _ClassVar[FaultKind]
    FAULT_KIND_DEVICE_DEGRADED: _ClassVar[FaultKind]

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_ACCEPTED: _ClassVar[Verdict]
    VERDICT_DUPLICATE: _ClassVar[Verdict]
    VERDICT_REFUSED: _ClassVar[Verdict]
FAULT_KIND_UNSPECIFIED: FaultKind
FAULT_KIND_CONTAINER_EXIT: FaultKind
FAULT_KIND_DEVICE_UNHEALTHY: FaultKind
FAULT_KIND_NODE_NOT_READY: FaultKind
FAULT_KIND_POD_FORCE_DELETED: FaultKind
FAULT_KIND_POD_EVICTED: FaultKind
FAULT_KIND_DEVICE_DEGRADED: FaultKind
VERDICT_UNSPECIFIED: Verdict
VERDICT_ACCEPTED: Verdict
VERDICT_DUPLICATE: Verdict
VERDICT_REFUSED: Verdict

class PodRef(_message.Message):
    __slots__ = ("namespace", "name", "uid")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    uid: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("id", "kind", "node", "observed_at", "pods", "container", "exit_code", "reason", "device_ids", "detail", "source")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: FaultKind
    node: str
    observed_at: _timestamp_pb2.Timestamp
    pods: _containers.RepeatedCompositeFieldContainer[PodRef]
    container: str
    exit_code: int
    reason: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    detail: str
    source: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[FaultKind, str]] = ..., node: _Optional[str] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., pods: _Optional[_Iterable[_Union[PodRef, _Mapping]]] = ..., container: _Optional[str] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., detail: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("faults", "sent_at")
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    faults: _containers.RepeatedCompositeFieldContainer[Fault]
    sent_at: _timestamp_pb2.Timestamp
    def __init__(self, faults: _Optional[_Iterable[_Union[Fault, _Mapping]]] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("fault_id", "verdict", "reason")
    FAULT_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    fault_id: str
    verdict: Verdict
    reason: str
    def __init__(self, fault_id: _Optional[str] = ..., verdict: _Optional[_Union[Verdict, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    def __init__(self, acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ...) -> None: ...
