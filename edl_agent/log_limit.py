"""Bounded logging under floods: the first line of a kind, then at most one per interval.

A device that reports the same fault 100,000 times in a second must not write 100,000 lines
(NVSentinel #1120: 800k XID lines for 29 events). The counters that metrics read still count
every event; the log says how many lines it held back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

from edl_agent.runtime.bounded import BoundedMap

MAX_KINDS = 4096


class LogLimiter:
    def __init__(self, *, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (last logged, held back); the kind logged longest ago is forgotten first
        self._kinds: BoundedMap[Hashable, tuple[float, int]] = BoundedMap(MAX_KINDS)

    def allow(self, key: Hashable) -> int | None:
        """None: do not log this one; else log it, saying how many were held back before it."""
        now = self._clock()
        with self._lock:
            last = self._kinds.get(key)
            if last is not None and now - last[0] < self.interval:
                self._kinds[key] = (last[0], last[1] + 1)
                return None
            self._kinds.pop(key, None)
            self._kinds[key] = (now, 0)
            return last[1] if last is not None else 0
