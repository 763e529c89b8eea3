"""Wakes the agent when kubelet's device-plugin directory changes (Linux inotify, through
inotify_simple).

Kubelet announces a restart only by deleting every socket in that directory and creating a new
`kubelet.sock`; without a watch the agent notices at its next tick. The watch only says "look
now": what changed is still worked out by `PluginManager.sync`, so a missed or coalesced event
costs at most one tick, never correctness. Where inotify is unavailable the tick alone serves.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from pathlib import Path

import structlog
from inotify_simple import INotify, flags

log = structlog.get_logger()

WATCHED = (
    flags.CREATE
    | flags.DELETE
    | flags.MOVED_FROM
    | flags.MOVED_TO
    | flags.DELETE_SELF
    | flags.MOVE_SELF
    | flags.ONLYDIR
)
GONE = flags.DELETE_SELF | flags.MOVE_SELF
# The directory itself may be removed and made again (by our own sync): watch it anew then.
REWATCH_SECONDS = 1.0


class DirectoryWatch:
    """Calls `on_change` (from its own thread) after entries of `directory` are created, deleted
    or renamed; bursts are coalesced by the reader, not counted."""

    def __init__(self, directory: Path, on_change: Callable[[], None]) -> None:
        self.directory = directory
        self._on_change = on_change
        self._inotify: INotify | None = None
        self._watching = False
        self._stop_read, self._stop_write = -1, -1
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Start watching; False (and a debug line) where inotify cannot be used."""
        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:
            log.debug("no inotify: kubelet restarts are noticed at the next tick", error=str(exc))
            return False
        self._stop_read, self._stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._add_watch()
        self._thread = threading.Thread(target=self._run, name="kubelet-dir-watch", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        if self._thread is None:
            return
        os.write(self._stop_write, b"x")
        self._thread.join(timeout=5)
        self._thread = None
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        for fd in (self._stop_read, self._stop_write):
            os.close(fd)
        self._stop_read = self._stop_write = -1

    def _add_watch(self) -> bool:
        if self._inotify is None:
            return False
        try:
            self._inotify.add_watch(self.directory, WATCHED)
        except FileNotFoundError:
            self._watching = False
            return False
        except OSError as exc:
            log.debug("cannot watch the kubelet directory", error=str(exc))
            self._watching = False
            return False
        self._watching = True
        return True

    def _run(self) -> None:
        assert self._inotify is not None  # noqa: S101 - started only after it was made
        fd = self._inotify.fileno()
        while True:
            timeout = None if self._watching else REWATCH_SECONDS
            readable, _, _ = select.select([fd, self._stop_read], [], [], timeout)
            if self._stop_read in readable:
                return
            if fd in readable and self._drain():
                self._watching = False  # the directory went away; its watch with it
            if not self._watching and self._add_watch():
                self._notify()  # made again: whatever is in it now is news

    def _drain(self) -> bool:
        """Reads every pending event; True when the directory itself was removed or moved."""
        assert self._inotify is not None  # noqa: S101
        events = []
        while batch := self._inotify.read(timeout=0):
            events.extend(batch)
        if events:
            self._notify()
        return any(event.mask & GONE for event in events)

    def _notify(self) -> None:
        try:
            self._on_change()
        except Exception:  # the watch must outlive a failing callback
            log.exception("kubelet directory watch callback failed")
