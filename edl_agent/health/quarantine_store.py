"""The quarantine on disk: what keeps devices out of service across agent restarts.

`<state_dir>/health/quarantine.json` holds, per device, the conditions that only a reset, a
reboot or an operator ends (`ClearsBy.persistent`), the reset baseline read when the device was
quarantined (so a reset made while the agent was down is still seen), and the node's boot id at
the time of writing (a new one at start is a reboot). It is written atomically (a temporary file,
fsync, rename) whenever it changes, and read once at start, before kubelet is served.

A file that cannot be read as this format is set aside as `quarantine.json.corrupt` with one log
line and the agent starts without it: a crash loop over a bad file would take every device away.
Times are stored as wall-clock seconds and turned back into this process's monotonic clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from edl_agent.health.model import ClearsBy, Level
from edl_agent.health.tracker import Condition
from edl_agent.runtime.durable import read_state, write_atomically

FORMAT = 1
FILE_NAME = "quarantine.json"

Baseline = Mapping[str, int | None]


@dataclass(frozen=True)
class Quarantine:
    boot_id: str | None
    conditions: Mapping[str, tuple[Condition, ...]] = field(default_factory=dict)
    baselines: Mapping[str, Baseline] = field(default_factory=dict)


class QuarantineStore:
    def __init__(
        self,
        directory: Path,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = directory / FILE_NAME
        self._wall = wall
        self._monotonic = monotonic
        self._written: str | None = None
        self._log = structlog.get_logger().bind(part="quarantine", path=str(self.path))

    def load(self) -> Quarantine | None:
        """The saved quarantine, or None when there is none or it was corrupt (set aside)."""
        read = read_state(self.path, self._decode, what="quarantine file", log=self._log)
        if read is None:
            return None
        loaded, self._written = read
        return loaded

    def save(self, quarantine: Quarantine) -> bool:
        """Write `quarantine` when it differs from what is on disk; True when written."""
        text = json.dumps(self._encode(quarantine), indent=1, sort_keys=True) + "\n"
        if text == self._written:
            return False
        write_atomically(self.path, text)
        self._written = text
        return True

    def _encode(self, quarantine: Quarantine) -> dict[str, Any]:
        offset = self._wall() - self._monotonic()
        devices: dict[str, Any] = {}
        for device_id, conditions in quarantine.conditions.items():
            devices[device_id] = {
                "conditions": [
                    {
                        "reason": c.reason,
                        "level": c.level.value,
                        "clears_by": c.clears_by.value,
                        "since": round(c.since + offset, 3),
                        "last_seen": round(c.last_seen + offset, 3),
                        "detail": c.detail,
                        "count": c.count,
                    }
                    for c in conditions
                ],
            }
            baseline = quarantine.baselines.get(device_id)
            if baseline is not None:
                devices[device_id]["baseline"] = dict(baseline)
        return {"format": FORMAT, "boot_id": quarantine.boot_id, "devices": devices}

    def _decode(self, data: Mapping[str, Any]) -> Quarantine:
        if data.get("format") != FORMAT:
            msg = f"format {data.get('format')!r}, expected {FORMAT}"
            raise ValueError(msg)
        offset = self._wall() - self._monotonic()
        conditions: dict[str, tuple[Condition, ...]] = {}
        baselines: dict[str, Baseline] = {}
        for device_id, entry in dict(data["devices"]).items():
            conditions[str(device_id)] = tuple(
                Condition(
                    reason=str(c["reason"]),
                    level=Level(c["level"]),
                    clears_by=ClearsBy(c["clears_by"]),
                    since=float(c["since"]) - offset,
                    last_seen=float(c["last_seen"]) - offset,
                    detail=str(c.get("detail", "")),
                    count=int(c.get("count", 1)),
                )
                for c in entry["conditions"]
            )
            if entry.get("baseline") is not None:
                baselines[str(device_id)] = {
                    str(k): (None if v is None else int(v)) for k, v in entry["baseline"].items()
                }
        boot_id = data.get("boot_id")
        return Quarantine(
            boot_id=str(boot_id) if boot_id is not None else None,
            conditions=conditions,
            baselines=baselines,
        )


def read_boot_id(host_root_read: Callable[[str], str | None]) -> str | None:
    """The node's boot id: the host root's (a simulated node has its own), else this kernel's
    (the same kernel in a pod); None when neither can be read."""
    boot_id = host_root_read("/proc/sys/kernel/random/boot_id")
    if boot_id:
        return boot_id
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip() or None
    except OSError:
        return None
