"""Publishes the node's labels, AcceleratorHealthy condition and events, on its own thread.

API calls can block for seconds; they must not hold up kubelet's device plugin or the health
stream, so this loop runs apart from the supervisor. It wakes on every change of the device
state (inventory, health, cordon) and at least every second, writes only what changed, and
rewrites everything every `node.resync_seconds`. A failed write is logged, counted and retried
on the next wake with backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

import structlog

from edl_agent.config import Settings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.tracker import Condition
from edl_agent.kube import ApiError, KubeApi
from edl_agent.labels.compute import node_labels
from edl_agent.labels.condition import accelerator_health
from edl_agent.labels.cordon import Cordon
from edl_agent.labels.node import NodeUpdater
from edl_agent.labels.watching import NodeWatcher
from edl_agent.plugin.state import DeviceState

WAKE_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0


class NodePublisher:
    def __init__(
        self,
        *,
        api: KubeApi | None,
        settings: Settings,
        state: DeviceState,
        root: HostRoot,
        unhealthy: Callable[[], Mapping[str, Condition]],
        on_cordon: Callable[[Cordon], None],
    ) -> None:
        self._settings = settings
        self._state = state
        self._unhealthy = unhealthy
        self._on_cordon = on_cordon
        node = state.snapshot().inventory.node
        self.updater = NodeUpdater(api=api, node_name=node, settings=settings.node)
        self.watcher = NodeWatcher(api, node, self.updater.observe) if api is not None else None
        self._machine = root.read_optional("/sys/class/dmi/id/product_name")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0
        self._log = structlog.get_logger().bind(part="node-publisher", node=node)

    def start(self) -> None:
        if self.watcher is not None:
            self.watcher.start()
        self._thread = threading.Thread(target=self._run, name="node-publisher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._state.wake()
        if self.watcher is not None:
            self.watcher.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        version = 0
        next_resync = 0.0
        backoff = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            force = now >= next_resync
            try:
                version = self.publish(force=force)
            except ApiError as exc:
                self.failures += 1
                backoff = min(max(backoff * 2, 1.0), MAX_BACKOFF_SECONDS)
                self._log.warning("node update failed", error=str(exc), retry_in=backoff)
                self._stop.wait(backoff)
                continue
            except Exception:  # a bug here must not end the loop for good
                self.failures += 1
                backoff = min(max(backoff * 2, 1.0), MAX_BACKOFF_SECONDS)
                self._log.exception("node publisher failed", retry_in=backoff)
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            if force:
                next_resync = now + self._settings.node.resync_seconds
            self._state.wait_newer(version, WAKE_SECONDS, self._stop)

    def publish(self, *, force: bool = False) -> int:
        """Compute and write once; returns the state version it published."""
        snapshot = self._state.snapshot()
        inventory = snapshot.inventory
        cordon = self.updater.cordoned(inventory.devices)
        self._on_cordon(cordon)
        unhealthy = self._unhealthy()
        labels = node_labels(
            inventory=inventory,
            unhealthy=unhealthy,
            settings=self._settings,
            machine=self._machine,
            cordoned=cordon.device_ids,
        )
        health = accelerator_health(inventory=inventory, unhealthy=unhealthy)
        self.updater.sync(labels=labels, health=health, now=datetime.now(UTC), force=force)
        return snapshot.version
