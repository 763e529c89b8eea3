"""One injectable clock for both processes: monotonic seconds (intervals, deadlines) and the
wall time (what is recorded in the API). `SystemClock` in production, `FakeClock` in tests,
where time moves only when the test says so."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds that only move forward (for intervals and deadlines)."""
        ...

    def now(self) -> datetime:
        """The wall time, timezone-aware (for what is recorded)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock that moves only by `advance`; both of its readings move together. Callable, so
    it also serves where a plain `() -> datetime` is asked for."""

    def __init__(self, start: datetime, monotonic: float = 1000.0) -> None:
        self._now = start
        self._monotonic = monotonic
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def __call__(self) -> datetime:
        return self.now()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += timedelta(seconds=seconds)
            self._monotonic += seconds
