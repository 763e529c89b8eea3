"""Which quarantined NVIDIA devices a reset has cleared, from baselines and new readings. Pure.

A MIG device is reset with its GPU, so it is read through its GPU's uuid. The first reading of a
device (quarantined just now, or restored without a baseline) becomes its baseline; a later one
that shows a reset (`nvml_reset.was_reset`) names the device as reset.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from edl_agent.devices.model import Device, Vendor
from edl_agent.health.model import ClearsBy
from edl_agent.health.nvml_reset import Baseline, was_reset
from edl_agent.health.tracker import Condition


@dataclass(frozen=True)
class ResetCheck:
    reset: frozenset[str]  # devices whose GPU shows a reset since its baseline
    baselines: Mapping[str, Baseline]  # the baselines to keep (new ones added, reset ones gone)


def waiting_for_reset(
    quarantined: Mapping[str, Iterable[Condition]], devices: Iterable[Device]
) -> dict[str, str]:
    """NVIDIA devices with a condition a reset clears -> the uuid of the GPU to read."""
    by_id = {device.id: device for device in devices}
    wanted: dict[str, str] = {}
    for device_id, conditions in quarantined.items():
        device = by_id.get(device_id)
        if device is None or device.vendor is not Vendor.NVIDIA:
            continue
        if any(c.clears_by is ClearsBy.RESET for c in conditions):
            wanted[device_id] = device.parent or device.id
    return wanted


def check_resets(
    waiting: Mapping[str, str],
    baselines: Mapping[str, Baseline],
    readings: Mapping[str, Baseline],
) -> ResetCheck:
    """Compare each waiting device's GPU reading with its baseline. A GPU that could not be read
    this time changes nothing."""
    kept: dict[str, Baseline] = {}
    reset: set[str] = set()
    for device_id, gpu in waiting.items():
        reading = readings.get(gpu)
        baseline = baselines.get(device_id)
        if baseline is None:
            if reading is not None:
                kept[device_id] = reading
            continue
        if reading is not None and was_reset(baseline, reading):
            reset.add(device_id)
            continue
        kept[device_id] = baseline
    return ResetCheck(frozenset(reset), kept)
