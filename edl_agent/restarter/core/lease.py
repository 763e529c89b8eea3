"""Leader election on a coordination.k8s.io/v1 Lease: what a candidate writes next.

The rules (those of client-go's leader election, which other controllers on the same Lease
follow too):

- a Lease nobody holds (no holder, or the holder released it) is taken at once;
- another holder's Lease is taken only once its record has stayed unchanged for its
  leaseDurationSeconds, as measured by *our* clock since we first saw that record, so clocks
  that disagree between nodes never cut a live leader's term short;
- the holder renews by writing renewTime; the write carries the resourceVersion it read, so of
  two candidates writing at once one fails with a conflict.

Pure: the elector (`leader`) does the reading, writing and timing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from edl_agent.kube_time import format_micro_time, parse_time


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    duration_seconds: int
    acquired: datetime | None = None
    renewed: datetime | None = None
    transitions: int = 0

    @property
    def held(self) -> bool:
        return bool(self.holder)


def read_lease(obj: Mapping[str, Any] | None) -> LeaseRecord | None:
    """The record in a Lease as the API returned it (None: no Lease)."""
    if obj is None:
        return None
    spec = obj.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
        acquired=parse_time(spec.get("acquireTime")),
        renewed=parse_time(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def lease_spec(record: LeaseRecord) -> dict[str, Any]:
    """The Lease spec that stores `record`."""
    spec: dict[str, Any] = {
        "holderIdentity": record.holder or None,
        "leaseDurationSeconds": record.duration_seconds,
        "leaseTransitions": record.transitions,
    }
    if record.acquired is not None:
        spec["acquireTime"] = format_micro_time(record.acquired)
    if record.renewed is not None:
        spec["renewTime"] = format_micro_time(record.renewed)
    return spec


def next_record(
    current: LeaseRecord | None,
    *,
    me: str,
    now: datetime,
    duration_seconds: int,
    unchanged_for: float,
) -> LeaseRecord | None:
    """What `me` writes next, or None while another holder's term runs.

    `unchanged_for`: seconds (our monotonic clock) since we first saw `current` as it is."""
    others = current is not None and current.held and current.holder != me
    if others and current is not None and unchanged_for < current.duration_seconds:
        return None
    if current is not None and current.holder == me:
        return dataclasses.replace(current, renewed=now, duration_seconds=duration_seconds)
    transitions = 0 if current is None else current.transitions + 1
    return LeaseRecord(
        holder=me,
        duration_seconds=duration_seconds,
        acquired=now,
        renewed=now,
        transitions=transitions,
    )


def released(record: LeaseRecord) -> LeaseRecord:
    """`record` given up by its holder, so that a standby takes it without waiting."""
    return dataclasses.replace(record, holder="", duration_seconds=1)
