"""Where the next leader replays pod events from: a pod deleted while no replica led (or while
the API server was away) leaves no trace in a list, only a DELETED event in the watch history,
which the API server keeps for a few minutes. The leader keeps a resourceVersion of its pod
watch on the Lease; the next one watches from there after its first list. Pure.

The version kept is one handled at least `lag` seconds ago: a fault derived from a later event
may still be on its way to being recorded when the leader dies, and replaying a little more than
needed only derives faults again that are then found handled.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

ANNOTATION = "edl.io/pods-resource-version"
LAG_SECONDS = 30.0


@dataclass
class Checkpoint:
    inherited: str | None = None
    """The previous leader's, until this one has handled events long enough."""
    lag: float = LAG_SECONDS
    _samples: collections.deque[tuple[float, str]] = field(default_factory=collections.deque)

    def observe(self, now: float, version: str | None) -> None:
        """The watches' handled version at `now` (monotonic seconds)."""
        if version is None or (self._samples and self._samples[-1][1] == version):
            return
        self._samples.append((now, version))
        while len(self._samples) >= 2 and now - self._samples[1][0] >= self.lag:
            self._samples.popleft()

    def value(self, now: float) -> str | None:
        """The version to keep on the Lease now: the newest handled at least `lag` ago, else
        the oldest this leader handled (its replay of the inherited one starts there), else
        the inherited one (this leader has not listed yet)."""
        if self._samples:
            return self._samples[0][1]
        return self.inherited

    def annotations(self, now: float, version: Callable[[], str | None]) -> dict[str, str]:
        self.observe(now, version())
        value = self.value(now)
        return {ANNOTATION: value} if value else {}
