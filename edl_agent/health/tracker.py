"""Which devices are unhealthy, why, and what it takes to bring each back. Pure state: events,
evidence and `now` in; conditions and transitions out; no clocks, threads or I/O.

Every severe event opens (or refreshes) a condition on its device, which carries what clears it
(`ClearsBy`, from the vendor's catalog through `what_clears`). A condition ends only on evidence
that clears its kind (`health.model.ends`):

- `condition`: its source says it is over (a poll reads OK, the /dev node is back);
- `quiet`: `quiet_seconds` without a repeat (only where an operator chose it per code);
- `reset`: a reset of that device was observed, or the agent reset it and validated it;
- `reboot`: the node's boot id changed;
- `release`: an operator released the device.

A Degraded condition (`Level.DEGRADED`: a fault is coming, the device still serves its pod) is
kept and cleared the same way; a device is Unhealthy while any condition is severe, Degraded while
only Degraded ones are open, and transitions name the state it moved to.

Time alone ends nothing severe. Ignore/warn events are only counted. Vendor-wide events
(`device_id` None) are about the vendor's monitor: a severe one (NVML cannot start) makes every
device of the vendor unhealthy until its `cleared` event; a warning (a vendor tool failing) marks
the monitor failed without taking devices away (`monitor_failures`).

A repeat of an open condition is the hot path under a flood (100,000 identical XIDs): it costs a
dictionary update and produces no transition.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from edl_agent.devices.model import Device, Vendor
from edl_agent.health.model import ClearsBy, Evidence, HealthEvent, Level, ends

HEALTHY = "Healthy"
DEGRADED = "Degraded"
UNHEALTHY = "Unhealthy"

# Stricter first: when one reason is reported with two clearing kinds, the stricter holds.
_STRICTNESS = (
    ClearsBy.NOTHING,
    ClearsBy.CONDITION,
    ClearsBy.QUIET,
    ClearsBy.RESET,
    ClearsBy.REBOOT,
    ClearsBy.RELEASE,
)


@dataclass(frozen=True)
class Condition:
    reason: str
    level: Level
    since: float
    last_seen: float
    detail: str = ""
    clears_by: ClearsBy = ClearsBy.CONDITION
    count: int = 1


@dataclass(frozen=True)
class Transition:
    device_id: str
    to: str  # Healthy / Degraded / Unhealthy
    reason: str
    detail: str = ""
    evidence: Evidence | None = None  # what ended it (to Healthy)


@dataclass
class HealthCounters:
    """Counters for metrics; keys as the metric labels need them."""

    xid_errors: Counter[tuple[str, int]] = field(default_factory=Counter)
    events: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # device, reason, level
    transitions: Counter[tuple[str, str, str]] = field(
        default_factory=Counter
    )  # device, to, reason


def _default_clears_by(event: HealthEvent) -> ClearsBy:
    if event.clears_by is not None:
        return event.clears_by
    return ClearsBy.CONDITION if event.level.kept else ClearsBy.NOTHING


class HealthTracker:
    def __init__(
        self,
        *,
        quiet_seconds: float,
        clears_by: Callable[[HealthEvent], ClearsBy] = _default_clears_by,
    ) -> None:
        self.quiet_seconds = quiet_seconds
        self._clears_by = clears_by
        self._device: dict[str, dict[str, Condition]] = {}
        self._vendor_of: dict[str, Vendor] = {}
        self._vendor: dict[Vendor, dict[str, Condition]] = {}
        self._monitor: dict[Vendor, dict[str, Condition]] = {}
        self.counts = HealthCounters()

    # --- events ----------------------------------------------------------------------------------

    def observe(self, event: HealthEvent, devices: Iterable[Device]) -> list[Transition]:
        """Apply one event; returns the devices whose health changed because of it."""
        target = event.device_id or ""
        self.counts.events[(target, event.reason, event.level.value)] += 1
        if event.code is not None and event.reason.startswith("XID"):
            self.counts.xid_errors[(target, event.code)] += 1
        if event.device_id is None:
            return self._observe_vendor(event, devices)
        return self._observe_device(event, event.device_id)

    def _observe_device(self, event: HealthEvent, device_id: str) -> list[Transition]:
        self._vendor_of[device_id] = event.vendor
        if event.cleared:
            return self.clear([device_id], Evidence.GONE, reasons={event.reason})
        if not event.level.kept:
            return []
        clears_by = self._clears_by(event)
        if clears_by is ClearsBy.NOTHING:
            return []
        conditions = self._device.setdefault(device_id, {})
        current = conditions.get(event.reason)
        # A repeat at no higher level: no transition, whatever the flood.
        repeat = current is not None and event.level.rank <= current.level.rank
        was = None if repeat else self.state_of(device_id)
        if current is not None:  # a repeat, or the same reason now more severe
            conditions[event.reason] = replace(
                current,
                level=max(current.level, event.level, key=lambda level: level.rank),
                last_seen=event.at,
                detail=event.detail or current.detail,
                clears_by=max(current.clears_by, clears_by, key=_STRICTNESS.index),
                count=current.count + 1,
            )
        else:
            conditions[event.reason] = Condition(
                reason=event.reason,
                level=event.level,
                since=event.at,
                last_seen=event.at,
                detail=event.detail,
                clears_by=clears_by,
            )
        if was is None:
            return []
        now = self.state_of(device_id)
        if now == was:
            return []
        return self._counted([Transition(device_id, now, event.reason, event.detail)])

    def _observe_vendor(self, event: HealthEvent, devices: Iterable[Device]) -> list[Transition]:
        listed = list(devices)
        before = self.unhealthy(listed)
        severe = self._vendor.setdefault(event.vendor, {})
        monitor = self._monitor.setdefault(event.vendor, {})
        if event.cleared:
            severe.pop(event.reason, None)
            monitor.pop(event.reason, None)
        else:
            table = severe if event.level.unhealthy else monitor
            if event.level is not Level.IGNORE:
                current = table.get(event.reason)
                table[event.reason] = Condition(
                    reason=event.reason,
                    level=event.level,
                    since=current.since if current is not None else event.at,
                    last_seen=event.at,
                    detail=event.detail,
                    count=current.count + 1 if current is not None else 1,
                )
        return self._diff(before, self.unhealthy(listed))

    def monitor_ok(self, vendor: Vendor) -> None:
        """The vendor's monitor worked again: its non-severe failures are over."""
        self._monitor.pop(vendor, None)

    # --- evidence --------------------------------------------------------------------------------

    def clear(
        self,
        device_ids: Iterable[str],
        evidence: Evidence,
        *,
        reasons: Collection[str] | None = None,
        seen_before: float | None = None,
    ) -> list[Transition]:
        """End the conditions of these devices that `evidence` clears — only those of `reasons`
        when given, and only those last seen before `seen_before` when given (a condition a
        poller reported a moment ago is still there, whatever else says)."""
        changes: list[Transition] = []
        for device_id in dict.fromkeys(device_ids):
            conditions = self._device.get(device_id)
            if not conditions:
                continue
            was = self.state_of(device_id)
            worst = _worst(self._of_state(conditions.values(), was))
            for reason, condition in list(conditions.items()):
                if reasons is not None and reason not in reasons:
                    continue
                if seen_before is not None and condition.last_seen >= seen_before:
                    continue
                if ends(condition.clears_by, evidence):
                    del conditions[reason]
            now = self.state_of(device_id)
            if now == was:
                continue
            if now == DEGRADED:
                left = _worst(self._of_state(conditions.values(), DEGRADED))
                changes.append(Transition(device_id, now, left.reason, left.detail, evidence))
            else:
                changes.append(Transition(device_id, now, worst.reason, evidence=evidence))
        return self._counted(changes)

    def expire(self, now: float) -> list[Transition]:
        """End the `quiet` conditions that have not repeated for `quiet_seconds`."""
        quiet = [
            device_id
            for device_id, conditions in self._device.items()
            if any(
                c.clears_by is ClearsBy.QUIET and now - c.last_seen >= self.quiet_seconds
                for c in conditions.values()
            )
        ]
        # Quiet for exactly `quiet_seconds` counts: "before" the next representable instant.
        since = math.nextafter(now - self.quiet_seconds, math.inf)
        return self.clear(quiet, Evidence.QUIET, seen_before=since)

    def next_quiet_end(self) -> float | None:
        """When the earliest `quiet` condition ends if it does not repeat (None: there is none):
        `expire` is due then."""
        ends = [
            c.last_seen + self.quiet_seconds
            for conditions in self._device.values()
            for c in conditions.values()
            if c.clears_by is ClearsBy.QUIET
        ]
        return min(ends, default=None)

    def reboot(self) -> list[Transition]:
        """The node rebooted: everything but what needs a person ends."""
        return self.clear(list(self._device), Evidence.REBOOT)

    def escalate(self, device_id: str, *, to: ClearsBy = ClearsBy.RELEASE) -> bool:
        """Make the reset-class conditions of a device wait for `to` instead (a reset that was
        tried and did not help); True when any changed."""
        conditions = self._device.get(device_id, {})
        changed = False
        for reason, condition in list(conditions.items()):
            if condition.clears_by is ClearsBy.RESET:
                conditions[reason] = replace(condition, clears_by=to)
                changed = True
        return changed

    # --- persistence -----------------------------------------------------------------------------

    def quarantined(self) -> dict[str, list[Condition]]:
        """The conditions that outlive an agent restart (reset, reboot, release), by device."""
        kept = {
            device_id: [c for c in conditions.values() if c.clears_by.persistent]
            for device_id, conditions in self._device.items()
        }
        return {device_id: found for device_id, found in kept.items() if found}

    def restore(self, device_id: str, conditions: Iterable[Condition]) -> None:
        """Reopen conditions saved by an earlier run (before the first ListAndWatch)."""
        table = self._device.setdefault(device_id, {})
        for condition in conditions:
            table.setdefault(condition.reason, condition)

    # --- views -----------------------------------------------------------------------------------

    def conditions(self, device_id: str) -> list[Condition]:
        return list(self._device.get(device_id, {}).values())

    def open_conditions(self) -> dict[str, list[Condition]]:
        """Every device's open conditions (Degraded or worse), by device."""
        return {d: list(c.values()) for d, c in self._device.items() if c}

    def state_of(self, device_id: str) -> str:
        """Healthy, Degraded or Unhealthy."""
        if self._unhealthy_device(device_id):
            return UNHEALTHY
        conditions = self._device.get(device_id, {}).values()
        return DEGRADED if any(c.level is Level.DEGRADED for c in conditions) else HEALTHY

    def unhealthy(self, devices: Iterable[Device]) -> dict[str, Condition]:
        """Every unhealthy device (of `devices`, plus those only known by id) and its worst,
        most recent condition."""
        result: dict[str, Condition] = {}
        for device_id, conditions in self._device.items():
            severe = [c for c in conditions.values() if c.level.unhealthy]
            if severe:
                result[device_id] = _worst(severe)
        for device in devices:
            vendor_conditions = self._vendor.get(device.vendor)
            if vendor_conditions:
                own = result.get(device.id)
                candidates = [*vendor_conditions.values(), *([own] if own else [])]
                result[device.id] = _worst(candidates)
        return result

    def degraded(
        self, devices: Iterable[Device], unhealthy: Collection[str] | None = None
    ) -> dict[str, Condition]:
        """Every degraded device (one with a Degraded condition and none worse, of `devices`
        plus those only known by id) and its worst, most recent Degraded condition.
        `unhealthy`: the devices `unhealthy(devices)` gives, when the caller has them."""
        if unhealthy is None:
            unhealthy = self.unhealthy(devices)
        result: dict[str, Condition] = {}
        for device_id, conditions in self._device.items():
            if device_id in unhealthy:
                continue
            found = [c for c in conditions.values() if c.level is Level.DEGRADED]
            if found:
                result[device_id] = _worst(found)
        return result

    def vendor_conditions(self) -> Mapping[Vendor, Condition]:
        """Vendors whose monitor failed so that their devices are unhealthy."""
        return {v: _worst(c.values()) for v, c in self._vendor.items() if c}

    def monitor_failures(self) -> Mapping[Vendor, Condition]:
        """Vendors whose monitor failed (severe or not): readiness and the node condition."""
        failed = {v: _worst(c.values()) for v, c in self._monitor.items() if c}
        return {**failed, **self.vendor_conditions()}

    # --- internals -------------------------------------------------------------------------------

    def _unhealthy_device(self, device_id: str) -> bool:
        if any(c.level.unhealthy for c in self._device.get(device_id, {}).values()):
            return True
        vendor = self._vendor_of.get(device_id)
        return vendor is not None and bool(self._vendor.get(vendor))

    def _diff(
        self, before: Mapping[str, Condition], after: Mapping[str, Condition]
    ) -> list[Transition]:
        gone = Evidence.GONE
        changes = [
            Transition(device_id, UNHEALTHY, after[device_id].reason, after[device_id].detail)
            for device_id in sorted(after.keys() - before.keys())
        ]
        changes += [
            Transition(device_id, self.state_of(device_id), before[device_id].reason, "", gone)
            for device_id in sorted(before.keys() - after.keys())
        ]
        return self._counted(changes)

    @staticmethod
    def _of_state(conditions: Iterable[Condition], state: str) -> list[Condition]:
        """The conditions that make a device `state` (all of them for Healthy: none)."""
        listed = list(conditions)
        if state == UNHEALTHY:
            return [c for c in listed if c.level.unhealthy] or listed
        if state == DEGRADED:
            return [c for c in listed if c.level is Level.DEGRADED] or listed
        return listed

    def _counted(self, changes: list[Transition]) -> list[Transition]:
        for change in changes:
            self.counts.transitions[(change.device_id, change.to, change.reason)] += 1
        return changes


def _worst(conditions: Iterable[Condition]) -> Condition:
    return max(
        conditions, key=lambda c: (_STRICTNESS.index(c.clears_by), c.level.rank, c.last_seen)
    )
