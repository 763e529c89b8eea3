"""The `quiet-periods` part: ends a `quiet` condition when its device has been quiet for
`health.quiet_seconds`. It sleeps until the earliest quiet period ends, or until the health hub
opens or renews one (its subscription); with none open, until the hub opens one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from edl_agent.health.hub import HealthChange, HealthHub

# The shortest wait for a quiet period's end (one already due is expired in this round).
MIN_WAIT_SECONDS = 0.01


def _quiet(change: HealthChange) -> bool:
    return change.quiet_sooner


class QuietPeriods:
    name = "quiet-periods"

    def __init__(
        self,
        hub: HealthHub,
        wake: threading.Event,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hub = hub
        self._wake = wake
        self._subscription = hub.subscribe(wake, _quiet)
        self._clock = clock

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        while not stop.is_set():
            self._subscription.take()  # only a reason to look again
            self._hub.expire(self._clock())
            ready()
            self._wake.wait(self.next_wait())
            self._wake.clear()

    def next_wait(self) -> float | None:
        """Seconds until the earliest quiet period ends; None when none is open (nothing ends by
        time alone: only the hub's news wakes the part)."""
        end = self._hub.next_quiet_end()
        if end is None:
            return None
        return max(end - self._clock(), MIN_WAIT_SECONDS)
