"""A Kubernetes watch kept alive: the loop the agent's and the restarter's watches share, run as
a supervised part (`run(stop, ready)`).

The watch is started again whenever the server ends it, from scratch after 410 Gone, and after
a retry delay on any other API failure; such a failure is logged and counted, never the end of
the watching. Anything else (a bug in a handler) ends `run`: the supervisor logs it and runs the
part again, from a fresh list. Setting the stop (a `StopSignal`) or calling `stop()` shuts the
open response, so the read the loop blocks in returns at once. Subclasses say how to list
(optional) and how to watch from a resourceVersion.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import structlog

from edl_agent.kube import GONE, ApiError, Closable
from edl_agent.runtime.supervisor import on_stop

# A server or proxy that ends watches at once must not make the loop spin.
MIN_WATCH_SECONDS = 1.0


class WatchLoop:
    name = "watch"

    def __init__(self, *, log_context: dict[str, str]) -> None:
        self.failures = 0
        self.relists = 0
        self._stopped = threading.Event()  # `stop()`: this watch alone, for good
        self._waits = self._stopped  # what the loop's waits end on: its run's stop, or `stop()`
        self._response: Closable | None = None
        self._log = structlog.get_logger().bind(part=self.name, **log_context)

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Watch until `stop` (a `StopSignal`) is set or `stop()` is called; `ready()` once the
        first list is done (at once for a watch that does not list)."""
        waits = threading.Event()
        forget = on_stop(stop, lambda: self._interrupt(waits))
        self._waits = waits
        if self._stopped.is_set():  # a `stop()` before `_waits` was set is seen here
            waits.set()
        try:
            self._keep_watching(waits, ready)
        except Exception:
            if waits.is_set():
                return  # a read cut short by the stop
            raise
        finally:
            forget()

    def stop(self) -> None:
        """End this watch for good, whoever runs it: its read is unblocked and `run` returns
        (the supervisor's stop does the same for every part)."""
        self._stopped.set()
        self._interrupt(self._waits)

    def _interrupt(self, waits: threading.Event) -> None:
        waits.set()
        response = self._response
        if response is not None:
            _shutdown(response)

    def _opened(self, response: Closable) -> None:
        """Given to the API call: the open stream, so that a stop can end it."""
        self._response = response
        if self._waits.is_set():
            _shutdown(response)

    def _list(self) -> str | None:
        """List before watching (whenever there is no version to watch from); the list's
        resourceVersion, or None to watch from now."""
        return None

    def _watch(self, version: str | None) -> str | None:
        """Watch from `version` until the server ends it; the last version seen."""
        raise NotImplementedError

    def _retry_delay(self, failures_in_row: int) -> float:
        raise NotImplementedError

    def _keep_watching(self, waits: threading.Event, ready: Callable[[], None]) -> None:
        version: str | None = None
        failures_in_row = 0
        while not waits.is_set():
            started = time.monotonic()
            try:
                if version is None:
                    version = self._list()
                    ready()
                version = self._watch(version)
                failures_in_row = 0
                if time.monotonic() - started < MIN_WATCH_SECONDS:
                    waits.wait(MIN_WATCH_SECONDS)
            except ApiError as exc:
                if waits.is_set():
                    return
                if exc.status == GONE:
                    self.relists += 1
                    version = None  # too old: start over
                    continue
                failures_in_row += 1
                self.failures += 1
                self._log.warning("watch failed; retrying", error=str(exc), failures=self.failures)
                waits.wait(self._retry_delay(failures_in_row))


def _shutdown(response: Closable) -> None:
    """Unblock the read the watch waits in (urllib3 >= 2.3; else close the response). The last
    watch may be over already, its connection back in the pool: urllib3 then refuses
    (RuntimeError), and there is nothing left to unblock."""
    shutdown = getattr(response, "shutdown", None) or getattr(response, "close", None)
    if shutdown is not None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            shutdown()
