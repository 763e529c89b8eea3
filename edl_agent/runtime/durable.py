"""Files that survive a crash: written whole or not at all, and renames that outlive a power cut.

The agent's state (the fault outbox, the quarantine, prepared DRA claims) and the CDI specs the
container runtime reads are all written this way: a temporary file beside the target, fsync, a
rename over the target, then fsync of the directory, where the new name lives. State files are
read back one way too: a file that does not decode is set aside and the caller starts without it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

T = TypeVar("T")

TEMP_SUFFIX = ".tmp"


def fsync_directory(directory: Path) -> None:
    """Make a rename or a removal in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str, *, temporary: Path | None = None) -> None:
    """Replace `path` with `text` (UTF-8), creating its directory when missing; a reader sees the
    old file or the new one, never a part. The new file's mode is what `open` would give it
    (0666 less the umask). It is written first at `temporary` (default: `path` with `.tmp`
    added), in the same directory."""
    data = text.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if temporary is None:
        temporary = path.with_name(path.name + TEMP_SUFFIX)
    # Whatever is at the temporary name (a crashed write's leftover, or a link planted to make us
    # write elsewhere) is unlinked, never followed; the name is then created exclusively, so a
    # link planted again in between is an error, not a write through it.
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
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


def read_state(
    path: Path,
    decode: Callable[[Any], T],
    *,
    what: str,
    log: structlog.typing.FilteringBoundLogger,
    corrupt_level: Literal["warning", "error"] = "error",
) -> tuple[T, str] | None:
    """The JSON state file at `path` decoded, with its text; None when there is none, when it
    cannot be read (logged), or when it does not decode (set aside with `set_aside`, logged at
    `corrupt_level`): the caller then starts without it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error(f"{what} unreadable; starting without it", error=str(exc))
        return None
    try:
        return decode(json.loads(text)), text
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        aside = set_aside(path)
        report = log.warning if corrupt_level == "warning" else log.error
        report(
            f"{what} corrupt; set aside, starting without it",
            error=f"{type(exc).__name__}: {exc}"[:200],
            set_aside=str(aside),
        )
        return None
