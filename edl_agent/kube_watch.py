"""A Kubernetes watch kept alive on its own thread: the loop the agent's watchers share.

The watch is started again whenever the server ends it, from scratch after 410 Gone, and after
a retry delay on any other failure; a failure is logged and counted, never the end of the
watching. `stop()` unblocks the read the thread waits in, so it returns at once.
Subclasses say how to list (optional) and how to watch from a resourceVersion.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import structlog

from edl_agent.kube import GONE, ApiError, Closable
from edl_agent.runtime.ending import EndNotice

# A server or proxy that ends watches at once must not make the loop spin.
MIN_WATCH_SECONDS = 1.0


class WatchLoop:
    name = "watch"
    # Whether a crash (a bug, not an API error) starts over from a fresh list.
    restart_after_crash = False

    def __init__(self, *, log_context: dict[str, str]) -> None:
        self.failures = 0
        self.relists = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Closable | None = None
        self._ends = EndNotice()
        self._log = structlog.get_logger().bind(part=self.name, **log_context)

    def start(self) -> None:
        if self._thread is not None:
            msg = f"{type(self).__name__} already started"
            raise RuntimeError(msg)
        self._thread = self._ends.thread(self._run, self.name)
        self._thread.start()

    def notify_on_end(self, callback: Callable[[], None] | None) -> None:
        """Call `callback()` when the thread ends (a supervisor's `Watched` waits for it);
        None forgets it."""
        self._ends.notify_on_end(callback)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def restart(self) -> None:
        """Start a new thread after this one died (the supervisor's call)."""
        self._thread = None
        self.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            _shutdown(response)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._log.warning("watcher did not stop in time", timeout=timeout)

    def _opened(self, response: Closable) -> None:
        """Given to the API call: the open stream, so that `stop()` can end it."""
        self._response = response
        if self._stop.is_set():
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

    def _run(self) -> None:
        version: str | None = None
        failures_in_row = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                failures_in_row = 0
                if time.monotonic() - started < MIN_WATCH_SECONDS:
                    self._stop.wait(MIN_WATCH_SECONDS)
            except ApiError as exc:
                if self._stop.is_set():
                    return
                if exc.status == GONE:
                    self.relists += 1
                    version = None  # too old: start over
                    continue
                failures_in_row += 1
                self._failed(str(exc), failures_in_row)
            except Exception as exc:  # a bug must not end the watching: retry like a failure
                if self._stop.is_set():
                    return
                self._log.exception("watcher crashed")
                failures_in_row += 1
                if self.restart_after_crash:
                    version = None
                self._failed(f"{type(exc).__name__}: {exc}", failures_in_row)

    def _failed(self, error: str, failures_in_row: int) -> None:
        self.failures += 1
        self._log.warning("watch failed; retrying", error=error, failures=self.failures)
        self._stop.wait(self._retry_delay(failures_in_row))


def _shutdown(response: Closable) -> None:
    """Unblock the read the watch thread waits in (urllib3 >= 2.3; else close the response).
    The last watch may be over already, its connection back in the pool: urllib3 then refuses
    (RuntimeError), and there is nothing left to unblock."""
    shutdown = getattr(response, "shutdown", None) or getattr(response, "close", None)
    if shutdown is not None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            shutdown()
