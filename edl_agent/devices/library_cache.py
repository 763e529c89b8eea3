"""Vendor libraries loaded in-process (rocm_smi, DCMI), found under the host root: each is loaded
and initialised once per process and path, then shared (their init calls are process-wide, and a
loaded file stays mapped for the life of the process anyway)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from edl_agent.devices.hostroot import HostRoot

Library = TypeVar("Library")


class Opened(Generic[Library]):
    """`opened(path)`: the process's library at `path`, made with `load` on first use. `load`
    raises what a library that cannot be loaded or initialised raises; nothing is kept then."""

    def __init__(self, load: Callable[[str], Library]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._opened: dict[str, Library] = {}

    def __call__(self, path: str) -> Library:
        with self._lock:
            library = self._opened.get(path)
            if library is None:
                library = self._load(path)
                self._opened[path] = library
            return library


def find(root: HostRoot, directories: tuple[str, ...], name: str) -> str | None:
    """The local path of library `name` in the first of `directories` (host paths) under `root`
    that has it."""
    for directory in directories:
        candidate = root.path(f"{directory}/{name}")
        if candidate.is_file():
            return str(candidate)
    return None


def usable(
    path: str | None, read: Callable[[str], object], errors: tuple[type[Exception], ...]
) -> Path | None:
    """`path` when the library there answers `read` (it loads, initialises and lists its
    devices) without one of `errors`; else None."""
    if path is None:
        return None
    try:
        read(path)
    except errors:
        return None
    return Path(path)
