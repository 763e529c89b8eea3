"""What the restarter does with a fault before deciding about it: drop it as a duplicate, let
it join a copy already in hand, hold it while nodes fail in a storm, or pass it on; and when a
Backoff's second look is due. Pure: no I/O and no clock (time comes in as an argument), so the
controller's threads only carry out what this says.

A fault id counts as handled only once its decisions are recorded (`settle(recorded=True)`):
a fault whose handling failed is forgotten, so the agent's resend or the watcher's next sight
of it is taken again instead of being answered "duplicate".
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

from edl_agent.faults.model import Fault, FaultKind
from edl_agent.restarter.core.storm import StormGuard
from edl_agent.runtime.bounded import BoundedSet

KEEP_IDS = 100_000
W = TypeVar("W")


class Admission(enum.Enum):
    NEW = "new"  # decide about it
    DUPLICATE = "duplicate"  # handled and recorded before
    JOINED = "joined"  # a copy is in hand: its outcome answers this one too
    HELD = "held"  # a node-failure fault during a storm: released when the storm is over


@dataclass(frozen=True)
class StormChange:
    storming: bool
    description: str
    released: tuple[Fault, ...] = ()
    """Held faults whose node still fails, to decide about now the storm is over."""
    dropped: int = 0
    """Held faults whose node recovered meanwhile."""


@dataclass
class Dispatch(Generic[W]):
    """The dispatcher's state. `W` is whatever the caller wants back when a fault it waits on
    is settled (the intake's waiter)."""

    storm: StormGuard = field(default_factory=StormGuard)
    keep_ids: int = KEEP_IDS
    storming: bool = False
    held: dict[str, Fault] = field(default_factory=dict)
    _seen: BoundedSet = field(init=False)
    _in_flight: dict[str, list[W]] = field(default_factory=dict)
    _due: list[tuple[datetime, int, Fault]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._seen = BoundedSet(self.keep_ids)

    # --- dedupe --------------------------------------------------------------------------

    def admit(self, fault: Fault, waiter: W | None = None, *, retry: bool = False) -> Admission:
        """What to do with `fault` now. A `retry` (a Backoff's second look, a held fault
        released) is never a duplicate. `waiter` is handed back by `settle`."""
        if fault.id in self._in_flight:
            if waiter is not None:
                self._in_flight[fault.id].append(waiter)
            return Admission.JOINED
        if not retry and fault.id in self._seen:
            return Admission.DUPLICATE
        if fault.kind is FaultKind.NODE_NOT_READY and self.storming:
            self.held[fault.id] = fault
            return Admission.HELD
        self._in_flight[fault.id] = [] if waiter is None else [waiter]
        return Admission.NEW

    def settle(self, fault_id: str, *, recorded: bool) -> list[W]:
        """The fault's handling ended: with its decisions recorded (a copy that comes again is
        a duplicate), or not (it is forgotten: a copy that comes again is decided again).
        Returns the waiters to tell."""
        waiters = self._in_flight.pop(fault_id, [])
        if recorded:
            self._seen.add(fault_id)
        else:
            self._seen.discard(fault_id)
        return waiters

    def in_hand(self) -> int:
        return len(self._in_flight)

    # --- the storm guard -----------------------------------------------------------------

    def nodes_seen(
        self, failing: int, total: int, still_failing: Callable[[str], bool]
    ) -> StormChange | None:
        """The node counts now; a StormChange when a storm begins or ends."""
        storming = self.storm.storming(failing, total)
        if storming == self.storming:
            return None
        self.storming = storming
        description = self.storm.describe(failing, total)
        if storming:
            return StormChange(True, description)
        held = list(self.held.values())
        self.held.clear()
        released = tuple(f for f in held if still_failing(f.node))
        return StormChange(False, description, released, len(held) - len(released))

    # --- backoffs ------------------------------------------------------------------------

    def schedule(self, fault: Fault, until: datetime) -> None:
        """Decide about `fault` again at `until` (a Backoff)."""
        heapq.heappush(self._due, (until, next(self._order), fault))

    def due(self, now: datetime) -> list[Fault]:
        """The faults whose second look is due at `now`, soonest first (removed)."""
        found = []
        while self._due and self._due[0][0] <= now:
            found.append(heapq.heappop(self._due)[2])
        return found

    def next_due(self) -> datetime | None:
        return self._due[0][0] if self._due else None

    def scheduled(self) -> int:
        return len(self._due)
