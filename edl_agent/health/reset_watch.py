"""Reset evidence, read on events: NVML reset marks of quarantined NVIDIA devices and the node's
boot id.

The `reset-evidence` part wakes when the health hub quarantines a device (its subscription): the
GPU's marks are read at once, so a reset that follows at once finds a baseline to differ from.
Between events it reads every `interval` seconds (at least `MIN_INTERVAL_SECONDS`): a reset by
hand or a reboot sends no event, and one NVML session per round is all it costs. With nothing
waiting for a reset a round reads only the boot id.
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
    return bool(change.turned)


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
            self.check()
            ready()
            self._wake.wait(max(self._interval(), MIN_INTERVAL_SECONDS))
            self._wake.clear()

    def check(self) -> None:
        """Look for evidence that quarantined NVIDIA devices were reset (NVML) and that the node
        rebooted (its boot id) while this agent ran; a device just quarantined gets its
        baseline."""
        boot_id = read_boot_id(self._root.read_optional)
        if boot_id is not None:
            self._hub.rebooted(boot_id)
        waiting = self._hub.waiting_for_reset()
        if waiting:
            readings = read_baselines(self._root, set(waiting.values()))
            self._hub.reset_readings(waiting, readings)
        self.rounds += 1
