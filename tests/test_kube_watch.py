"""The watch loop as a supervised part: the stop unblocks the read it waits in (a real HTTP
stream), a bug ends the part and the supervisor runs it again from a fresh list, and `stop()` at
any moment is harmless (also between watches, when the last one's connection is back in
urllib3's pool and urllib3 refuses to shut it down)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from structlog.testing import capture_logs

from edl_agent.kube import ApiError
from edl_agent.kube_watch import WatchLoop
from edl_agent.labels.watching import NodeWatcher
from edl_agent.runtime.supervisor import StopSignal, Supervisor
from tests.parts import stop, supervised
from tests.test_kube_rest import NODE, Stream, client, event, running
from tests.waiting import wait_until


class Released:
    """What urllib3 (>= 2.3) answers once a response's connection went back to the pool."""

    def __init__(self) -> None:
        self.calls = 0

    def shutdown(self) -> None:
        self.calls += 1
        msg = "Cannot shutdown as connection has already been released to the pool"
        raise RuntimeError(msg)


def test_stop_after_the_watch_ended_does_not_raise() -> None:
    loop = WatchLoop(log_context={"watch": "test"})
    released = Released()
    loop._opened(released)
    loop.stop()
    assert released.calls == 1


class Blocked:
    """A watch response whose read blocks until it is shut down, as urllib3's does."""

    def __init__(self) -> None:
        self.shut = threading.Event()

    def shutdown(self) -> None:
        self.shut.set()


class Buggy(WatchLoop):
    """Lists, then watches: the first watch hits a bug, the second blocks until shut."""

    name = "buggy"

    def __init__(self) -> None:
        super().__init__(log_context={})
        self.lists = 0
        self.watches = 0
        self.blocked: Blocked | None = None

    def _list(self) -> str | None:
        self.lists += 1
        return "7"

    def _watch(self, version: str | None) -> str | None:
        self.watches += 1
        if self.watches == 1:
            msg = "a handler bug"
            raise KeyError(msg)
        self.blocked = Blocked()
        self._opened(self.blocked)
        self.blocked.shut.wait()
        raise ApiError(None, "watch broke: the response was shut")

    def _retry_delay(self, failures_in_row: int) -> float:
        return 3600.0


def test_a_bug_ends_the_part_and_the_supervisor_runs_it_again_from_a_fresh_list() -> None:
    watch = Buggy()
    with capture_logs() as logs, supervised(watch) as supervisor:
        wait_until(lambda: watch.blocked is not None and supervisor.ready() == (True, "ok"))
        assert supervisor.restarts("buggy") == 1
        assert supervisor.statuses()[0].last_error == "KeyError: 'a handler bug'"
        assert watch.lists == 2  # the run after the bug lists again
    assert watch.blocked is not None
    assert watch.blocked.shut.is_set()  # the stop shut the blocked read
    assert watch.failures == 0  # a read cut short by the stop is no failure
    assert not [e for e in logs if e["event"] == "watch failed; retrying"]


def test_the_stop_unblocks_a_watch_blocked_in_its_read() -> None:
    """A real streaming read (the agent's HTTP client, a server that holds the watch open for
    30 s) returns as the stop is set: the node watch's part ends at once, with no failure."""
    hold = 30.0
    with running() as fake, client(fake.url, token="t0k") as api:  # noqa: S106
        fake.answer = lambda seen: (200, Stream([event("ADDED", NODE)], hold=hold))
        seen: list[Mapping[str, Any]] = []
        watcher = NodeWatcher(api, "n1", seen.append, timeout_seconds=300)
        supervisor = Supervisor(StopSignal())
        supervisor.add(watcher)
        supervisor.start()
        try:
            assert watcher.wait_seen(10)
            wait_until(lambda: supervisor.ready() == (True, "ok"))
        finally:
            began = time.monotonic()
            stop(supervisor, join=hold)
        assert time.monotonic() - began < hold / 3
    assert seen == [NODE]
    assert watcher.failures == 0
