"""Keys each due at a time, the earliest found at once: a heap whose entries are dropped lazily
(a key set again or discarded leaves its old entry behind, skipped when it surfaces). Pure and
not thread-safe: its owner holds a lock."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Hashable
from datetime import datetime
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[datetime, int, K]] = []
        self._current: dict[K, tuple[datetime, int]] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, key: object) -> bool:
        return key in self._current

    def set(self, key: K, at: datetime) -> None:
        """`key` is due at `at` (in place of any time it had)."""
        entry = (at, next(self._order))
        self._current[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._current) + 64:
            self._heap = [(at, n, k) for k, (at, n) in self._current.items()]
            heapq.heapify(self._heap)

    def discard(self, key: K) -> None:
        self._current.pop(key, None)

    def keep_only(self, keys: Collection[K]) -> None:
        for key in [k for k in self._current if k not in keys]:
            del self._current[key]

    def earliest(self) -> datetime | None:
        self._skip_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: datetime) -> list[K]:
        """The keys due at `now`, soonest first (removed)."""
        due: list[K] = []
        while (first := self.earliest()) is not None and first <= now:
            _, _, key = heapq.heappop(self._heap)
            del self._current[key]
            due.append(key)
        return due

    def _skip_stale(self) -> None:
        heap = self._heap
        while heap and self._current.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)
