"""The node condition `AcceleratorHealthy`, from the unhealthy devices. Pure.

- `status` is `True` while no device is unhealthy, `False` while any is (cordoned devices are an
  operator's choice, not a fault: they do not count).
- `reason` is `AcceleratorsHealthy` when `True`; when `False` it names the fault of the worst
  device (node-fatal before device-fatal, then the oldest), turned into CamelCase: each `_`-part
  that is a known acronym stays upper case (`XID79`, `GPULost`, `ECCDBE`, `NVMLInitFailed`,
  `NodeVanished`, `NPUHealthCritical`); anything but letters and digits is dropped and a reason
  that would not start with a letter gets `Fault` in front.
- `message` says how many devices are unhealthy and names each one — vendor, index and id — with
  its fault as the health monitor reported it (`XID79`), the detail and what it waits for (a
  reset, a reboot, an operator's release); at most 1024 characters.
- degraded devices (a fault is coming; they serve their pods and take no new ones) change neither
  status nor a `False` reason: with none unhealthy the reason is `AcceleratorsDegraded`, and the
  message names each degraded device, its warning and what ends it, after the unhealthy ones.
- no device at all is a finding, not health: status `Unknown`, reason `NoAcceleratorsFound`, and
  a message on why it may be (the host root not mounted, an accelerator the PCI bus shows but
  no driver or tool found, a vendor disabled in the settings, a vendor's discovery error, a
  container runtime that gives no devices). Not `True`: nothing was checked; not `False`: a
  node without accelerators is not a faulty one, and readers of `False` (`edl-agent hosts`)
  take the node's accelerators for broken.
- a vendor whose monitor fails (its tool broken) while no device is unhealthy makes the status
  `Unknown` (reason `<TOOL>Failed`): the devices stay advertised as they were, but nobody can say
  whether they are healthy. The message names the failing monitors in every status.
- a state directory that refuses writes (a full or read-only disk) while the agent holds faults
  for the restarter or the quarantine in memory only is said at the end of the message, in every
  status (`state directory refuses writes: ... kept in memory only, lost if the agent restarts`);
  it is no accelerator fault and changes neither status nor reason. It names what is held, not
  how much (the counts are on /readyz and in the metrics), so the condition is not rewritten for
  every fault; it goes when the disk takes the writes again.
- `lastHeartbeatTime` is the time of every write (changes and periodic resyncs);
  `lastTransitionTime` changes only when `status` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from edl_agent.devices.model import Device, HostFacts, Inventory, Vendor
from edl_agent.health.model import ClearsBy, Level
from edl_agent.health.tracker import Condition
from edl_agent.kube_time import format_time
from edl_agent.labels.cordon import RELEASE_DEVICES

CONDITION_TYPE = "AcceleratorHealthy"
HEALTHY_REASON = "AcceleratorsHealthy"
DEGRADED_REASON = "AcceleratorsDegraded"
NO_DEVICES_REASON = "NoAcceleratorsFound"
MAX_MESSAGE = 1024
ACRONYMS = frozenset(
    {"GPU", "NPU", "XPU", "DCU", "XID", "ECC", "DBE", "SBE", "NVML", "PCI", "PCIE", "HBM", "AI"}
)
_SEVERITY = {Level.NODE_FATAL: 0, Level.DEVICE_FATAL: 1}
WAITS_FOR: Mapping[ClearsBy, str] = {
    ClearsBy.QUIET: "clears when quiet",
    ClearsBy.RESET: "waits for a reset",
    ClearsBy.REBOOT: "waits for a reboot",
    ClearsBy.RELEASE: f"waits for a release ({RELEASE_DEVICES})",
}


@dataclass(frozen=True)
class DeviceFault:
    """One unhealthy device, named for people."""

    device_id: str
    name: str  # `nvidia 3 (GPU-...)`
    reason: str  # as the health monitor reported it: `XID79`, `GPU_LOST`
    detail: str
    level: Level
    clears_by: ClearsBy = ClearsBy.CONDITION

    @property
    def summary(self) -> str:
        """The fault and its detail: `XID79: GPU has fallen off the bus`."""
        return f"{self.reason}: {self.detail}" if self.detail else self.reason

    def describe(self) -> str:
        waits = WAITS_FOR.get(self.clears_by)
        return f"{self.name} {self.summary}" + (f" ({waits})" if waits else "")


@dataclass(frozen=True)
class Unsaved:
    """What the agent's state directory does not hold now, because it refused the writes."""

    faults: int = 0  # pending faults for the restarter kept in memory only
    quarantine: bool = False  # the quarantine kept in memory only

    def __bool__(self) -> bool:
        return bool(self.faults or self.quarantine)

    def describe(self, *, counted: bool = True) -> str:
        """`3 fault(s) for the restarter and the quarantine`; without the count, `faults for the
        restarter and the quarantine`; "" when nothing is held."""
        held = []
        if self.faults:
            held.append(f"{self.faults} fault(s)" if counted else "faults")
        if self.quarantine:
            held.append("the quarantine")
        if self.faults:
            held[0] += " for the restarter"
        return " and ".join(held)


