"""Memory that cannot grow without bound: the ids a component has seen (faults delivered, pods
ignored, events emitted) kept in insertion order, the oldest forgotten first once `limit` is
reached. One implementation for every such set and map in the agent and the restarter."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMap(OrderedDict[K, V]):
    """An insertion-ordered dict that forgets its oldest entries beyond `limit`."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            msg = f"limit must be at least 1, got {limit}"
            raise ValueError(msg)
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)


class BoundedSet:
    """The last `limit` keys added."""

    def __init__(self, limit: int) -> None:
        self._keys: BoundedMap[Hashable, None] = BoundedMap(limit)

    def add(self, key: Hashable, *, refresh: bool = False) -> bool:
        """Remember `key`; False when it was known already (then, with `refresh`, it counts as
        the newest again)."""
        if key in self._keys:
            if refresh:
                self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        return True

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
