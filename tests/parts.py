"""Run parts as the agent does, under a supervisor and a `StopSignal` (`running`, or for as long
as a `with` block lasts: `supervised`); once stopped, no thread of theirs may be left."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from edl_agent.runtime.supervisor import Part, StopSignal, Supervisor


@contextlib.contextmanager
def supervised(
    *parts: Part, initial_backoff: float = 0.01, max_backoff: float = 0.05, join: float = 10.0
) -> Iterator[Supervisor]:
    """A started supervisor running `parts` (critical all); stopped and joined on leaving."""
    supervisor = running(*parts, initial_backoff=initial_backoff, max_backoff=max_backoff)
    try:
        yield supervisor
    finally:
        stop(supervisor, join)


def running(*parts: Part, initial_backoff: float = 0.01, max_backoff: float = 0.05) -> Supervisor:
    """A started supervisor running `parts` (critical all), for `stop` to end."""
    supervisor = Supervisor(StopSignal(), initial_backoff=initial_backoff, max_backoff=max_backoff)
    for part in parts:
        supervisor.add(part)
    supervisor.start()
    return supervisor


def stop(supervisor: Supervisor, join: float = 10.0) -> None:
    """Stop `supervisor`'s parts and check that each one's thread ended."""
    supervisor.stop_event.set()
    supervisor.join(join)
    names = {f"part-{s.name}" for s in supervisor.statuses()}
    left = [t.name for t in threading.enumerate() if t.name in names]
    assert not left, f"parts still running after the stop: {left}"
