"""The `presence` part: device-node presence, checked when a device directory changes.

A device whose /dev nodes vanish cannot be given to a container (`InventoryWatch.check_presence`
makes it NODE_VANISHED). The directories holding the node's device nodes (/dev, /dev/dri, ...)
are watched with inotify (`DirectoryWatch`, owned and stopped by this part), so a node that
vanishes or comes back is checked at once; between changes the check runs every
`backstop_seconds` (60 s) in case a change went unseen. Where a directory cannot be watched,
the check runs every `poll_seconds` (`plugin.health_poll_seconds`, 1 s by default) instead: then
the round is the only way to see a device node go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from edl_agent.runtime.dirwatch import DirectoryWatch

BACKSTOP_SECONDS = 60.0


class PresenceRound:
    name = "presence"

    def __init__(
        self,
        *,
        check: Callable[[], None],
        directories: Callable[[], Iterable[Path]],
        wake: threading.Event,
        poll_seconds: Callable[[], float],
        backstop_seconds: float = BACKSTOP_SECONDS,
    ) -> None:
        self._check = check
        self._directories = directories
        self.wake = wake
        self._poll_seconds = poll_seconds
        self.backstop_seconds = backstop_seconds
        self.watched = False

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        watched: dict[Path, DirectoryWatch] = {}
        try:
            while not stop.is_set():
                self._watch(watched)
                self._check()
                ready()
                self.wake.wait(self.next_wait())
                self.wake.clear()
        finally:
            for watch in watched.values():
                watch.stop()
            self.watched = False

    def next_wait(self) -> float:
        return self.backstop_seconds if self.watched else self._poll_seconds()

    def _watch(self, watched: dict[Path, DirectoryWatch]) -> None:
        """Watch the directories of the current inventory's device nodes (it may have grown)."""
        wanted = set(self._directories())
        for directory in set(watched) - wanted:
            watched.pop(directory).stop()
        ok = True
        for directory in sorted(wanted - set(watched)):
            watch = DirectoryWatch(directory, self.wake.set)
            if watch.start():
                watched[directory] = watch
            else:
                ok = False
        self.watched = ok and all(watch.active for watch in watched.values())
