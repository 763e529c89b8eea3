"""Resetting idle quarantined devices (opt-in: `health.remediation.enabled`).

A device quarantined for a fault a reset clears, held by no pod (kubelet's pod-resources; a GPU
counts as held while any of its MIG devices or shares is), is reset with the vendor's configured
command run from the host root, one device at a time per node and at most `max_per_hour`. The
device then has to pass validation — read again through NVML or its tool, present and clean —
before the agent ends its quarantine (a reset the agent performed and validated is evidence). A
reset that fails, or that validation does not confirm, counts as an attempt; after
`max_attempts` the device waits for an operator's release instead.

`choose` and `record` are pure; `Remediator` runs commands and calls back into the agent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from edl_agent.config import HealthSettings
from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.model import Device, Vendor
from edl_agent.health.nvml_reset import ACTION_NONE, LOST, RECOVERY_ACTION, read_baselines
from edl_agent.health.vendor_readings import POLLERS, poll
from edl_agent.health_settings import RemediationSettings

HOUR = 3600.0
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Attempt:
    device_id: str
    at: float
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class History:
    """Resets tried on this node (the last hour is what the rate limit looks at) and the failed
    attempts per device since its quarantine began."""

    attempts: tuple[Attempt, ...] = ()
    failures: Mapping[str, int] = field(default_factory=dict)

    def recent(self, now: float) -> int:
        return sum(1 for a in self.attempts if now - a.at < HOUR)


def choose(
    *,
    waiting: Sequence[Device],
    held: Collection[str],
    history: History,
    now: float,
    settings: RemediationSettings,
) -> Device | None:
    """The device to reset now, or None. `waiting` are physical devices whose quarantine a reset
    clears; `held` the device ids pods hold (MIG devices and shares by their own ids). Devices of
    a vendor without a command, held ones, and those that used up their attempts are skipped;
    nothing is chosen once the hour's resets are spent."""
    if not settings.enabled or history.recent(now) >= settings.max_per_hour:
        return None
    for device in sorted(waiting, key=lambda d: (d.vendor.value, d.index)):
        if device.vendor.value not in settings.commands:
            continue
        if history.failures.get(device.id, 0) >= settings.max_attempts:
            continue
        if device.id in held or command_for(device, settings) is None:
            continue
        return device
    return None


def record(history: History, attempt: Attempt, *, now: float) -> History:
    """`history` with `attempt` added (and attempts older than an hour dropped); a success
    forgets the device's failures."""
    attempts = (*(a for a in history.attempts if now - a.at < HOUR), attempt)
    failures = dict(history.failures)
    if attempt.ok:
        failures.pop(attempt.device_id, None)
    else:
        failures[attempt.device_id] = failures.get(attempt.device_id, 0) + 1
    return History(attempts, failures)


def command_for(device: Device, settings: RemediationSettings) -> list[str] | None:
    """The vendor's command with `{index}` and `{attribute}` filled in from the device; None
    when it names an attribute the device lacks (an NPU whose id npu-smi did not list)."""
    values = {"index": str(device.index), **device.attributes}
    filled = []
    for word in settings.commands[device.vendor.value]:
        for name in _PLACEHOLDER.findall(word):
            if name not in values:
                return None
        filled.append(_PLACEHOLDER.sub(lambda m: values[m.group(1)], word))
    return filled


def held_ids(devices: Iterable[Device], holders: Collection[str]) -> frozenset[str]:
    """Ids of physical devices held directly or through one of their partitions."""
    held = set(holders)
    for device in devices:
        if device.parent is not None and device.id in holders:
            held.add(device.parent)
    return frozenset(held)


@dataclass(frozen=True)
class Outcome:
    device: Device
    ok: bool
    detail: str


class Remediator:
    """Runs one reset and its validation; the agent decides when and applies the outcome."""

    def __init__(
        self,
        root: HostRoot,
        settings: RemediationSettings,
        *,
        validate: Callable[[Device], str | None],
    ) -> None:
        self.root = root
        self.settings = settings
        self._validate = validate

    def reset(self, device: Device) -> Outcome:
        """Run the reset command; then `validate` (None: the device reads clean, else why not)."""
        command = command_for(device, self.settings)
        if command is None:
            return Outcome(device, ok=False, detail="the reset command names what the device lacks")
        try:
            output = self.root.read_tool(
                command[0],
                command[1:],
                lambda text: text.strip().splitlines()[-1:] or [""],
                timeout=self.settings.timeout_seconds,
            )
        except ToolError as exc:
            return Outcome(device, ok=False, detail=str(exc))
        problem = self._validate(device)
        if problem is not None:
            return Outcome(device, ok=False, detail=f"reset ran, validation failed: {problem}")
        return Outcome(device, ok=True, detail=f"{' '.join(command)}: {output[0]}".strip())


def validate_reset(root: HostRoot, device: Device, settings: HealthSettings) -> str | None:
    """After a reset: None when the device reads present and clean, else what is wrong.
    NVIDIA: NVML reads the GPU, it is not lost and the driver asks for no recovery action.
    Polled vendors: one poll of the device works and reports nothing severe for it."""
    if device.vendor is Vendor.NVIDIA:
        return _validate_gpu(root, device)
    if device.vendor not in POLLERS:
        return None
    result = poll(device.vendor, root, [device], settings)
    if not result.ok:
        return "; ".join(e.detail for e in result.events) or "the tool failed"
    severe = [e for e in result.events if e.device_id == device.id and e.level.kept]
    return f"{severe[0].reason}: {severe[0].detail}" if severe else None


def _validate_gpu(root: HostRoot, device: Device) -> str | None:
    reading = read_baselines(root, [device.id]).get(device.id)
    if reading is None:
        return "NVML cannot read the GPU"
    if reading.get(LOST):
        return "the GPU is lost"
    action = reading.get(RECOVERY_ACTION)
    if action not in (None, ACTION_NONE):
        return f"the driver still reports recovery action {action}"
    return None
