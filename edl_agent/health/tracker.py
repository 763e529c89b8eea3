"""Which devices are unhealthy and why, from the stream of health events, with hysteresis.

Pure state: events and `now` in, conditions and transitions out; no clocks, threads or I/O.

- ignore/warn events are only counted.
- device-fatal events make a device unhealthy until `quiet_seconds` pass with no new fatal
  event of that reason (a poller that keeps seeing a fault keeps re-reporting it, so the device
  stays unhealthy while the fault lasts and for the quiet period after).
- node-fatal events (GPU off the bus, device node gone) hold until `sound()` is told that
  re-discovery found the device sound again.
- vendor-wide events (`device_id` None: the vendor's monitor itself failed) make every device of
  that vendor unhealthy until a `cleared` event for the same reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from edl_agent.devices.model import Device, Vendor
from edl_agent.health.model import HealthEvent, Level

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class Condition:
    reason: str
    level: Level
    since: float
    last_seen: float
    detail: str = ""


@dataclass(frozen=True)
class Transition:
    device_id: str
    to: str  # Healthy / Unhealthy
    reason: str
    detail: str = ""


@dataclass
class HealthCounters:
    """Counters for metrics; keys as the metric labels need them."""

    xid_errors: Counter[tuple[str, int]] = field(default_factory=Counter)
    events: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # device, reason, level
    transitions: Counter[tuple[str, str, str]] = field(
        default_factory=Counter
    )  # device, to, reason


class HealthTracker:
    def __init__(self, *, quiet_seconds: float) -> None:
        self.quiet_seconds = quiet_seconds
        self._device: dict[str, dict[str, Condition]] = {}
        self._vendor: dict[Vendor, dict[str, Condition]] = {}
        self.counts = HealthCounters()

    def observe(self, event: HealthEvent, devices: Iterable[Device]) -> list[Transition]:
        """Apply one event; returns the devices whose health changed because of it."""
        before = self.unhealthy(devices)
        target = event.device_id or ""
        self.counts.events[(target, event.reason, event.level.value)] += 1
        if event.code is not None and event.reason.startswith("XID"):
            self.counts.xid_errors[(target, event.code)] += 1
        table = self._table(event)
        if event.cleared:
            if event.device_id is None:
                table.pop(event.reason, None)
        elif event.level.unhealthy:
            current = table.get(event.reason)
            table[event.reason] = Condition(
                reason=event.reason,
                level=event.level,
                since=current.since if current is not None else event.at,
                last_seen=event.at,
                detail=event.detail,
            )
        return self._diff(before, self.unhealthy(devices))

    def expire(self, now: float, devices: Iterable[Device]) -> list[Transition]:
        """Let device-fatal conditions that have been quiet long enough recover."""
        before = self.unhealthy(devices)
        for conditions in self._device.values():
            for reason, condition in list(conditions.items()):
                quiet = now - condition.last_seen >= self.quiet_seconds
                if condition.level is Level.DEVICE_FATAL and quiet:
                    del conditions[reason]
        return self._diff(before, self.unhealthy(devices))

    def sound(
        self,
        device_ids: Collection[str],
        devices: Iterable[Device],
        *,
        reasons: Collection[str] | None = None,
        seen_before: float | None = None,
    ) -> list[Transition]:
        """These devices were found sound: their node-fatal conditions end — only those of
        `reasons` when given, and only those last seen before `seen_before` when given (a
        condition a poller reported a moment ago is still there, whatever discovery says)."""
        before = self.unhealthy(devices)
        for device_id in device_ids:
            conditions = self._device.get(device_id, {})
            for reason, condition in list(conditions.items()):
                if condition.level is not Level.NODE_FATAL:
                    continue
                if reasons is not None and reason not in reasons:
                    continue
                if seen_before is not None and condition.last_seen >= seen_before:
                    continue
                del conditions[reason]
        return self._diff(before, self.unhealthy(devices))

    def unhealthy(self, devices: Iterable[Device]) -> dict[str, Condition]:
        """Every unhealthy device (of `devices`, plus those only known by id) and its worst,
        most recent condition."""
        result: dict[str, Condition] = {}
        for device_id, conditions in self._device.items():
            if conditions:
                result[device_id] = _worst(conditions.values())
        for device in devices:
            vendor_conditions = self._vendor.get(device.vendor)
            if vendor_conditions:
                own = result.get(device.id)
                candidates = [*vendor_conditions.values(), *([own] if own else [])]
                result[device.id] = _worst(candidates)
        return result

    def vendor_conditions(self) -> Mapping[Vendor, Condition]:
        return {v: _worst(c.values()) for v, c in self._vendor.items() if c}

    def _table(self, event: HealthEvent) -> dict[str, Condition]:
        if event.device_id is None:
            return self._vendor.setdefault(event.vendor, {})
        return self._device.setdefault(event.device_id, {})

    def _diff(
        self, before: Mapping[str, Condition], after: Mapping[str, Condition]
    ) -> list[Transition]:
        changes = [
            Transition(device_id, UNHEALTHY, after[device_id].reason, after[device_id].detail)
            for device_id in sorted(after.keys() - before.keys())
        ]
        changes += [
            Transition(device_id, HEALTHY, before[device_id].reason)
            for device_id in sorted(before.keys() - after.keys())
        ]
        for change in changes:
            self.counts.transitions[(change.device_id, change.to, change.reason)] += 1
        return changes


def _worst(conditions: Iterable[Condition]) -> Condition:
    order = {Level.NODE_FATAL: 2, Level.DEVICE_FATAL: 1}
    return max(conditions, key=lambda c: (order.get(c.level, 0), c.last_seen))
