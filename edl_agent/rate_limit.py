"""A token bucket: what keeps a burst of faults from flooding the API with Events, on the node
(`labels.events`) and in the restarter (`restarter.events`). Pure: times are passed in."""

from __future__ import annotations


class TokenBucket:
    """`capacity` tokens, refilled at `per_second`; times are seconds on any one clock."""

    def __init__(self, *, capacity: int, per_second: float) -> None:
        self.capacity = capacity
        self.per_second = per_second
        self._tokens = float(capacity)
        self._at: float | None = None

    def take(self, now: float) -> bool:
        if self._at is not None:
            elapsed = max(0.0, now - self._at)
            self._tokens = min(self.capacity, self._tokens + elapsed * self.per_second)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
