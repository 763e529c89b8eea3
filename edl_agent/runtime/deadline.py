"""A stop that cannot outlast its deadline.

Stopping cancels what it can, but some waits cannot be cut short: a read from an API server that
stopped answering, an NVML event wait, a vendor tool in the kernel. Once a stop is asked for,
`StopDeadline` gives the process `seconds` to end by itself and then ends it (`os._exit`), after
one log line naming what was still running. Nothing is lost by that: every record the processes
keep (the fault outbox, the quarantine, the DRA checkpoint, the policies' status) is written
durably when it changes, never at exit.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

STOP_DEADLINE_SECONDS = 4.5


class StopDeadline:
    def __init__(
        self,
        seconds: float = STOP_DEADLINE_SECONDS,
        *,
        on_expiry: Callable[[list[str]], None] = lambda _running: None,
        exit_code: int = 0,
    ) -> None:
        """`on_expiry(names of the threads still running)` is called (to log) before the exit."""
        self.seconds = seconds
        self._on_expiry = on_expiry
        self._exit_code = exit_code
        self._armed = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """The stop has begun: the deadline runs from now (a second call changes nothing).
        Safe from any thread; never blocks."""
        with self._lock:
            if self._thread is not None or self._done.is_set():
                return
            self._thread = threading.Thread(target=self._wait, name="stop-deadline", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        """The process is ending by itself: no forced exit."""
        self._done.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _wait(self) -> None:
        if self._done.wait(self.seconds):
            return
        running = sorted(
            t.name for t in threading.enumerate() if t is not threading.current_thread()
        )
        self._on_expiry(running)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self._exit_code)
