"""One way for a test to wait for something to happen: poll until it holds or a deadline passes,
then fail saying what was waited for (and the last value seen). Nothing here means "wait N
seconds": a test that must see nothing happen uses a fake clock or an event instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """What a test waited for did not happen in time."""


class Alive(Protocol):
    def check_alive(self) -> None:
        """Raise when the process a test waits on has died (no point waiting for it)."""


def wait_for(
    what: str,
    fetch: Callable[[], T],
    done: Callable[[T], object],
    timeout: float = 30.0,
    *,
    poll: float = 0.05,
    alive: Alive | None = None,
) -> T:
    """Poll `fetch()` until `done(value)` holds and return that value; WaitTimeout naming `what`
    and the last value after `timeout` seconds (at once when `alive` says its process died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value):
            return value
        if alive is not None:
            alive.check_alive()
        if time.monotonic() > deadline:
            msg = f"timed out after {timeout:g}s waiting for {what}; last: {value!r}"[:2000]
            raise WaitTimeout(msg)
        time.sleep(poll)


def wait_until(
    done: Callable[[], object], timeout: float = 10.0, *, what: str = "", poll: float = 0.01
) -> None:
    """Return once `done()` holds; WaitTimeout naming `what` after `timeout` seconds."""
    wait_for(
        what or getattr(done, "__name__", "a condition"),
        lambda: None,
        lambda _: done(),
        timeout=timeout,
        poll=poll,
    )
