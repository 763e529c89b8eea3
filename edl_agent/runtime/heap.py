"""Gives the C heap's free memory back to the system, every few seconds, on a thread of its own.

glibc's malloc keeps what a process freed for later allocations: after a storm of connections
that grpc core allocated for and freed, the restarter's RSS stayed three to four times its size
before (bench/intake_storm.py: 68 MiB before, 204 / 232 / 266 MiB after three storms of 3,000
silent connections). That memory is free, only not returned: `malloc_trim(0)` returns it
(84 / 85 / 87 MiB after the same storms). `MALLOC_ARENA_MAX` does not: the free chunks lie in
the middle of the heaps, below what glibc's own trimming of a heap's top reaches.

A trim walks the free chunks of every arena (milliseconds on a heap of hundreds of MiB) and
costs nothing where nothing was freed. Where the C library has no `malloc_trim` (musl), nothing
is trimmed and `HeapTrimmer` starts no thread.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

DEFAULT_INTERVAL_SECONDS = 10.0


def libc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """Trims the C heap every `interval` seconds from `start` until `stop`."""

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self.interval = interval
        self._trim = trim if trim is not None else libc_trim()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def start(self) -> None:
        trim = self._trim
        if trim is None or self.interval <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(trim,), name="heap-trim", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self, trim: Callable[[], object]) -> None:
        while not self._stop.wait(self.interval):
            try:
                trim()
            except Exception:  # never fatal: the memory stays where it was
                log.exception("heap trim failed; no more tried")
                return
            self.trims += 1
