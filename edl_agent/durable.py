"""Files that survive a crash: written whole or not at all, and renames that outlive a power cut.

The agent's state (the fault outbox, the quarantine, prepared DRA claims) and the CDI specs the
container runtime reads are all written this way: a temporary file beside the target, fsync, a
rename over the target, then fsync of the directory, where the new name lives.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename or a removal in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8), creating its directory when missing; a reader sees the
    old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    temporary.replace(path)
    fsync_directory(path.parent)


def set_aside(path: Path) -> Path:
    """Move an unreadable state file to `<name>.corrupt` (kept for a post-mortem, out of the way
    of the next write); returns where it is now (`path` itself when it could not be moved)."""
    aside = path.with_name(path.name + ".corrupt")
    try:
        path.replace(aside)
    except OSError:
        return path
    return aside
