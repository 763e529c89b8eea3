"""Threads that say when they end, so that a supervisor's `Watched` waits to be told instead of
looking every half second (an idle node then wakes for nothing)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class EndNotice:
    """Makes an owner's threads and calls its `notify_on_end` callback as the newest one ends.

    The owner creates each thread with `thread(...)` and offers `notify_on_end` (the method the
    supervisor looks for). The thread marks its end before it reads the callback and
    `notify_on_end` reads the mark after storing the callback: one of the two sees the other."""

    def __init__(self) -> None:
        self._callback: Callable[[], None] | None = None
        self._newest: threading.Event | None = None

    def thread(self, target: Callable[[], object], name: str) -> threading.Thread:
        """A daemon thread (not started) running `target`, then telling of its end."""
        ended = threading.Event()
        self._newest = ended

        def run() -> None:
            try:
                target()
            finally:
                ended.set()
                callback = self._callback
                if callback is not None and ended is self._newest:
                    callback()

        return threading.Thread(target=run, name=name, daemon=True)

    def notify_on_end(self, callback: Callable[[], None] | None) -> None:
        """Call `callback()` when the newest thread ends (at once when it has); None forgets."""
        self._callback = callback
        newest = self._newest
        if callback is not None and newest is not None and newest.is_set():
            callback()
