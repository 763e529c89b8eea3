"""Hygon DCU events through DTK's rocm_smi event API (rsmi_event_notification_*), beside the
polled health of `hygon_library`: what a poll cannot see because it is over by the next round.

`RocmSmiWatcher` is a supervised part: it starts event collection on every DCU the library lists
and waits in rsmi_event_notification_get (which releases the GIL) with a short timeout so that
the stop is noticed. Each event becomes one `HealthEvent` handed to `on_event`:

- thermal throttling: `DCU_THERMAL_THROTTLE`, WARN, counted only (the device stays usable);
- a VM page fault: `DCU_VM_FAULT`, IGNORE (an application's bad address, as NVIDIA's XID 31);
- a reset starting: `DCU_RESET`, WARN, lasting until the reset is reported done (that event
  arrives as the same reason, `cleared`);
- an event kind this module does not know: `DCU_EVENT_<n>`, WARN, counted only;
- the event API itself failing (library missing, init, registration or wait failing):
  `ROCM_SMI_EVENTS_FAILED`, `device_id` None, WARN (the polls still read the DCUs), once while it
  lasts; the failure ends the part, which the supervisor runs again after its backoff; it is
  reported `cleared` once a wait succeeds again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from edl_agent.devices import hygon, rocm_smi
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.event_watch import EventsFailure, EventWatcher
from edl_agent.health.model import ClearsBy, HealthEvent, Level

EVENTS_FAILED = "ROCM_SMI_EVENTS_FAILED"
RESET = "DCU_RESET"
KINDS: dict[int, tuple[str, Level, ClearsBy]] = {
    rocm_smi.EVT_VMFAULT: ("DCU_VM_FAULT", Level.IGNORE, ClearsBy.NOTHING),
    rocm_smi.EVT_THERMAL_THROTTLE: ("DCU_THERMAL_THROTTLE", Level.WARN, ClearsBy.NOTHING),
    rocm_smi.EVT_GPU_PRE_RESET: (RESET, Level.WARN, ClearsBy.CONDITION),
}
WANTED = rocm_smi.event_mask(*KINDS, rocm_smi.EVT_GPU_POST_RESET)


class RocmSmiWatcher(EventWatcher):
    """Turns rocm_smi events of the DCUs under `root` into HealthEvents: a supervised part,
    ready while its wait loop runs."""

    name = "rocm-smi-watch"
    vendor = Vendor.HYGON
    failed_reason = EVENTS_FAILED
    known_errors = (rocm_smi.RsmiError,)

    def __init__(
        self,
        root: HostRoot,
        on_event: Callable[[HealthEvent], None],
        *,
        wait_ms: int = 1000,
    ) -> None:
        super().__init__(root, on_event)
        self.wait_ms = wait_ms

    def _session(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        path = rocm_smi.find_library(self.root)
        if path is None:
            msg = f"{rocm_smi.LIBRARY} not found under the host root"
            raise EventsFailure(msg)
        library = rocm_smi.open_library(path)
        bus_ids = library.bus_ids()
        started: list[int] = []
        try:
            for index in sorted(bus_ids):
                library.events_start(index, WANTED)
                started.append(index)
            while not stop.is_set():
                events = library.events_wait(self.wait_ms)
                self._running(ready, "rocm_smi event loop running", devices=len(started))
                for event in events:
                    self._handle(event, bus_ids)
        finally:
            for index in started:
                library.events_stop(index)

    def _handle(self, event: rocm_smi.DcuEvent, bus_ids: dict[int, str]) -> None:
        bus_id = bus_ids.get(event.index)
        device = hygon.device_id(bus_id) if bus_id is not None else None
        detail = event.message or f"rocm_smi event {event.kind}"
        if device is None:
            detail = f"DCU index {event.index}: {detail}"
        if event.kind == rocm_smi.EVT_GPU_POST_RESET:
            reason, level, clears_by, cleared = RESET, Level.WARN, ClearsBy.CONDITION, True
        else:
            default = (f"DCU_EVENT_{event.kind}", Level.WARN, ClearsBy.NOTHING)
            (reason, level, clears_by), cleared = KINDS.get(event.kind, default), False
        self._emit(
            HealthEvent(
                vendor=Vendor.HYGON,
                device_id=device,
                reason=reason,
                level=level,
                at=time.monotonic(),
                detail=detail,
                code=event.kind,
                cleared=cleared,
                clears_by=clears_by,
            )
        )
