"""The `plugins` part: keeps a device-plugin server per resource serving and registered with
kubelet (`PluginManager.sync`), round after round.

A round comes at once when kubelet's device-plugin directory changes (a kubelet restart deletes
every socket there and makes a new `kubelet.sock`; a socket of ours removed is a change there too:
`DirectoryWatch`, owned and stopped by this part) or when the inventory changes (`wake`).
Otherwise it sleeps until one of those: nothing else needs it then. It comes every `tick_seconds`
(0.25 s) only while something is under way: a registration that kubelet has not accepted yet (its
retries are due on the round), or while kubelet's directory cannot be watched (the round is then
the only way to see a restart). A round that failed is tried again after
`watched_tick_seconds` (5 s).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from edl_agent.plugin.manager import PluginManager
from edl_agent.runtime.dirwatch import DirectoryWatch

TICK_SECONDS = 0.25
WATCHED_TICK_SECONDS = 5.0


class PluginRound:
    name = "plugins"

    def __init__(
        self,
        plugins: PluginManager,
        wake: threading.Event,
        *,
        guarded: Callable[[str, Callable[[], None]], None],
        tick_seconds: float = TICK_SECONDS,
        watched_tick_seconds: float = WATCHED_TICK_SECONDS,
    ) -> None:
        self.plugins = plugins
        self.wake = wake
        self._guarded = guarded
        self.tick_seconds = tick_seconds
        self.watched_tick_seconds = watched_tick_seconds
        self.watched = False
        self.failed = False  # the last round raised: tried again after watched_tick_seconds
        self.served = threading.Event()  # set once a round has served every resource

    def sync(self) -> None:
        self.failed = True
        self._guarded("plugins", self._sync)

    def _sync(self) -> None:
        self.plugins.sync()
        self.failed = False

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        watch = DirectoryWatch(self.plugins.directory, self.wake.set)
        self.watched = watch.start()
        try:
            while not stop.is_set():
                self.sync()
                self.served.set()
                ready()
                self.wake.wait(self.next_wait())
                self.wake.clear()
        finally:
            watch.stop()
            self.watched = False

    def next_wait(self) -> float | None:
        """Seconds until the next round; None: only when woken."""
        if not self.watched or self.plugins.registering:
            return self.tick_seconds
        return self.watched_tick_seconds if self.failed else None
