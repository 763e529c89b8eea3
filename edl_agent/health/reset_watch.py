"""Reset evidence, read on events: NVML reset marks of quarantined NVIDIA devices.

The `reset-evidence` part wakes when the health hub quarantines a device (its subscription): the
GPU's marks are read at once, so a reset that follows at once finds a baseline to differ from.
While a device waits for a reset it reads again every `interval` seconds (at least
`MIN_INTERVAL_SECONDS`): a reset by hand sends no event, and one NVML session per round is all it
costs. With nothing waiting for a reset it sleeps until the hub wakes it.

A reboot ends the agent's process, so the boot id that tells of one is read as the agent starts
(the hub compares it with the restored quarantine's); it is read here only when that read failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.hub import HealthChange, HealthHub
from edl_agent.health.nvml_reset import read_baselines
from edl_agent.health.quarantine_store import read_boot_id

MIN_INTERVAL_SECONDS = 5.0


def _turned(change: HealthChange) -> bool:
    return bool(change.turned or change.degraded)


class ResetEvidence:
    name = "reset-evidence"

    def __init__(
        self,
        hub: HealthHub,
        root: HostRoot,
        wake: threading.Event,
        *,
        interval: Callable[[], float],
    ) -> None:
        self._hub = hub
        self._root = root
        self._wake = wake
        self._subscription = hub.subscribe(wake, _turned)
        self._interval = interval
        self.rounds = 0

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        while not stop.is_set():
            self._subscription.take()  # what turned is read again below, with the rest
            waiting = self.check()
            ready()
            self._wake.wait(max(self._interval(), MIN_INTERVAL_SECONDS) if waiting else None)
            self._wake.clear()

    def look_now(self) -> None:
        """Read the marks again at once (a round that begins after this call)."""
        self._wake.set()

    def check(self) -> bool:
        """Look for evidence that quarantined (or degraded until reset) NVIDIA devices were reset
        (NVML); a device just quarantined gets its baseline. True while a device waits for a
        reset."""
        if self._hub.boot_id is None:
            boot_id = read_boot_id(self._root.read_optional)
            if boot_id is not None:
                self._hub.rebooted(boot_id)
        waiting = self._hub.waiting_for_reset()
        if waiting:
            readings = read_baselines(self._root, set(waiting.values()))
            self._hub.reset_readings(waiting, readings)
        self.rounds += 1
        return bool(waiting)
