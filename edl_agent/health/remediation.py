"""The `remediation` part (opt-in): every `health.remediation.interval_seconds` it resets one idle
device whose quarantine a reset clears, if one may be reset now (`remediation.choose`), asks the
health hub to end the quarantine once the reset is validated, and makes the device wait for an
operator's release after `max_attempts` failed resets. Who holds a device comes from kubelet's
pod-resources API; no answer means no reset (a reset must never touch a held device)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import structlog

from edl_agent.config import HealthSettings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.hub import HealthHub
from edl_agent.health.model import ClearsBy
from edl_agent.health.remediation_rules import (
    Attempt,
    History,
    Outcome,
    Remediator,
    choose,
    held_ids,
    record,
    validate_reset,
)
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.kubelet.podresources import Claimable, PodResourcesClient
from edl_agent.runtime.supervisor import Every

NORMAL, WARNING = "Normal", "Warning"  # the Event types of Kubernetes


class Remediation:
    def __init__(
        self,
        *,
        hub: HealthHub,
        state: DeviceState,
        root: HostRoot,
        settings: HealthSettings,
        pods: PodResourcesClient,
        claimable: Callable[[Snapshot], Claimable],
        announce: Callable[[str, str, str], None],
        release_annotation: str,
    ) -> None:
        self._hub = hub
        self._state = state
        self._settings = settings.remediation
        self._pods = pods
        self._claimable = claimable
        self._announce = announce  # (kind, reason, message): an Event on the Node
        self._release_annotation = release_annotation
        self._remediator = Remediator(
            root, settings.remediation, validate=lambda d: validate_reset(root, d, settings)
        )
        self.history = History()
        self.counts: Counter[tuple[str, str]] = Counter()  # (vendor, result)
        self.rounds = 0  # rounds completed: what a test waits on to see a round decide nothing
        self._log = structlog.get_logger().bind(part="remediation")

    def part(self, wake: threading.Event) -> Every:
        """The `remediation` part: a round every `remediation.interval_seconds`."""
        self._log.info(
            "remediation on: idle devices waiting for a reset are reset",
            vendors=sorted(self._settings.commands),
            max_per_hour=self._settings.max_per_hour,
            max_attempts=self._settings.max_attempts,
        )
        return Every("remediation", lambda: self._settings.interval_seconds, self.step, wake)

    def step(self) -> None:
        self.remediate(time.monotonic())
        self.rounds += 1

    def remediate(self, now: float) -> Outcome | None:
        """Reset one idle device whose quarantine a reset clears, if any may be reset now."""
        snapshot = self._state.snapshot()
        devices = snapshot.inventory.devices
        quarantined = self._hub.quarantined()
        waiting_ids = {
            (d.parent or d.id)
            for d in devices
            if any(c.clears_by is ClearsBy.RESET for c in quarantined.get(d.id, ()))
        }
        waiting = [d for d in devices if d.parent is None and d.id in waiting_ids]
        if not waiting:
            return None
        holders = self._pods.pod_devices_known(snapshot.units, self._claimable(snapshot))
        if holders is None:
            self._log.info("no reset: kubelet's pod-resources API does not answer")
            return None
        device = choose(
            waiting=waiting,
            held=held_ids(devices, holders),
            history=self.history,
            now=now,
            settings=self._settings,
        )
        if device is None:
            return None
        self._log.warning("resetting an idle quarantined device", device=device.id)
        name = f"{device.vendor.value} {device.index} ({device.id})"
        self._event(NORMAL, "AcceleratorResetting", f"{name} idle: reset by the agent")
        outcome = self._remediator.reset(device)
        self.history = record(
            self.history, Attempt(device.id, now, outcome.ok, outcome.detail), now=now
        )
        family = [d.id for d in devices if device.id in (d.id, d.parent)]
        exhausted = False
        vendor = device.vendor.value
        if outcome.ok:
            self.counts[(vendor, "reset")] += 1
            self._hub.reset_done(family)
            self._event(NORMAL, "AcceleratorReset", f"{name} reset and validated: in service")
        else:
            failures = self.history.failures.get(device.id, 0)
            exhausted = failures >= self._settings.max_attempts
            self.counts[(vendor, "failed")] += 1
            if exhausted:
                self.counts[(vendor, "escalated")] += 1
                self._hub.escalate(family)
            self._event(WARNING, "AcceleratorResetFailed", f"{name}: {outcome.detail}")
        if exhausted:
            self._event(
                WARNING,
                "AcceleratorResetEscalated",
                f"{name}: {self._settings.max_attempts} resets failed; "
                f"waits for an operator's release ({self._release_annotation})",
            )
        self._log.log(
            20 if outcome.ok else 40,
            "device reset" if outcome.ok else "device reset failed",
            device=device.id,
            detail=outcome.detail,
            waits_for_release=exhausted or None,
        )
        return outcome

    def counted(self, vendors: set[str]) -> dict[tuple[str, str], int]:
        """The remediation counters for /metrics, every vendor's results at zero to start."""
        if not self._settings.enabled:
            return dict(self.counts)
        zeros = {
            (vendor, result): 0
            for vendor in vendors & self._settings.commands.keys()
            for result in ("reset", "failed", "escalated")
        }
        return zeros | dict(self.counts)

    def _event(self, kind: str, reason: str, message: str) -> None:
        self._announce(kind, reason, message)
