"""The frame of a vendor library's event watcher (`rocm_smi_watch`, `dcmi_watch`): a supervised
part that runs one session of the library's event API until the stop, reports the API failing as
one vendor-level WARN event while it lasts (the polls still read the devices), ends so that the
supervisor runs it again after its backoff, and reports the failure `cleared` once a session
runs again. A subclass gives the session and names its vendor, part and failure reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import structlog

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health.model import HealthEvent, Level


class EventsFailure(Exception):
    """The event API cannot be used; the message is the health event's detail."""


class EventWatcher:
    """A vendor's events of the devices under `root`, handed to `on_event` as HealthEvents;
    ready while a session runs."""

    name: str
    vendor: ClassVar[Vendor]
    failed_reason: ClassVar[str]  # the vendor-level event while the API fails
    # The library's own errors: their message is the failure's detail as it is.
    known_errors: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(self, root: HostRoot, on_event: Callable[[HealthEvent], None]) -> None:
        self.root = root
        self.on_event = on_event
        self._ready = False
        self._failing = False
        self._log = structlog.get_logger().bind(vendor=self.vendor.value, part=self.name)

    @property
    def ready(self) -> bool:
        return self._ready

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """One session until `stop`. A failure is reported (once while it lasts) and raised:
        the supervisor runs the watcher again after its backoff."""
        expected: tuple[type[Exception], ...] = (EventsFailure, OSError, *self.known_errors)
        try:
            self._session(stop, ready)
        except expected as exc:
            self._failed(str(exc))
            raise
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._ready = False

    def _session(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        raise NotImplementedError

    def _running(self, ready: Callable[[], None], message: str, **facts: Any) -> None:
        """The session is delivering events (once per session: later calls do nothing)."""
        if self._ready:
            return
        self._ready = True
        ready()
        self._log.info(message, **facts)
        if self._failing:
            self._failing = False
            self._emit(self._failure(f"{message} again", cleared=True))

    def _failed(self, detail: str) -> None:
        if not self._failing:
            self._failing = True
            self._emit(self._failure(" ".join(detail.split()), cleared=False))

    def _failure(self, detail: str, *, cleared: bool) -> HealthEvent:
        return HealthEvent(
            vendor=self.vendor,
            device_id=None,
            reason=self.failed_reason,
            level=Level.WARN,
            at=time.monotonic(),
            detail=detail,
            cleared=cleared,
        )

    def _emit(self, event: HealthEvent) -> None:
        try:
            self.on_event(event)
        except Exception:
            self._log.exception("health event handler failed", reason=event.reason)
