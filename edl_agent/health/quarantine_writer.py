"""Writes the quarantine file on its own thread, so that no observer waits for a disk.

The health hub hands each new quarantine (an immutable `Quarantine`) to `offer` while it holds
its lock, which costs a field assignment; this part writes the latest one (temporary file, fsync,
rename, through `QuarantineStore.save`) and drops those that a newer one replaced before their
turn. A write that fails (a full or read-only disk) keeps the quarantine in memory, is counted,
and is tried again every `RETRY_SECONDS` and with every offer; it is logged when saving starts
to fail and when it works again, not at every try; `on_unsaved` hears each of those two turns.
Stopping writes what is still waiting;
`flush` writes it on the caller's thread (at start and at close).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from edl_agent.health.quarantine_store import Quarantine, QuarantineStore

RETRY_SECONDS = 10.0


class QuarantineWriter:
    """The `quarantine-writer` part: blocks on `wake` (set by `offer` and by the agent's stop)."""

    name = "quarantine-writer"

    def __init__(
        self,
        store: QuarantineStore,
        wake: threading.Event,
        on_unsaved: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self._on_unsaved = on_unsaved  # `unsaved` turned (any thread: the writer's, a flush's)
        self._wake = wake
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one write at a time, in the order offered
        self._latest: Quarantine | None = None
        self.failures = 0
        self.writes = 0
        self.unsaved = False  # the last write failed: the quarantine is only in memory
        self._log = structlog.get_logger().bind(part=self.name)

    def offer(self, quarantine: Quarantine) -> None:
        """Keep `quarantine` for the next write (any thread, cheap: callers hold locks)."""
        with self._lock:
            self._latest = quarantine
        self._wake.set()

    def flush(self) -> None:
        """Write what waits now, on the caller's thread."""
        with self._write_lock:
            with self._lock:
                quarantine, self._latest = self._latest, None
            if quarantine is None:
                return
            try:
                self.store.save(quarantine)
            except OSError as exc:
                self.failures += 1
                with self._lock:
                    if self._latest is None:  # kept for the next try, unless a newer one came
                        self._latest = quarantine
                if not self.unsaved:
                    self._log.error(
                        "quarantine not saved: kept in memory, tried again",
                        error=str(exc),
                        retry_seconds=RETRY_SECONDS,
                    )
                    self.unsaved = True
                    self._on_unsaved()
                return
            self.writes += 1
            if self.unsaved:
                self._log.info("quarantine saved again", failures=self.failures)
                self.unsaved = False
                self._on_unsaved()

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        while True:
            # No timeout while saved: nothing to do until an offer (or the stop) comes.
            self._wake.wait(RETRY_SECONDS if self.unsaved else None)
            self._wake.clear()
            self.flush()
            if stop.is_set():
                self.flush()  # what was offered while the last write ran
                return
