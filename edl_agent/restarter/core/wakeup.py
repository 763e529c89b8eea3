"""How a part that has nothing to do waits: until its next due time, or until someone gives it
a reason to look earlier (`wake`: a fault queued, a node changed, the clock moved in a test), or
until its stop. Never on a fixed tick.

The loop of such a part is

    wakeup.attach(stop)         # the stop (a StopSignal) wakes it too
    while not stop.is_set():
        wakeup.begin()          # what woke it is being seen to from here on
        ... look, do what is due ...
        wakeup.wait(seconds until the next due time, or None)
    wakeup.detach()

A `wake` after `begin` ends the next `wait` at once, so none is lost. `idle()` tells whether the
part waits with every wake seen to (tests wait on it before asserting that nothing happened).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from edl_agent.runtime.supervisor import on_stop


def _nothing() -> None:
    pass


class Wakeup:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._idle = threading.Event()
        self._forget: Callable[[], None] = _nothing

    def attach(self, stop: threading.Event) -> None:
        """A run begins: `stop` (a `StopSignal`; TypeError otherwise) ends its waits too."""
        self._forget = on_stop(stop, self.wake)

    def detach(self) -> None:
        """The run ended (stopped or died): its stop is forgotten. A wake meanwhile is kept."""
        forget, self._forget = self._forget, _nothing
        forget()
        self._idle.clear()

    def wake(self) -> None:
        """Look again now (safe from any thread; never blocks for long)."""
        with self._lock:
            self._idle.clear()
            self._event.set()

    def begin(self) -> None:
        """A look begins: the wakes so far are seen to by it."""
        with self._lock:
            self._event.clear()

    def wait(self, seconds: float | None) -> None:
        """Wait `seconds` (None: until woken), or less when woken or stopped."""
        with self._lock:
            if not self._event.is_set():
                self._idle.set()
        self._event.wait(None if seconds is None else max(0.0, seconds))
        self._idle.clear()

    def idle(self) -> bool:
        """Whether the part waits for its next due time with every wake seen to."""
        return self._idle.is_set()
