"""The heap trim: what the C heap freed goes back to the system, on a thread that stops."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import pytest

from edl_agent.runtime.heap import HeapTrimmer, libc_trim

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    return int(Path("/proc/self/statm").read_text(encoding="ascii").split()[1]) * PAGE


def test_the_trimmer_trims_every_interval_and_its_thread_ends_with_stop() -> None:
    trimmed = threading.Event()
    trimmer = HeapTrimmer(0.01, trim=trimmed.set)
    trimmer.start()
    try:
        assert trimmed.wait(10)
    finally:
        trimmer.stop()
    assert not [t for t in threading.enumerate() if t.name == "heap-trim"]
    assert trimmer.trims >= 1
    HeapTrimmer(0, trim=trimmed.set).start()  # 0: never trims, starts no thread
    assert not [t for t in threading.enumerate() if t.name == "heap-trim"]


@pytest.mark.skipif(libc_trim() is None, reason="a C library without malloc_trim")
def test_a_trim_gives_back_what_a_fragmented_heap_keeps() -> None:
    """As after a connection storm: many small blocks freed but for a few that keep the heap's
    top in use, so glibc's own trimming of the top returns nothing."""
    trim = libc_trim()
    assert trim is not None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4000) for _ in range(20_000)]  # about 80 MB
    kept = blocks[63::64]
    try:
        for block in set(blocks) - set(kept):
            libc.free(block)
        freed = rss()
        trim()
        assert freed - rss() > 40 << 20
    finally:
        for block in kept:
            libc.free(block)
