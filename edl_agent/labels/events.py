"""Events on the Node for device faults and recoveries. Pure: what to say, and whether to send it.

- `AcceleratorUnhealthy` (Warning) when a device turns unhealthy or its fault changes; the message
  names the device (vendor, index, id), the fault and its detail.
- `AcceleratorDegraded` (Warning) when a device turns degraded (a fault is coming: it serves its
  pods and takes no new ones) or its warning changes, unless it is unhealthy.
- `AcceleratorRecovered` (Normal) when it is healthy again; the message names the fault it had.
- Deduplicated: the same type, reason and message again within the window bumps the `count` of
  the event already sent instead of creating another (as kubelet's recorder does).
- Rate-limited per node by a token bucket (default: bursts of 10, 10 a minute); what does not fit
  is dropped and counted — the node condition, not the event stream, is the record of health.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from edl_agent.labels.condition import DeviceFault
from edl_agent.rate_limit import TokenBucket

WARNING = "Warning"
NORMAL = "Normal"
UNHEALTHY_REASON = "AcceleratorUnhealthy"
RECOVERED_REASON = "AcceleratorRecovered"
DEGRADED_REASON = "AcceleratorDegraded"
MAX_REMEMBERED = 256


@dataclass(frozen=True)
class EventSpec:
    type: str  # Warning / Normal
    reason: str
    message: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.type, self.reason, self.message)


def health_events(
    before: Sequence[DeviceFault],
    after: Sequence[DeviceFault],
    degraded_before: Sequence[DeviceFault] = (),
    degraded_after: Sequence[DeviceFault] = (),
) -> list[EventSpec]:
    """Events for the change from `before` to `after` (unhealthy devices of the last and this
    sync) and from `degraded_before` to `degraded_after` (degraded ones)."""
    old = {f.device_id: f for f in before}
    new = {f.device_id: f for f in after}
    old_worn = {f.device_id: f for f in degraded_before}
    new_worn = {f.device_id: f for f in degraded_after}
    events = [
        EventSpec(WARNING, UNHEALTHY_REASON, f"{fault.name} unhealthy: {fault.summary}")
        for fault in after
        if fault.device_id not in old or old[fault.device_id].reason != fault.reason
    ]
    events += [
        EventSpec(WARNING, DEGRADED_REASON, f"{fault.name} degraded: {fault.summary}")
        for fault in degraded_after
        if fault.device_id not in new
        and (fault.device_id not in old_worn or old_worn[fault.device_id].reason != fault.reason)
    ]
    events += [
        EventSpec(NORMAL, RECOVERED_REASON, f"{fault.name} healthy again (was {fault.reason})")
        for fault in [*before, *degraded_before]
        if fault.device_id not in new and fault.device_id not in new_worn
    ]
    return events


class Action(enum.StrEnum):
    CREATE = "create"
    BUMP = "bump"  # patch the count of the event sent before
    DROP = "drop"


@dataclass(frozen=True)
class Decision:
    action: Action
    name: str | None = None  # the event to bump
    count: int = 1


@dataclass
class _Sent:
    name: str
    count: int
    last: float


class EventGate:
    """Decides, per event, whether to create it, bump an earlier one, or drop it."""

    def __init__(self, *, window_seconds: float, capacity: int, per_minute: float) -> None:
        self.window_seconds = window_seconds
        self.bucket = TokenBucket(capacity=capacity, per_second=per_minute / 60.0)
        self.dropped = 0
        self._sent: dict[tuple[str, str, str], _Sent] = {}

    def decide(self, spec: EventSpec, now: float) -> Decision:
        self._forget(now)
        if not self.bucket.take(now):
            self.dropped += 1
            return Decision(Action.DROP)
        earlier = self._sent.get(spec.key)
        if earlier is None:
            return Decision(Action.CREATE)
        return Decision(Action.BUMP, earlier.name, earlier.count + 1)

    def sent(self, spec: EventSpec, *, name: str, count: int, now: float) -> None:
        """Record what the API accepted (the next duplicate bumps `name`)."""
        self._sent.pop(spec.key, None)  # re-insert: the dict stays ordered oldest first
        self._sent[spec.key] = _Sent(name, count, now)
        while len(self._sent) > MAX_REMEMBERED:
            del self._sent[next(iter(self._sent))]

    def forget(self, spec: EventSpec) -> None:
        """The event to bump is gone (deleted, expired): the next one is created afresh."""
        self._sent.pop(spec.key, None)

    def _forget(self, now: float) -> None:
        stale = [k for k, s in self._sent.items() if now - s.last > self.window_seconds]
        for key in stale:
            del self._sent[key]