@dataclass(frozen=True)
class AcceleratorHealth:
    """What the condition says; `faults` sorted worst first."""

    healthy: bool
    reason: str
    message: str
    faults: tuple[DeviceFault, ...] = ()
    unknown: bool = False  # a monitor fails and no device is known to be unhealthy
    degraded: tuple[DeviceFault, ...] = ()

    @property
    def status(self) -> str:
        if self.unknown:
            return "Unknown"
        return "True" if self.healthy else "False"


def accelerator_health(
    *,
    inventory: Inventory,
    unhealthy: Mapping[str, Condition],
    monitors: Mapping[Vendor, Condition] | None = None,
    unsaved: Unsaved | None = None,
    degraded: Mapping[str, Condition] | None = None,
) -> AcceleratorHealth:
    """The condition for `unhealthy` (device id → its worst condition) on this inventory, the
    vendors whose health monitor fails (`monitors`), the `degraded` devices (id → condition) and
    what the disk refused (`unsaved`)."""
    health = _health(
        inventory=inventory, unhealthy=unhealthy, monitors=monitors, degraded=degraded or {}
    )
    if not unsaved:
        return health
    note = (
        f"; state directory refuses writes: {unsaved.describe(counted=False)} kept in memory "
        "only, lost if the agent restarts"
    )
    return replace(health, message=_cut(health.message, keep=note))


def _health(
    *,
    inventory: Inventory,
    unhealthy: Mapping[str, Condition],
    monitors: Mapping[Vendor, Condition] | None,
    degraded: Mapping[str, Condition],
) -> AcceleratorHealth:
    devices = {d.id: d for d in inventory.devices}
    physical = sum(d.parent is None for d in inventory.devices)
    faults = _faults(unhealthy, devices)
    failing = sorted((monitors or {}).items(), key=lambda item: item[0].value)
    warned = _faults(degraded, devices)
    note = "".join(
        f"; {vendor.value} health monitor failing: {c.reason}"
        + (f" ({c.detail})" if c.detail else "")
        for vendor, c in failing
    )
    if warned:
        note += f"; {len(warned)} degraded: " + "; ".join(f.describe() for f in warned)
    if not faults and not inventory.devices:
        return no_accelerators(inventory)
    return replace(_summary(faults, failing, note, physical, warned=bool(warned)), degraded=warned)


def _summary(
    faults: tuple[DeviceFault, ...],
    failing: list[tuple[Vendor, Condition]],
    note: str,
    physical: int,
    *,
    warned: bool,
) -> AcceleratorHealth:
    if not faults:
        if failing:
            message = _cut(f"health of {physical} accelerators unknown" + note)
            reason = condition_reason(failing[0][1].reason)
            return AcceleratorHealth(True, reason, message, unknown=True)
        if warned:
            message = _cut(f"all {physical} accelerators in service" + note)
            return AcceleratorHealth(True, DEGRADED_REASON, message)
        return AcceleratorHealth(True, HEALTHY_REASON, f"all {physical} accelerators healthy")
    head = f"{len(faults)} of {max(physical, len(faults))} accelerators unhealthy: "
    message = _cut(head + "; ".join(f.describe() for f in faults) + note)
    return AcceleratorHealth(False, condition_reason(faults[0].reason), message, faults)


