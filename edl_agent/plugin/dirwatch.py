"""Wakes the agent when kubelet's device-plugin directory changes (Linux inotify).

Kubelet announces a restart only by deleting every socket in that directory and creating a new
`kubelet.sock`; without a watch the agent notices at its next tick. The watch only says "look
now": what changed is still worked out by `PluginManager.sync`, so a missed or coalesced event
costs at most one tick, never correctness. Where inotify is unavailable the tick alone serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger()

IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_ONLYDIR = 0x01000000
WATCHED = (
    IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
)
# The directory itself may be removed and made again (by our own sync): watch it anew then.
REWATCH_SECONDS = 1.0
READ_BYTES = 64 * 1024
EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name


class DirectoryWatch:
    """Calls `on_change` (from its own thread) after entries of `directory` are created, deleted
    or renamed; bursts are coalesced by the reader, not counted."""

    def __init__(self, directory: Path, on_change: Callable[[], None]) -> None:
        self.directory = directory
        self._on_change = on_change
        self._libc: ctypes.CDLL | None = None
        self._fd = -1
        self._watch = -1
        self._stop_read, self._stop_write = -1, -1
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def start(self) -> bool:
        """Start watching; False (and a debug line) where inotify cannot be used."""
        try:
            self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError) as exc:
            log.debug("no inotify: kubelet restarts are noticed at the next tick", error=str(exc))
            return False
        if fd < 0:
            log.debug(
                "no inotify: kubelet restarts are noticed at the next tick",
                error=os.strerror(ctypes.get_errno()),
            )
            return False
        self._fd = fd
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
        for fd in (self._fd, self._stop_read, self._stop_write):
            os.close(fd)
        self._fd = self._stop_read = self._stop_write = -1

    def _add_watch(self) -> bool:
        if self._libc is None:
            return False
        self._watch = self._libc.inotify_add_watch(self._fd, os.fsencode(self.directory), WATCHED)
        if self._watch < 0:
            code = ctypes.get_errno()
            if code != errno.ENOENT:
                log.debug("cannot watch the kubelet directory", error=os.strerror(code))
            return False
        return True

    def _run(self) -> None:
        while True:
            timeout = None if self._watch >= 0 else REWATCH_SECONDS
            readable, _, _ = select.select([self._fd, self._stop_read], [], [], timeout)
            if self._stop_read in readable:
                return
            if self._fd in readable and self._drain():
                self._watch = -1  # the directory went away; its watch with it
            if self._watch < 0 and self._add_watch():
                self._notify()  # made again: whatever is in it now is news

    def _drain(self) -> bool:
        """Reads every pending event; True when the directory itself was removed or moved."""
        gone = False
        changed = False
        while True:
            try:
                data = os.read(self._fd, READ_BYTES)
            except BlockingIOError:
                break
            changed = True
            offset = 0
            while offset + EVENT.size <= len(data):
                _, mask, _, length = EVENT.unpack_from(data, offset)
                gone = gone or bool(mask & (IN_DELETE_SELF | IN_MOVE_SELF))
                offset += EVENT.size + length
        if changed:
            self._notify()
        return gone

    def _notify(self) -> None:
        try:
            self._on_change()
        except Exception:  # the watch must outlive a failing callback
            log.exception("kubelet directory watch callback failed")
