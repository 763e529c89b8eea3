"""Publishes the node's labels, AcceleratorHealthy condition and events: a supervised part.

API calls can block for seconds; they must not hold up kubelet's device plugin or the health
stream, so this loop is a part of its own, and the watch of the Node (`watching.NodeWatcher`)
another (`parts()` hands both to the supervisor). It recomputes when an
input changes and only then: the device state (inventory, health), what the health hub shows
(reasons, failing monitors: `poke_event`, set through the hub's subscription), whether the state
directory refuses writes (`poke_event` again, set by the agent when that starts or ends), the
Node as the watcher sees it (cordon and release annotations), an event to announce. It writes
only what changed, and rewrites everything every `node.resync_seconds`. A failed API call is
logged, counted and retried with backoff; anything else ends the part, which the supervisor runs
again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import structlog

from edl_agent.config import Settings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.state import DeviceState
from edl_agent.health.tracker import Condition
from edl_agent.kube import ApiError, NodeApi
from edl_agent.labels.compute import node_labels
from edl_agent.labels.condition import Unsaved, accelerator_health
from edl_agent.labels.cordon import Cordon
from edl_agent.labels.events import EventSpec
from edl_agent.labels.node import NodeUpdater
from edl_agent.labels.watching import NodeWatcher
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.supervisor import Part, on_stop

MAX_BACKOFF_SECONDS = 30.0


class StatePoke(threading.Event):
    """Set when an input other than the device state changed: also wakes the wait on it."""

    def __init__(self, state: DeviceState) -> None:
        super().__init__()
        self._state = state

    def set(self) -> None:
        super().set()
        self._state.wake()


class NodePublisher:
    name = "node-publisher"

    def __init__(
        self,
        *,
        api: NodeApi | None,
        settings: Settings,
        state: DeviceState,
        root: HostRoot,
        unhealthy: Callable[[], Mapping[str, Condition]],
        on_cordon: Callable[[Cordon], None],
        on_release: Callable[[Cordon], None] = lambda _: None,
        monitors: Callable[[], Mapping[Vendor, Condition]] = dict,
        unsaved: Callable[[], Unsaved] = Unsaved,
        degraded: Callable[[], Mapping[str, Condition]] = dict,
    ) -> None:
        self._settings = settings
        self._state = state
        self._unhealthy = unhealthy
        self._on_cordon = on_cordon
        self._on_release = on_release
        self._released: str | None = None
        self._announced: list[EventSpec] = []
        self._announce_lock = threading.Lock()
        self._monitors = monitors
        self._unsaved = unsaved
        self._degraded = degraded
        self.poke_event: threading.Event = StatePoke(state)
        node = state.snapshot().inventory.node
        self.updater = NodeUpdater(api=api, node_name=node, settings=settings.node)
        self.watcher = NodeWatcher(api, node, self._observed) if api is not None else None
        self._machine = root.read_optional("/sys/class/dmi/id/product_name")
        self.failures = 0
        self._log = structlog.get_logger().bind(part="node-publisher", node=node)

    def parts(self) -> list[Part]:
        """What the supervisor runs: this loop, ready once it published, and the Node's watch
        (when there is an API client), ready at once."""
        return [self] if self.watcher is None else [self, self.watcher]

    def announce(self, event: EventSpec) -> None:
        """An event for the Node that no health change implies (a reset by the agent, an
        operator's release), sent with the next write (any thread)."""
        with self._announce_lock:
            self._announced.append(event)
        self.poke_event.set()

    def _observed(self, node: Mapping[str, Any]) -> None:
        self.updater.observe(node)
        self.poke_event.set()  # its annotations may cordon or release devices

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Publish until `stop` (a `StopSignal`: it ends the wait for the next change)."""
        forget = on_stop(stop, self.poke_event.set)
        try:
            self._keep_publishing(stop, ready)
        finally:
            forget()

    def _keep_publishing(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        version = 0
        next_resync = 0.0
        backoff = Backoff(initial=2.0, maximum=MAX_BACKOFF_SECONDS)
        while not stop.is_set():
            now = time.monotonic()
            force = now >= next_resync
            self.poke_event.clear()  # a poke while publishing comes round again
            try:
                version = self.publish(force=force)
            except ApiError as exc:
                self.failures += 1
                delay = backoff.next_delay()
                self._log.warning("node update failed", error=str(exc), retry_in=round(delay, 2))
                stop.wait(delay)
                continue
            ready()
            backoff.reset()
            if force:
                next_resync = now + self._settings.node.resync_seconds
            if stop.is_set():
                break
            wait = max(0.0, next_resync - time.monotonic())
            self._state.wait_newer(version, wait, self.poke_event)

    def publish(self, *, force: bool = False) -> int:
        """Compute and write once; returns the state version it published."""
        snapshot = self._state.snapshot()
        inventory = snapshot.inventory
        cordon = self.updater.cordoned(inventory.devices)
        self._on_cordon(cordon)
        release = self.updater.released(inventory.devices)
        # Once per value: an annotation the agent could not remove must not go on releasing
        # every new fault.
        if release is not None and release.value != self._released:
            self._on_release(release.devices)
            self._released = release.value
            if self.updater.forget_release(release.value):
                self._log.info("release done, annotation removed", value=release.value)
        elif release is None:
            self._released = None
        unhealthy = self._unhealthy()
        degraded = self._degraded()
        labels = node_labels(
            inventory=inventory,
            unhealthy=unhealthy,
            settings=self._settings,
            machine=self._machine,
            cordoned=cordon.device_ids,
            degraded=degraded,
        )
        health = accelerator_health(
            inventory=inventory,
            unhealthy=unhealthy,
            monitors=self._monitors(),
            unsaved=self._unsaved(),
            degraded=degraded,
        )
        with self._announce_lock:
            announced, self._announced = self._announced, []
        self.updater.sync(
            labels=labels, health=health, now=datetime.now(UTC), force=force, announced=announced
        )
        return snapshot.version
