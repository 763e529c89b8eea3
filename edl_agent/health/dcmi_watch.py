"""Ascend NPU fault events through DCMI's subscription (dcmi_subscribe_fault_event), beside the
polled health of `ascend_library`: a fault reaches the hub when the driver raises it, not at the
next poll.

`DcmiWatcher` is a supervised part. It subscribes to every chip's events once per process (the
library calls back from a thread of its own for as long as the process lives, so the
subscription outlives a stopped watcher and a watcher started again reads the same queue) and
waits on the queue with a short timeout so that the stop is noticed. Each event becomes one
`HealthEvent` handed to `on_event`, worded as the poll words the same code:

- raised (assertion 1) or one-off (2): `NPU_FAULT_<code>` at the code's level in the fault-code
  table (`health.ascend_code_levels` overrides it), the event's severity deciding for a code the
  table does not know; a code the table says needs nothing is not reported;
- recovered (0): the same reason, `cleared` (what a cleared condition ends is the catalog's
  choice: a code that waits for a reset or an operator is not ended by it);
- an event for a chip the library does not map to a /dev/davinci<N> keeps `device_id` None;
- the subscription failing (library missing, init or subscription refused): `DCMI_EVENTS_FAILED`,
  `device_id` None, WARN (the polls still read the chips), once while it lasts; the failure ends
  the part, which the supervisor runs again after its backoff; it is reported `cleared` once the
  subscription works again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from edl_agent.config import HealthSettings
from edl_agent.devices import ascend, dcmi
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.event_watch import EventsFailure, EventWatcher
from edl_agent.health.model import HealthEvent, Level
from edl_agent.health.vendor_readings import npu_finding

EVENTS_FAILED = "DCMI_EVENTS_FAILED"
# An event's severity (0 warning, 1 minor, 2 major, 3 critical) as the health word of a chip
# with that alarm, for the codes the table does not know.
SEVERITY_WORDS = {0: "Warning", 1: "Warning", 2: "Alarm", 3: "Critical"}


class DcmiWatcher(EventWatcher):
    """Turns DCMI fault events of the NPUs under `root` into HealthEvents: a supervised part,
    ready while its wait loop runs."""

    name = "dcmi-watch"
    vendor = Vendor.ASCEND
    failed_reason = EVENTS_FAILED
    known_errors = (dcmi.DcmiError,)

    def __init__(
        self,
        root: HostRoot,
        on_event: Callable[[HealthEvent], None],
        settings: Callable[[], HealthSettings],
        *,
        wait_seconds: float = 1.0,
    ) -> None:
        super().__init__(root, on_event)
        self.settings = settings
        self.wait_seconds = wait_seconds

    def _session(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        path = dcmi.find_library(self.root)
        if path is None:
            msg = f"{dcmi.LIBRARY} not found under the host root"
            raise EventsFailure(msg)
        library = dcmi.open_library(path)
        phy_ids = library.phy_ids()
        events = library.subscribe()
        self._running(ready, "dcmi fault events subscribed", chips=len(phy_ids))
        while not stop.is_set():
            try:
                event = events.get(timeout=self.wait_seconds)
            except queue.Empty:
                continue
            if event.logic_id not in phy_ids:  # a chip that came after the last listing
                phy_ids = library.phy_ids()
            self._handle(event, phy_ids.get(event.logic_id))

    def _handle(self, event: dcmi.FaultEvent, phy_id: int | None) -> None:
        word = SEVERITY_WORDS.get(event.severity, "Critical")
        note = f": {event.name}" if event.name else ""
        finding = npu_finding(word, (event.event_id,), note, self.settings())
        if finding is None or finding.level is Level.IGNORE:
            return
        detail = finding.detail
        if phy_id is None:
            detail = f"logic id {event.logic_id}: {detail}"
        self._emit(
            HealthEvent(
                vendor=Vendor.ASCEND,
                device_id=ascend.device_id(phy_id) if phy_id is not None else None,
                reason=finding.reason,
                level=finding.level,
                at=time.monotonic(),
                detail=detail,
                code=finding.code,
                cleared=event.assertion == dcmi.ASSERT_RECOVERED,
            )
        )
