"""The health hub: the one place where the node's device health is decided and kept.

Everything that observes devices (the NVML watcher, the vendor polls, device-node presence and
re-discovery, an operator's release, reset evidence, remediation) sends the hub a `HealthEvent`
or calls one of its small methods. Under its lock the hub updates the `HealthTracker`, the
cordoned devices, the reset baselines and the boot id, pushes the unhealthy set into
`DeviceState` (ListAndWatch, DRA and the node publisher wake on it) and offers the quarantine to
its writer (`QuarantineWriter`: the write with fsync happens on the writer's thread, never under
this lock, never on the observer's). Then, outside the lock, it hands each `HealthChange` to the
subscriptions that want it (device faults, reset evidence, the quiet-period part): a queue each,
so a subscriber that is slow (kubelet's pod-resources API that does not answer) delays nobody,
least of all the NVML event thread that reported the XID.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import structlog

from edl_agent.config import HealthSettings
from edl_agent.devices.model import Vendor
from edl_agent.health.classify import what_clears
from edl_agent.health.model import Evidence, HealthEvent, Level, ends
from edl_agent.health.nvml_reset import Baseline
from edl_agent.health.nvml_watch import GPU_LOST
from edl_agent.health.quarantine_store import Quarantine
from edl_agent.health.quarantine_writer import QuarantineWriter
from edl_agent.health.reset_rules import check_resets, waiting_for_reset
from edl_agent.health.state import DeviceState
from edl_agent.health.tracker import (
    DEGRADED,
    HEALTHY,
    UNHEALTHY,
    Condition,
    HealthTracker,
    Transition,
)
from edl_agent.log_limit import LogLimiter

EVENT_LOG_SECONDS = 10.0
T = TypeVar("T")


@dataclass(frozen=True)
class HealthChange:
    """What one call to the hub changed: its transitions, and the devices among them that
    turned Unhealthy with the condition that made them so."""

    transitions: tuple[Transition, ...]
    turned: tuple[tuple[str, Condition], ...] = ()
    # The devices among them that turned Degraded (from Healthy), with the condition that did.
    degraded: tuple[tuple[str, Condition], ...] = ()
    # The earliest quiet period now ends sooner than before (or one opened): a repeat that only
    # pushes it later wakes nobody, so a flood does not spin the quiet-period part.
    quiet_sooner: bool = False
    # What the node's labels and condition show changed: the unhealthy and degraded devices,
    # their reasons, the failing monitors, the cordoned devices.
    shown: bool = False


class Subscription:
    """A subscriber's queue: the hub `put`s (never blocks), the subscriber `take`s all that
    waits after `wake` (its own event, which the agent's stop sets too) was set."""

    def __init__(
        self, wake: threading.Event, wants: Callable[[HealthChange], bool], *, keep: bool = True
    ) -> None:
        self.wake = wake
        self._wants = wants
        self._keep = keep  # False: only `wake` is set (the subscriber reads the hub's views)
        self._lock = threading.Lock()
        self._queue: deque[HealthChange] = deque()

    def put(self, change: HealthChange) -> None:
        if not self._wants(change):
            return
        if self._keep:
            with self._lock:
                self._queue.append(change)
        self.wake.set()

    def take(self) -> list[HealthChange]:
        with self._lock:
            taken = list(self._queue)
            self._queue.clear()
        return taken


class HealthHub:
    def __init__(
        self,
        state: DeviceState,
        settings: HealthSettings,
        *,
        boot_id: str | None,
        writer: QuarantineWriter | None = None,
    ) -> None:
        self.state = state
        self.tracker = HealthTracker(
            quiet_seconds=settings.quiet_seconds,
            clears_by=lambda event: what_clears(
                event,
                xid_overrides=settings.xid_clears_by,
                ascend_overrides=settings.ascend_code_clears_by,
            ),
        )
        self.boot_id = boot_id
        self.writer = writer
        self._lock = threading.Lock()
        self._cordoned: frozenset[str] = frozenset()
        self._baselines: dict[str, Baseline] = {}
        self._quarantine_keys: frozenset[tuple[str, str, str]] = frozenset()
        self._subscriptions: list[Subscription] = []
        self._quiet_end: float | None = None
        self._shown: tuple[frozenset[tuple[str, str]], ...] = ()
        self._event_log = LogLimiter(interval=EVENT_LOG_SECONDS)
        self._log = structlog.get_logger().bind(part="health")

    def subscribe(
        self,
        wake: threading.Event,
        wants: Callable[[HealthChange], bool] = lambda change: bool(change.transitions),
        *,
        keep: bool = True,
    ) -> Subscription:
        """A queue of the changes `wants` picks; `wake` is set when one is put (and nothing is
        kept with `keep=False`, for a subscriber that only needs to look again)."""
        subscription = Subscription(wake, wants, keep=keep)
        with self._lock:
            self._subscriptions.append(subscription)
        return subscription

    # --- what observers send

    def report(self, event: HealthEvent) -> None:
        """One health event, from any observer's thread: returns without any I/O but a log."""
        if event.device_id is None and event.reason == GPU_LOST:
            # A GPU lost before we could read its uuid is not in the inventory at all (discovery
            # reports it as an error); it must not take the vendor's other GPUs down with it.
            event = dataclasses.replace(event, level=Level.WARN)
        with self._lock:
            devices = self.state.snapshot().inventory.devices
            changes = self.tracker.observe(event, devices)
            change = self._apply(changes)
        self._publish(change)
        _log_event(self._log, self._event_log, event, changed=bool(changes))

    def clear(
        self,
        device_ids: Iterable[str],
        evidence: Evidence,
        *,
        reasons: Collection[str] | None = None,
    ) -> list[Transition]:
        """End what `evidence` ends for these devices (only `reasons` when given)."""
        with self._lock:
            changes = self.tracker.clear(device_ids, evidence, reasons=reasons)
            change = self._apply(changes)
        self._publish(change)
        return changes

    def release(self, device_ids: Collection[str]) -> list[Transition]:
        """An operator released these devices: every quarantine of theirs ends."""
        with self._lock:
            changes = self.tracker.clear(device_ids, Evidence.RELEASE)
            for device_id in device_ids:
                self._baselines.pop(device_id, None)
            change = self._apply(changes, force=True)
        self._publish(change)
        return changes

    def set_cordon(self, device_ids: frozenset[str]) -> bool:
        """Devices cordoned by the node annotation read Unhealthy; True when that changed."""
        with self._lock:
            if device_ids == self._cordoned:
                return False
            self._cordoned = device_ids
            change = self._apply([], refresh=True)
        self._publish(change)
        return True

    def expire(self, now: float) -> list[Transition]:
        """End the quiet periods that are over at `now`."""
        with self._lock:
            changes = self.tracker.expire(now)
            change = self._apply(changes)
        self._publish(change)
        return changes

    def polled_ok(
        self,
        vendor: Vendor,
        checked: Iterable[str],
        reported: Mapping[str, Collection[str]],
        prefixes: tuple[str, ...],
    ) -> None:
        """A vendor's poll worked: its monitor is fine, and the polled conditions (`prefixes`)
        of the devices it `checked` that it no longer `reported` are over (a reset)."""
        with self._lock:
            self.tracker.monitor_ok(vendor)
            changes: list[Transition] = []
            for device_id in checked:
                over = {
                    c.reason
                    for c in self.tracker.conditions(device_id)
                    if c.reason.startswith(prefixes) and c.reason not in reported.get(device_id, ())
                }
                if over:
                    changes += self.tracker.clear([device_id], Evidence.RESET, reasons=over)
            change = self._apply(changes)
        self._publish(change)

    # --- reset evidence and remediation

    def waiting_for_reset(self) -> dict[str, str]:
        """Quarantined NVIDIA devices a reset clears -> the uuid of the GPU to read."""
        with self._lock:
            quarantined = self.tracker.quarantined()
        return waiting_for_reset(quarantined, self.state.snapshot().inventory.devices)

    def reset_readings(
        self, waiting: Mapping[str, str], readings: Mapping[str, Baseline]
    ) -> list[Transition]:
        """New NVML reset readings: first ones become baselines, those that differ end what a
        reset ends."""
        with self._lock:
            check = check_resets(waiting, self._baselines, readings)
            self._baselines = dict(check.baselines)
            changes = self.tracker.clear(check.reset, Evidence.RESET) if check.reset else []
            change = self._apply(changes, force=bool(check.reset) or bool(readings))
        self._publish(change)
        return changes

    def rebooted(self, boot_id: str) -> bool:
        """The node's boot id now; True (and what a reboot ends, ended) when it is a new one."""
        with self._lock:
            if self.boot_id is None or boot_id == self.boot_id:
                self.boot_id = self.boot_id or boot_id
                return False
            self._log.warning("node rebooted (new boot id)", was=self.boot_id, now=boot_id)
            self.boot_id = boot_id
            self._baselines.clear()
            change = self._apply(self.tracker.reboot(), force=True)
        self._publish(change)
        return True

    def quarantined(self) -> dict[str, list[Condition]]:
        with self._lock:
            return self.tracker.quarantined()

    def reset_done(self, family: Collection[str]) -> list[Transition]:
        """A reset of these devices was validated: what a reset ends is over."""
        with self._lock:
            for device_id in family:
                self._baselines.pop(device_id, None)
            change = self._apply(self.tracker.clear(family, Evidence.RESET), force=True)
        self._publish(change)
        return list(change.transitions)

    def escalate(self, family: Collection[str]) -> None:
        """Resets did not help: these devices wait for an operator's release."""
        with self._lock:
            for device_id in family:
                self.tracker.escalate(device_id)
            change = self._apply([], force=True)
        self._publish(change)

    def restore(self, saved: Quarantine) -> tuple[int, bool]:
        """Reopen what an earlier run quarantined (before kubelet is first served): a reboot
        since then ends what a reboot ends. Returns (devices restored, rebooted since)."""
        kept, baselines, rebooted = _restorable(saved, self.boot_id)
        with self._lock:
            for device_id, conditions in kept.items():
                self.tracker.restore(device_id, conditions)
            self._baselines = dict(baselines)
            self._apply([], force=True)
        restored = len(kept)
        self._log.info(
            "quarantine restored",
            devices=restored,
            rebooted_since=rebooted or None,
            released_by_reboot=(len(saved.conditions) - restored) or None,
        )
        return restored, rebooted

    # --- views

    def unhealthy(self) -> dict[str, Condition]:
        with self._lock:
            return self.tracker.unhealthy(self.state.snapshot().inventory.devices)

    def degraded(self) -> dict[str, Condition]:
        with self._lock:
            return self.tracker.degraded(self.state.snapshot().inventory.devices)

    def withdrawing(self) -> dict[str, Condition]:
        """The worst condition of every unhealthy or degraded device: why each is kept from new
        work."""
        with self._lock:
            devices = self.state.snapshot().inventory.devices
            unhealthy = self.tracker.unhealthy(devices)
            return {**self.tracker.degraded(devices, unhealthy), **unhealthy}

    def monitor_failures(self) -> dict[Vendor, Condition]:
        with self._lock:
            return dict(self.tracker.monitor_failures())

    def next_quiet_end(self) -> float | None:
        with self._lock:
            return self.tracker.next_quiet_end()

    def read(self, view: Callable[[HealthTracker], T]) -> T:
        """`view` of the tracker, read under the hub's lock (it must not keep the tracker)."""
        with self._lock:
            return view(self.tracker)

    # --- internals (the lock held)

    def _apply(
        self, changes: list[Transition], *, force: bool = False, refresh: bool = False
    ) -> HealthChange:
        """Push the tracker's view into the device state and the quarantine to the writer;
        returns the change to publish."""
        self._offer_quarantine(force=force)
        devices = self.state.snapshot().inventory.devices
        unhealthy = self.tracker.unhealthy(devices)
        degraded = self.tracker.degraded(devices, unhealthy.keys())
        self.state.set_unhealthy(unhealthy.keys() | self._cordoned, degraded.keys())
        shown = (
            frozenset((d, c.reason) for d, c in unhealthy.items()),
            frozenset((d, c.reason) for d, c in degraded.items()),
            frozenset((v.value, c.reason) for v, c in self.tracker.monitor_failures().items()),
        )
        news, self._shown = shown != self._shown, shown
        turned = tuple(
            (c.device_id, unhealthy[c.device_id])
            for c in changes
            if c.to == UNHEALTHY and c.device_id in unhealthy
        )
        turned_degraded = tuple(
            (c.device_id, degraded[c.device_id])
            for c in changes
            if c.to == DEGRADED and c.evidence is None and c.device_id in degraded
        )
        quiet_end, was = self.tracker.next_quiet_end(), self._quiet_end
        self._quiet_end = quiet_end
        sooner = quiet_end is not None and (was is None or quiet_end < was)
        return HealthChange(
            tuple(changes),
            turned,
            turned_degraded,
            quiet_sooner=sooner,
            shown=news or refresh,
        )

    def _offer_quarantine(self, *, force: bool) -> None:
        """Hand the quarantine to the writer when what is quarantined changed. Repeats of an
        open condition do not: a flood costs no disk writes."""
        if self.writer is None:
            return
        quarantined = self.tracker.quarantined()
        keys = frozenset(
            (device_id, c.reason, c.clears_by.value)
            for device_id, conditions in quarantined.items()
            for c in conditions
        )
        if keys == self._quarantine_keys and not force:
            return
        self._quarantine_keys = keys
        self.writer.offer(
            Quarantine(
                boot_id=self.boot_id,
                conditions={k: tuple(v) for k, v in quarantined.items()},
                baselines={k: dict(v) for k, v in self._baselines.items() if k in quarantined},
            )
        )

    # --- outside the lock

    def _publish(self, change: HealthChange) -> None:
        for transition in change.transitions:
            level = 20 if transition.to == HEALTHY else 30
            detail = transition.detail or None
            self._log.log(level, "device health changed", **_fields(transition), detail=detail)
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.put(change)


def _fields(transition: Transition) -> dict[str, str]:
    return {"device": transition.device_id, "to": transition.to, "reason": transition.reason}


def _log_event(
    log: structlog.stdlib.BoundLogger, limiter: LogLimiter, event: HealthEvent, *, changed: bool
) -> None:
    """A flood of one fault logs its first line, then one line per interval with the number held
    back (the counters count every event)."""
    if event.level is Level.IGNORE and not changed:
        return
    held_back = limiter.allow((event.device_id, event.reason, event.cleared))
    if held_back is None and not changed:
        return
    log.log(
        30 if event.level.kept and not event.cleared else 20,
        "health event",
        vendor=event.vendor.value,
        device=event.device_id,
        reason=event.reason,
        severity=event.level.value,
        cleared=event.cleared or None,
        detail=event.detail or None,
        repeats_not_logged=held_back or None,
    )


def _restorable(
    saved: Quarantine, boot_id: str | None
) -> tuple[dict[str, list[Condition]], dict[str, Baseline], bool]:
    """What of an earlier run's quarantine holds now: a reboot since then (a new boot id) ends
    what a reboot ends, and its baselines with it. Returns (conditions, baselines, rebooted)."""
    rebooted = saved.boot_id is not None and boot_id not in (None, saved.boot_id)
    kept: dict[str, list[Condition]] = {}
    for device_id, conditions in saved.conditions.items():
        held = [c for c in conditions if not rebooted or not ends(c.clears_by, Evidence.REBOOT)]
        if held:
            kept[device_id] = held
    baselines: dict[str, Baseline] = {}
    if not rebooted:
        baselines = {k: v for k, v in saved.baselines.items() if k in saved.conditions}
    return kept, baselines, rebooted
