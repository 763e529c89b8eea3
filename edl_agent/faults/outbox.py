"""The agent's durable outbox: faults wait here until the restarter acknowledges them.

Layout of the directory (the agent's `<state-dir>/outbox`):

    .lock                       flock'ed while an Outbox is open: one owner per directory
    00000000000000000042.json   one fault per file; the number is the send order; the content is
                                the fault as `edl.fault.v1.Fault` in protobuf's JSON form
    corrupt/                    entries that could not be read, moved aside (the newest 100 kept)

Durability: `enqueue` writes a temp file, fsyncs it, renames it into place and fsyncs the
directory before it returns, so an enqueued fault survives a crash of the agent or the node. A
temp file left by a crash mid-write belongs to an enqueue that never returned and is removed on
open. `ack` unlinks without fsync: an ack lost in a crash only sends the fault again, under the
same id, and the restarter answers it as a duplicate.

When the disk refuses a write, the fault is kept in memory (sent, but lost on restart), counted
in `write_errors` and `in_memory`, and logged when writing starts to fail and when it works
again; `add_memory_listener` hears when faults start to be kept in memory only and when none is
any more. A directory that cannot be used at all when the outbox opens (a full or read-only disk)
does not stop the agent: the outbox starts in memory and takes the directory, with what waits
there, as soon as it can (tried every `ATTACH_RETRY_SECONDS`, when the sender asks for faults).
Only a directory another process holds is an error. When `max_entries` are pending, the oldest
is dropped to make room, logged and counted in `dropped`: the newest faults matter most to a
restart decision.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog
from google.protobuf import json_format  # type: ignore[import-untyped]

from edl_agent._proto.edl.fault.v1 import fault_pb2
from edl_agent.faults.convert import InvalidFault, from_proto, to_proto
from edl_agent.faults.model import Fault
from edl_agent.runtime.durable import write_atomically

log = structlog.get_logger(__name__)

ENTRY = re.compile(r"^(\d{20})\.json$")
TEMP_SUFFIX = ".tmp"
CORRUPT_DIR = "corrupt"
CORRUPT_KEPT = 100
MAX_ENTRY_BYTES = 1 << 20
DEFAULT_MAX_ENTRIES = 10_000
ATTACH_RETRY_SECONDS = 10.0


class OutboxError(Exception):
    """The outbox directory cannot be used; the message names it and says why."""


@dataclass(frozen=True)
class OutboxCounts:
    pending: int = 0
    enqueued: int = 0
    dropped: int = 0
    corrupt: int = 0
    write_errors: int = 0
    in_memory: int = 0  # pending faults the disk does not hold (lost if the agent restarts)


@dataclass
class _Entry:
    seq: int
    fault: Fault
    path: Path | None  # None: kept in memory only, the disk refused it


class Outbox:
    """Faults waiting for acknowledgement, in the order they were enqueued. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """OutboxError when another process holds `directory`."""
        if max_entries < 1:
            msg = f"outbox max_entries must be at least 1, not {max_entries}"
            raise ValueError(msg)
        self.directory = directory
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # by fault id, in send order
        self._listeners: list[Callable[[], None]] = []
        self._memory_listeners: list[Callable[[], None]] = []
        self._held = False  # some pending fault is kept in memory only
        self._counts = {"enqueued": 0, "dropped": 0, "corrupt": 0, "write_errors": 0}
        self._lock_file: TextIO | None = None  # None: the directory is not ours (yet)
        self._closed = False
        self._writing_fails = False
        self._next_attach = 0.0
        self._next_seq = 1
        self._attach()
        while len(self._entries) > max_entries:
            self._drop_oldest()

    @property
    def on_disk(self) -> bool:
        """Whether the outbox holds its directory (False: faults are kept in memory only)."""
        return self._lock_file is not None

    def close(self) -> None:
        """Release the directory; pending faults stay on disk for the next owner."""
        with self._lock:
            self._closed = True
            if self._lock_file is not None:
                self._lock_file.close()  # closing releases the flock
                self._lock_file = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` runs after every enqueue that added a fault (the sender's wake-up)."""
        with self._lock:
            self._listeners.append(listener)

    def add_memory_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` runs when faults start to be kept in memory only (the disk refused them)
        and when none is any more (written, acknowledged or dropped); on the caller's thread."""
        with self._lock:
            self._memory_listeners.append(listener)

    def enqueue(self, fault: Fault) -> bool:
        """Keep `fault` until it is acknowledged; False when its id is already pending."""
        with self._lock:
            if self._closed:
                msg = f"the fault outbox in {self.directory} is closed"
                raise OutboxError(msg)
            if fault.id in self._entries:
                return False
            if len(self._entries) >= self.max_entries:
                self._drop_oldest()
            seq = self._next_seq
            self._next_seq += 1
            self._entries[fault.id] = _Entry(seq, fault, self._write(seq, fault))
            self._counts["enqueued"] += 1
            listeners = list(self._listeners) + self._memory_turned()
        for listener in listeners:
            listener()
        return True

    def pending(self, limit: int | None = None) -> list[Fault]:
        """The oldest `limit` pending faults (all when None), oldest first. Outside its
        directory, the outbox tries to take it first (at most every ATTACH_RETRY_SECONDS)."""
        with self._lock:
            if not self._closed and self._clock() >= self._next_attach:
                if self._lock_file is None:
                    self._attach()
                elif any(e.path is None for e in self._entries.values()):
                    self._write_kept()
            entries = list(self._entries.values())
            listeners = self._memory_turned()
        for listener in listeners:
            listener()
        return [e.fault for e in entries[:limit]]

    def ack(self, ids: Iterable[str]) -> int:
        """Forget the faults with these ids (acknowledged, or refused for good); how many."""
        removed = 0
        with self._lock:
            for fault_id in ids:
                entry = self._entries.pop(fault_id, None)
                if entry is None:
                    continue
                removed += 1
                self._remove(entry)
            listeners = self._memory_turned()
        for listener in listeners:
            listener()
        return removed

    def counts(self) -> OutboxCounts:
        with self._lock:
            in_memory = sum(1 for e in self._entries.values() if e.path is None)
            return OutboxCounts(pending=len(self._entries), in_memory=in_memory, **self._counts)

    def _memory_turned(self) -> list[Callable[[], None]]:
        """The memory listeners to call when whether faults are kept in memory only has turned
        since the last look; else none (`_lock` held)."""
        held = any(e.path is None for e in self._entries.values())
        turned, self._held = held != self._held, held
        return list(self._memory_listeners) if turned else []

    # --- disk --------------------------------------------------------------------------------

    def _attach(self) -> None:
        """Take the directory: lock it, read what waits there, write what waits in memory only.
        While the disk refuses, stay in memory (logged once); OutboxError when another process
        holds the directory. Called with `_lock` held, or before the outbox is shared."""
        self._next_attach = self._clock() + ATTACH_RETRY_SECONDS
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock_file = (self.directory / ".lock").open("a")
        except OSError as exc:
            if not self._writing_fails:
                log.error(
                    "outbox: cannot use its directory; faults are kept in memory until it can be",
                    directory=str(self.directory),
                    error=str(exc),
                    retry_seconds=ATTACH_RETRY_SECONDS,
                )
            self._writing_fails = True
            return
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.close()
            msg = f"another process holds the fault outbox in {self.directory}"
            raise OutboxError(msg) from None
        self._lock_file = lock_file
        in_memory = list(self._entries.values())
        self._entries = {}
        self._load()
        # What waited in memory goes after what waited on disk, written now.
        self._next_seq = max((e.seq for e in self._entries.values()), default=0) + 1
        for entry in in_memory:
            if entry.fault.id in self._entries:
                continue
            seq = self._next_seq
            self._next_seq += 1
            self._entries[entry.fault.id] = _Entry(seq, entry.fault, self._write(seq, entry.fault))
        if in_memory:
            log.info("outbox: in its directory again", written=len(in_memory))

    def _load(self) -> None:
        names: list[tuple[int, str]] = []
        for path in self.directory.iterdir():
            if path.name.endswith(TEMP_SUFFIX):
                log.info("outbox: removing an unfinished write", path=str(path))
                with contextlib.suppress(OSError):
                    path.unlink()
            elif match := ENTRY.match(path.name):
                names.append((int(match.group(1)), path.name))
        for seq, name in sorted(names):
            path = self.directory / name
            try:
                fault = _read(path)
            except Exception as exc:  # whatever is unreadable is set aside, never fatal
                self._set_aside(path, f"{type(exc).__name__}: {exc}")
                continue
            if fault.id in self._entries:
                log.warning("outbox: removing a second entry for one fault", fault_id=fault.id)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            self._entries[fault.id] = _Entry(seq, fault, path)
        if self._entries:
            log.info("outbox: faults waiting from before", count=len(self._entries))

    def _write_kept(self) -> None:
        """Write the faults kept in memory when their write failed (the lock held)."""
        self._next_attach = self._clock() + ATTACH_RETRY_SECONDS
        for entry in self._entries.values():
            if entry.path is None:
                entry.path = self._write(entry.seq, entry.fault)

    def _write(self, seq: int, fault: Fault) -> Path | None:
        if self._lock_file is None:
            self._counts["write_errors"] += 1
            return None  # not in the directory: in memory until `_attach` takes it
        path = self.directory / f"{seq:020d}.json"
        temp = path.with_name(path.name + TEMP_SUFFIX)
        text = json_format.MessageToJson(
            to_proto(fault), preserving_proto_field_name=True, indent=None
        )
        try:
            write_atomically(path, text + "\n", temporary=temp)
        except OSError as exc:
            self._counts["write_errors"] += 1
            if not self._writing_fails:
                log.error(
                    "outbox: cannot write faults to disk; kept in memory only",
                    fault_id=fault.id,
                    error=str(exc),
                )
            self._writing_fails = True
            with contextlib.suppress(OSError):
                temp.unlink()
            return None
        if self._writing_fails:
            log.info("outbox: writing faults to disk again")
            self._writing_fails = False
        return path

    def _remove(self, entry: _Entry) -> None:
        if entry.path is None:
            return
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("outbox: cannot remove an entry", path=str(entry.path), error=str(exc))

    def _drop_oldest(self) -> None:
        fault_id = next(iter(self._entries))
        entry = self._entries.pop(fault_id)
        self._remove(entry)
        self._counts["dropped"] += 1
        log.warning(
            "outbox full: dropped the oldest fault",
            fault_id=fault_id,
            kind=str(entry.fault.kind),
            node=entry.fault.node,
            max_entries=self.max_entries,
        )

    def _set_aside(self, path: Path, why: str) -> None:
        self._counts["corrupt"] += 1
        corrupt = self.directory / CORRUPT_DIR
        target = corrupt / f"{path.name}.{time.time_ns()}"
        try:
            corrupt.mkdir(exist_ok=True)
            path.rename(target)
            for old in sorted(corrupt.iterdir(), key=lambda p: p.stat().st_mtime)[:-CORRUPT_KEPT]:
                old.unlink()
        except OSError as exc:
            log.error("outbox: cannot set a corrupt entry aside", path=str(path), error=str(exc))
            return
        log.error("outbox: set a corrupt entry aside", path=str(target), error=why)


def _read(path: Path) -> Fault:
    with path.open("rb") as file:
        data = file.read(MAX_ENTRY_BYTES + 1)
    if len(data) > MAX_ENTRY_BYTES:
        msg = f"entry larger than {MAX_ENTRY_BYTES} bytes"
        raise InvalidFault(msg)
    message = json_format.Parse(data.decode("utf-8"), fault_pb2.Fault(), ignore_unknown_fields=True)
    return from_proto(message)
