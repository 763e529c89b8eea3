"""One backoff for every retry loop: doubling from `initial` up to `maximum`, with jitter so that
many agents retrying the same server spread out. Pure: the jitter comes from an injectable
random source."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


def backoff_delay(failures: int, *, initial: float, maximum: float, jitter: float) -> float:
    """Seconds to wait after `failures` failures in a row: doubling from `initial` up to
    `maximum`, scaled into its upper half by `jitter` in [0, 1)."""
    base = min(maximum, initial * 2.0 ** max(0, min(failures - 1, 32)))
    return base * (0.5 + jitter / 2)


@dataclass
class Backoff:
    initial: float
    maximum: float
    random: Callable[[], float] = field(default=random.random)
    failures: int = 0

    def next_delay(self) -> float:
        """Count one more failure; the seconds to wait before trying again."""
        self.failures += 1
        return backoff_delay(
            self.failures, initial=self.initial, maximum=self.maximum, jitter=self.random()
        )

    def reset(self) -> None:
        """It worked: the next failure waits `initial` again."""
        self.failures = 0
