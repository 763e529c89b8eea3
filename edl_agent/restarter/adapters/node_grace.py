"""When a NotReady node's pods fault: the moment its grace ends (`node_grace_seconds`, on the
restarter's clock from when it first saw the node NotReady), never on a fixed tick.

`GraceTick` keeps when each NotReady node's grace ends (a heap of deadlines) and which have
ended; `NodeGraceTicker` is the part that waits for the earliest end and then has the watcher
fault the pods of the nodes past their grace. It is woken earlier only for a reason: a node
went NotReady or recovered (an end came or went), a pod came to a node past its grace, or (in
tests) the clock moved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from edl_agent.restarter.core.deadlines import Deadlines
from edl_agent.restarter.core.wakeup import Wakeup


class GraceTick:
    """The ends of the NotReady nodes' graces: when the node-grace ticker ticks next."""

    def __init__(self, grace: float, clock: Callable[[], datetime]) -> None:
        self.grace = timedelta(seconds=grace)
        self._clock = clock
        self._lock = threading.Lock()
        self._ends: Deadlines[str] = Deadlines()
        self._past: set[str] = set()  # NotReady past their grace: their pods fault
        self.wakeup = Wakeup()

    def not_ready(self, node: str, since: datetime) -> None:
        """`node` was first seen NotReady at `since`."""
        with self._lock:
            self._past.discard(node)
            self._ends.set(node, since + self.grace)
        self.wakeup.wake()

    def ready(self, node: str) -> None:
        """`node` is Ready again, or gone."""
        with self._lock:
            known = node in self._ends or node in self._past
            self._ends.discard(node)
            self._past.discard(node)
        if known:
            self.wakeup.wake()

    def keep_only(self, nodes: set[str]) -> None:
        """A re-list: the nodes not among `nodes` are gone."""
        with self._lock:
            self._ends.keep_only(nodes)
            self._past &= nodes

    def past(self) -> set[str]:
        """The nodes whose grace has ended by now."""
        now = self._clock()
        with self._lock:
            self._past.update(self._ends.pop_due(now))
            return set(self._past)

    def is_past(self, node: str) -> bool:
        with self._lock:
            return node in self._past

    def seconds_left(self) -> float | None:
        """Until the earliest grace still running ends (None: none runs)."""
        with self._lock:
            end = self._ends.earliest()
        return None if end is None else (end - self._clock()).total_seconds()


@dataclass
class NodeGraceTicker:
    """The part that has `check` fault the pods of nodes past their grace, each time a grace
    ends (`tick`) or it is woken. A round that raises kills the part; the supervisor runs it
    again."""

    check: Callable[[], None]
    tick: GraceTick
    name: str = "node-grace"
    rounds: int = field(default=0, init=False)  # checks run (tests wait on them)

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        wakeup = self.tick.wakeup
        wakeup.attach(stop)
        try:
            ready()
            while not stop.is_set():
                wakeup.begin()
                self.check()
                self.rounds += 1
                wakeup.wait(self.tick.seconds_left())
        finally:
            wakeup.detach()
