"""One agent per node: an exclusive lock on a file in kubelet's device-plugin directory, the one
place every agent of a node shares whatever its own settings (a second agent with another state
directory still serves the same kubelet). Taken before anything is served, held for the
process's life; the kernel lets go of it when the process ends, however it ends. Kubelet's
clean-up of that directory removes sockets only, so the file outlives kubelet restarts."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

LOCK_NAME = "edl-agent.lock"


class AnotherAgent(Exception):
    """The lock is held: the message names the holder as it wrote itself down."""


@contextlib.contextmanager
def one_agent_per_node(directory: Path) -> Iterator[None]:
    """Hold `directory/edl-agent.lock` until the block ends; AnotherAgent when it is held."""
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
            msg = (
                f"another edl-agent already serves this node ({holder}; lock {path}): "
                "one agent per node"
            )
            raise AnotherAgent(msg) from None
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        me = f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays, for the next agent to lock
