"""The `quiet-periods` part: ends a `quiet` condition when its device has been quiet for
`health.quiet_seconds`. It sleeps until the earliest quiet period ends, or until the health hub
opens or renews one (its subscription), and for `idle_seconds` when none is open."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from edl_agent.health.hub import HealthChange, HealthHub

IDLE_SECONDS = 300.0
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
        idle_seconds: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hub = hub
        self._wake = wake
        self._subscription = hub.subscribe(wake, _quiet)
        self.idle_seconds = idle_seconds
        self._clock = clock

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        while not stop.is_set():
            self._subscription.take()  # only a reason to look again
            self._hub.expire(self._clock())
            ready()
            self._wake.wait(self.next_wait())
            self._wake.clear()

    def next_wait(self) -> float:
        """Seconds until the earliest quiet period ends (`idle_seconds` when none is open)."""
        end = self._hub.next_quiet_end()
        if end is None:
            return self.idle_seconds
        return min(self.idle_seconds, max(end - self._clock(), MIN_WAIT_SECONDS))
