"""A fake clock for parts that wait for a due time: moving it wakes them to read the time again,
as real time ending their timed wait would."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from edl_agent.runtime.clock import FakeClock


class WakingClock(FakeClock):
    def __init__(self, start: datetime, monotonic: float = 1000.0) -> None:
        super().__init__(start, monotonic)
        self._wakes: list[Callable[[], None]] = []

    def on_advance(self, wake: Callable[[], None]) -> None:
        """Call `wake()` whenever the clock moves."""
        self._wakes.append(wake)

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        for wake in list(self._wakes):
            wake()
