"""The node agent's supervisor: one loop that owns the periodic parts and keeps each alive.

Each step (plugin sync, device-node presence, re-discovery) runs guarded: an exception is logged
with its traceback, counted, and the step is tried again on a later tick — one broken part never
stops the others. The gRPC servers run in their own thread pools and never wait on this loop.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from edl_agent.config import Settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.presence import vanished
from edl_agent.plugin.manager import PluginManager
from edl_agent.plugin.state import DeviceState

TICK_SECONDS = 0.1


@dataclass
class _Schedule:
    interval: float
    due: float = 0.0

    def take(self, now: float) -> bool:
        if now < self.due:
            return False
        self.due = now + self.interval
        return True


@dataclass
class Agent:
    settings: Settings
    stop: threading.Event = field(default_factory=threading.Event)
    step_failures: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.root = HostRoot.at(self.settings.host_root)
        self._log = structlog.get_logger()
        self.state = DeviceState(discover_node(self.settings))
        self.plugins = PluginManager(
            settings=self.settings.plugin, state=self.state, root=self.root
        )
        self._presence = _Schedule(self.settings.plugin.health_poll_seconds)
        self._rediscovery = _Schedule(
            self.settings.plugin.rediscover_seconds,
            due=time.monotonic() + self.settings.plugin.rediscover_seconds,
        )
        self._ready = threading.Event()

    def run(self) -> None:
        """Run until `stop` is set; then stop the servers and remove our sockets."""
        self._log.info(
            "agent running",
            node=self.state.snapshot().inventory.node,
            kubelet_dir=str(self.plugins.directory),
            resources=self.plugins.resources or sorted(self.state.snapshot().resources),
        )
        try:
            while not self.stop.is_set():
                self.tick(time.monotonic())
                self._ready.set()
                self.stop.wait(TICK_SECONDS)
        finally:
            self.state.close()
            self.plugins.close()
            self._log.info("agent stopped")

    def wait_ready(self, timeout: float) -> bool:
        """True once the first tick has served every resource (for embedding and tests)."""
        return self._ready.wait(timeout)

    def tick(self, now: float) -> None:
        rediscover = False
        if self._presence.take(now):
            rediscover = self._guarded("presence", self._check_presence) or False
        if self._rediscovery.take(now) or rediscover:
            self._guarded("rediscovery", self._rediscover)
        self._guarded("plugins", self.plugins.sync)

    def _check_presence(self) -> bool:
        """Mark devices with missing /dev nodes unhealthy; True when that set changed."""
        snapshot = self.state.snapshot()
        missing = vanished(snapshot.inventory.devices, self.root.exists)
        if not self.state.set_unhealthy(missing):
            return False
        self._log.warning("device nodes changed", missing=sorted(missing) or None)
        return True

    def _rediscover(self) -> None:
        if self.state.set_inventory(discover_node(self.settings)):
            self._log.info("inventory changed")

    def _guarded(self, step: str, action: Callable[[], bool | None]) -> bool | None:
        try:
            return action()
        except Exception:
            self.step_failures[step] += 1
            self._log.exception("agent step failed", step=step, failures=self.step_failures[step])
            return None
