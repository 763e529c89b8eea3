"""A vendor read through its management library where the node has one that answers, else that
round through its tool (`hygon_library`, `ascend_library`): the poller the agent runs for it.
Which source is in use is logged whenever it changes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from edl_agent.config import HealthSettings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Vendor
from edl_agent.health.vendor_readings import Clock, Poller, PollResult


@dataclass
class LibraryFirst:
    """`library` where `find` finds the library under the host root and its poll works (`ok`),
    else `tool`; `library_source` and `tool_source` name them in the log."""

    vendor: Vendor
    find: Callable[[HostRoot], str | None]
    library: Poller
    tool: Poller
    library_source: str
    tool_source: str
    _sources: dict[Path, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(
        self,
        root: HostRoot,
        devices: Sequence[Device],
        settings: HealthSettings,
        *,
        clock: Clock = time.monotonic,
    ) -> PollResult:
        if self.find(root) is not None:
            result = self.library(root, devices, settings, clock=clock)
            if result.ok:
                self._source(root, self.library_source)
                return result
            self._source(root, self.tool_source, result.events[0].detail)
        else:
            self._source(root, self.tool_source)
        return self.tool(root, devices, settings, clock=clock)

    def _source(self, root: HostRoot, source: str, why: str = "") -> None:
        with self._lock:
            if self._sources.get(root.root) == source:
                return
            self._sources[root.root] = source
        log = structlog.get_logger().bind(vendor=self.vendor.value)
        if source == self.library_source:
            log.info(f"{self.vendor.value} health read through the library", source=source)
        else:
            log.info(
                f"{self.vendor.value} health read through the tool",
                source=source,
                library_error=why or None,
            )