def _faults(
    conditions: Mapping[str, Condition], devices: Mapping[str, Device]
) -> tuple[DeviceFault, ...]:
    """Worst first (node-fatal before device-fatal), then the oldest."""
    ordered = sorted(
        conditions.items(),
        key=lambda item: (_SEVERITY.get(item[1].level, 2), item[1].since, _order(item, devices)),
    )
    return tuple(
        DeviceFault(
            device_id=device_id,
            name=device_name(devices.get(device_id), device_id),
            reason=condition.reason,
            detail=condition.detail,
            level=condition.level,
            clears_by=condition.clears_by,
        )
        for device_id, condition in ordered
    )


def no_accelerators(inventory: Inventory) -> AcceleratorHealth:
    """The condition of a node where discovery found no device, with the likely causes."""
    facts = inventory.host or HostFacts(host_root="the host root")
    root = facts.host_root
    causes: list[str] = []
    if facts.missing:
        causes.append(
            f"{' and '.join(facts.missing)} missing under {root}: is the host's / mounted there?"
        )
    causes += [f"{vendor} discovery failed: {error}" for vendor, error in inventory.errors.items()]
    for vendor, count in facts.pci.items():
        if vendor in facts.disabled:
            causes.append(
                f"PCI shows {count} {vendor.value} accelerators, but {vendor.value} is disabled "
                f"in the settings ({vendor.value}.enabled)"
            )
        elif vendor.value not in inventory.errors:
            causes.append(
                f"PCI shows {count} {vendor.value} accelerators but none was discovered: is the "
                f"driver loaded, its library or tool under {root}, and its /dev nodes given to "
                "this container by the container runtime?"
            )
    causes += [
        f"{r.vendor.value}'s driver library or tool answered with no device"
        for r in inventory.reports
        if r.error is None and r.vendor not in facts.pci
    ]
    if not causes:
        off = [v.value for v in facts.disabled]
        causes.append(
            "no accelerator on the PCI bus and no driver library or vendor tool found"
            + (f" ({', '.join(off)} disabled in the settings)" if off else "")
            + ": a node without accelerators (the agent need not run here), or a host root "
            "without /sys/bus/pci, or a container runtime that gives this container no devices"
        )
    message = _cut(f"no accelerators found under {root}; " + "; ".join(causes))
    return AcceleratorHealth(True, NO_DEVICES_REASON, message, unknown=True)


def device_name(device: Device | None, device_id: str) -> str:
    if device is None:
        return device_id
    return f"{device.vendor.value} {device.index} ({device.id})"


def _order(item: tuple[str, Condition], devices: Mapping[str, Device]) -> tuple[str, int, str]:
    device = devices.get(item[0])
    if device is None:
        return ("~", 0, item[0])  # devices no longer discovered after the known ones
    return (device.vendor.value, device.index, device.id)


def condition_reason(raw: str) -> str:
    """A CamelCase condition reason from a health reason: `GPU_LOST` → `GPULost`."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", raw) if w]
    reason = "".join(w if w.upper() in ACRONYMS or _has_digit(w) else w.capitalize() for w in words)
    if not reason or not reason[0].isalpha():
        reason = "Fault" + reason
    return reason[:128]


def _has_digit(word: str) -> bool:
    return any(c.isdigit() for c in word)


def _cut(message: str, *, keep: str = "") -> str:
    """`message` and `keep` within MAX_MESSAGE characters, cutting `message`, never `keep`."""
    room = MAX_MESSAGE - len(keep)
    return (message if len(message) <= room else message[: room - 3] + "...") + keep


def node_condition(
    health: AcceleratorHealth, *, previous: Mapping[str, Any] | None, now: datetime
) -> dict[str, Any]:
    """The condition as the API takes it; `previous` is the node's current one (or None)."""
    stamp = format_time(now)
    unchanged = previous is not None and previous.get("status") == health.status
    transition = previous.get("lastTransitionTime") if previous and unchanged else None
    return {
        "type": CONDITION_TYPE,
        "status": health.status,
        "reason": health.reason,
        "message": health.message,
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": transition or stamp,
    }


def find_condition(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Our condition in a Node (as JSON), or None."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
