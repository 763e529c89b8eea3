"""A health-event sink for watcher tests: what an `on_event` callback received, thread-safe, and
a wait for the first N."""

from __future__ import annotations

import threading

from edl_agent.health.model import HealthEvent
from tests.waiting import wait_for


class Events:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[HealthEvent] = []

    def __call__(self, event: HealthEvent) -> None:
        with self._lock:
            self._events.append(event)

    def seen(self) -> list[HealthEvent]:
        with self._lock:
            return list(self._events)

    def wait(self, count: int) -> list[HealthEvent]:
        return wait_for(f"{count} health events", self.seen, lambda got: len(got) >= count)
